// KV cache storage formats as data (STYLE.md habit 2, after ggml's type_traits): one packed block
// struct and one traits row per format. Bit layouts and bytes/token formulas: docs/formats.md.
//
// Every compressed code decodes as   value = scale * (code - code_offset) + zero
// where `code` is the stored unsigned b-bit integer (b = 2, 3, 4) or the stored int8 (b = 8),
// `scale` and `zero` are f16 (zero = 0 for symmetric formats).
//
//  per-token  (q8, q4, q3, q2; asymmetric q8a, q4a, q3a, q2a): one scale (and zero) per token per
//     kv head per group of G elements along head_dim (quantize_row_ref).
//     Symmetric 4/3/2 bits: signed scale (as llama.cpp's q4_0, so all 2^b codes are used): the
//     centred codes c = code - code_offset span [-qneg, qpos] = [-8, 7], [-4, 3], [-2, 1]; the
//     element of largest magnitude goes to the -qneg end, so the scale is negative when that
//     element is positive. |scale| = max(extreme / qneg, other side / qpos) rounded UP to f16, so
//     nothing is clamped and the per-element error is <= |scale| / 2.
//     Symmetric 8 bits (q8): c in [-127, 127], scale = absmax / 127 rounded up to f16 (>= 0).
//     Asymmetric: zero = min rounded to f16, scale = (max - zero) / (2^b - 1) rounded up to f16,
//     c = code - code_offset in [0, 2^b - 1] (q8a stores c - 128 as int8).
//  per-channel (K of kivi8, kivi4, kivi2; KIVI, Liu et al. 2024, arXiv:2402.02750, §3.2): a group
//     of T tokens of one kv head shares, per channel, one asymmetric scale and zero, chosen for
//     least squared error over the group (clipped range, then least-squares refits; never worse
//     than min/max), both rounded to nearest f16; the codes are stored per token row exactly like
//     the asymmetric per-token codes. The V of a KIVI cache is per-token asymmetric (kivi_v of the
//     traits row).
//  non-uniform per-token (q4nl, q3nl, q2nl): value = scale * levels[code], levels an int8 codebook
//     of 2^b entries (kv_format_traits::levels, ascending, levels[0] = -127): the Lloyd-Max
//     quantizer (Lloyd 1982; Max 1960) of a group of G = 32 i.i.d. Gaussian coordinates divided by
//     its least-squares scale, the distribution a random rotation gives each coordinate (TurboQuant,
//     Zandieh et al. 2025, arXiv:2504.19874, Sec. 3.1, fits Lloyd-Max levels to it the same way).
//     As IQ4_NL in llama.cpp, the levels are integers so the query dot stays an integer dot. One
//     signed f16 scale per group: the element of largest magnitude starts at the levels[0] end,
//     then the scale is refitted by least squares to the chosen codes (twice), keeping the pair of
//     least squared error; codes are the nearest level. Gaussian data, G 32: mean squared error
//     0.74x (3 bits), 0.39x (2 bits), 0.81x (4 bits) that of the uniform symmetric formats.
//
// Rounding (all tiers and devices must match to stay bit-exact): c = rint(x * (1.0f / scale))
// (asymmetric: rint((x - zero) * (1.0f / scale))) in f32, round-half-to-even, then clamped; a
// zero scale gives c = 0 (value 0, or zero). Formulas and worked bounds: docs/formats.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvq {

enum class kv_format : uint8_t {
  f32, f16, bf16,           // dense baselines
  q8, q4, q3, q2,           // per-token symmetric
  q8a, q4a, q3a, q2a,       // per-token asymmetric (zero point)
  kivi8, kivi4, kivi2,      // KIVI: K per-channel over T-token groups, V per-token asymmetric
  q4nl, q3nl, q2nl,         // per-token symmetric, non-uniform levels (a codebook; see below)
  count
};

enum class kv_layout : uint8_t { dense, per_token, per_channel, count };

// ---- packed code blocks: 32 consecutive elements of one row (docs/formats.md) ----------------
// A row of head_dim elements is a sequence of 32-element blocks; a final partial block of
// m = head_dim % 32 elements (m a multiple of 8) uses the same layout with 32 replaced by m.
struct block_kv8 {   // e[i] = qs[i] (int8)
  int8_t qs[32];
};
struct block_kv4 {   // e[i] = qs[i] & 15, e[i + 16] = qs[i] >> 4            (i < 16)
  uint8_t qs[16];
};
struct block_kv3 {   // low 2 bits as block_kv2 in ql; bit 2 of e[i] = (qh[i / 8] >> (i % 8)) & 1
  uint8_t ql[8];
  uint8_t qh[4];
};
struct block_kv2 {   // e[i + 8k] = (qs[i] >> 2k) & 3                          (i < 8, k < 4)
  uint8_t qs[8];
};
static_assert(sizeof(block_kv8) == 32 && sizeof(block_kv4) == 16);
static_assert(sizeof(block_kv3) == 12 && sizeof(block_kv2) == 8);

