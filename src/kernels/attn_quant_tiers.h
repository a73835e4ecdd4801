// Private: pieces of the fused quantized attention shared by the tiers and their tests.
#pragma once
#include "kvq/attention.h"

namespace kvq {

// The int8/int16 query scales of query (t, g): one per head (q8_group == 0: element 0) or one per
// K group (n_k_groups of them).
inline const float* q8_scales(const attn_query_view& qv, int64_t t, int64_t g, int n_k_groups) {
  return qv.q8_scale + t * qv.q8_scale_stride_t + (qv.q8_group ? g * n_k_groups : g);
}

// Row r of a V side (dense or per-token) dequantized to f32 y[hd].
void load_v_row_ref(const kv_quant_side& s, int r, int hd, float* y);
// dots[j * n_groups + g] = sum over group g of q8[i] * code[i] (stored codes, i32) for rows
// [r0, r0 + n_rows) of a per-token side. The integer part every tier must match bit for bit.
void qk_i32_ref(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots);
void qk_i32_ref(const kv_quant_side& k, int r0, int n_rows, const int16_t* q16, int hd, int32_t* dots);
void qk_i32_avx2(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots);
void qk_i32_avx512(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots);
// Test hook: the same dots as the fused engine's own integer scorers compute them (tile_scores_packed
// for 4/2-bit K, tile_scores_int for 8/3-bit K with an int8 query, tile_scores_i16 for 8-bit K
// with an int16 query, through the engine's with_shape dispatch, 32-row blocks and the tier's
// tiles: 8 rows, or 16 for the AVX-512 packed scorer),
// for n_q queries q8[n_q, hd] (or q16[n_q, hd], 8-bit K only; the other pointer null) and rows
// [r0, r0 + n_rows): dots[(qi * n_rows + j) * n_groups + g], as the float each scorer returns.
// The scorers return only float scores, so each group is scored with unit constants (K scale 1 in
// that group and 0 in the others, query scale 1, no offset, no zero, no attention scale): every
// float operation is then exact and the float is the scorer's i32 dot converted once, exact while
// |dot| < 2^24 (or dot has enough trailing zeros). n_q <= 8.
void qk_engine_dots_avx2(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, const int16_t* q16, int n_q,
                         int hd, float* dots);
void qk_engine_dots_avx512(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, const int16_t* q16,
                           int n_q, int hd, float* dots);
// sums[g] = sum over group g of q8[i].
void q8_group_sums(const int8_t* q8, int hd, int group, int32_t* sums);
void q8_group_sums(const int16_t* q16, int hd, int group, int32_t* sums);

// Per-token rows [r0, r0 + n_rows) dequantized to y[n_rows, hd] (hd % 16 == 0, group % 32 == 0 or
// group == hd): the dequantize-then-attend baseline's fast path.
void dequantize_rows_avx2(const kv_quant_side& side, int r0, int n_rows, int hd, float* y);
void dequantize_rows_avx512(const kv_quant_side& side, int r0, int n_rows, int hd, float* y);

// The SIMD tiers (one source, attn_quant_simd.inc): AVX2, and AVX-512 VL + VNNI (VPDPBUSD dots).
// Call only when best_isa() reaches the tier; same shapes supported by both.
bool attn_quant_supported_avx2(const kv_quant_view& kv);
void attn_quant_avx2(const kv_quant_view& kv, const attn_query_view& q, attn_state* states);
bool attn_quant_supported_avx512(const kv_quant_view& kv);
void attn_quant_avx512(const kv_quant_view& kv, const attn_query_view& q, attn_state* states);

}  // namespace kvq