struct kv_format_traits {
  kv_format format;
  const char* name;        // the -ctk / -ctv spelling
  kv_layout layout;
  int bits;                // bits per stored element (dense: 32 or 16)
  bool asymmetric;         // a zero point is stored per scale group
  int code_offset;         // value = scale * (code - code_offset) + zero
  int code_max;            // stored code range: [code_min, code_max]
  int code_min;
  int block_bytes;         // bytes of one 32-element code block (sizeof the block struct); dense: 32 * bytes
  kv_format kivi_v;        // per-channel formats: the per-token format used for V; else == format
  bool rotate_by_default;  // "auto" rotation picks hadamard
  const int8_t* levels = nullptr;  // non-uniform formats: value = scale * levels[code] (2^bits
                                   // entries, ascending); nullptr: value = scale * (code - code_offset) + zero
};

const kv_format_traits& kv_traits(kv_format f);
// Looks a -ctk/-ctv name up; returns false when unknown.
bool find_kv_format(const std::string& name, kv_format* out);

// ---- row geometry -------------------------------------------------------------------------
// Bytes of the packed codes of one row of head_dim elements (dense: head_dim * element bytes).
size_t kv_code_bytes(kv_format f, int head_dim);
// f16 values stored per row for a per-token format with `group` elements per scale: the
// head_dim/group scales, then (asymmetric) the head_dim/group zeros. 0 for dense formats.
int kv_row_scale_count(kv_format f, int head_dim, int group);

// ---- packing (bits in {2, 3, 4, 8}); n a multiple of 8 -------------------------------------
// u[n]: codes (for 8 bits the int8 bit pattern) -> packed bytes (kv_code_bytes of n elements).
void pack_codes(int bits, const uint8_t* u, int n, uint8_t* dst);
void unpack_codes(int bits, const uint8_t* src, int n, uint8_t* u);

// ---- scalar reference quantizers (the oracle of every tier) --------------------------------
// One token row of one kv head: x[head_dim] -> codes[kv_code_bytes] + scales[kv_row_scale_count].
// Requires finite |x| <= 65504 (the cache checks); group divides head_dim.
void quantize_row_ref(kv_format f, const float* x, int head_dim, int group, uint8_t* codes,
                      uint16_t* scales);
void dequantize_row_ref(kv_format f, const uint8_t* codes, const uint16_t* scales, int head_dim,
                        int group, float* y);

// Per-channel (KIVI K): x[n_tokens, head_dim] -> codes[n_tokens, kv_code_bytes] (token rows) and
// scales[2 * head_dim] (head_dim scales, then head_dim zeros).
void quantize_channel_group_ref(kv_format f, const float* x, int n_tokens, int head_dim,
                                uint8_t* codes, uint16_t* scales);
void dequantize_channel_group_ref(kv_format f, const uint8_t* codes, const uint16_t* scales,
                                  int n_tokens, int head_dim, float* y);

// Dynamic int8 quantization of one query head (symmetric, absmax / 127, scale kept in f32):
// q[i] = rint(x[i] * (1 / scale)) clamped to [-127, 127]; returns scale (0 for an all-zero x).
float quantize_q8_ref(const float* x, int n, int8_t* q);

// The int16 query of 8-bit K (see attn_query_view::q16): q[i] = rint(x[i] * (1 / scale)) clamped to
// [-kq16_max, kq16_max], scale = absmax / kq16_max (0 for an all-zero x). kq16_max = 127 * 254, so
// every code splits exactly as q = 254 * hi + lo with int8 hi, lo in [-127, 127] (the form the
// CUDA kernel multiplies with two int8 MMAs): the split-precision idea of the Ozaki scheme (Ozaki
// et al. 2012; Ootomo et al. 2024, arXiv:2306.11975, section 3), here for an int8 x int16 dot.
constexpr int kq16_max = 127 * 254;

// Largest scale group (elements) of 8-bit per-token K (q8, q8a) that the fused kernels accept: every
// form of the group's integer dot they accumulate in int32 (Σ q·c, the asymmetric offset term
// 128 Σ q, and their difference Σ q·(c + 128)) is bounded by kq16_max * 255 * group, which stays
// below 2^31 up to 256 elements (2,105,802,240) and not at 512. make_kv_cache refuses larger groups.
constexpr int kq8_k_group_max = 256;
static_assert((long long)kq16_max * 255 * kq8_k_group_max < 2147483647LL);
float quantize_q16_ref(const float* x, int n, int16_t* q);

// f16 value >= v (v >= 0, finite): the scale rounding of every format.
uint16_t f16_round_up(float v);

}  // namespace kvq
