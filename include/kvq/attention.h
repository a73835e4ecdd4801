// Attention building blocks shared by every KV cache and every kernel tier (CPU and CUDA).
//
// attn_state is the online-softmax accumulator of one query head over one partition of the keys
// (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention,
// Dao et al. 2022, §3.1; FlashDecoding split-KV): m = max score seen, d = sum_j exp(s_j - m),
// o[head_dim] = sum_j exp(s_j - m) v_j (unnormalised). Partitions (threads, split-K chunks, the
// exact sink/recent windows and the quantized body) are combined with merge(), which is
// associative and commutative up to f32 rounding. An empty partition (d == 0, m == -inf) merges
// as weight 0 and never produces NaN. (STYLE.md habit 5, after FlashInfer's state_t.)
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvq/cpu.h"
#include "kvq/quant.h"

namespace kvq {

struct attn_state {
  float m = -std::numeric_limits<float>::infinity();  // running max of scaled scores
  float d = 0.0f;                                     // sum_j exp(s_j - m)
  float* o = nullptr;                                 // [head_dim] sum_j exp(s_j - m) v_j
  int head_dim = 0;

  // An empty state over caller-owned o_buf[head_dim] (zeroed here).
  static attn_state empty(float* o_buf, int head_dim) {
    attn_state s;
    s.o = o_buf;
    s.head_dim = head_dim;
    for (int i = 0; i < head_dim; ++i) o_buf[i] = 0.0f;
    return s;
  }
  bool is_empty() const { return !(d > 0.0f); }

  // this <- this ⊕ b (b.head_dim must equal head_dim). Empty b is a no-op; empty this copies b.
  void merge(const attn_state& b) {
    if (b.is_empty()) return;
    if (is_empty()) {
      m = b.m;
      d = b.d;
      for (int i = 0; i < head_dim; ++i) o[i] = b.o[i];
      return;
    }
    const float mn = m > b.m ? m : b.m;
    const float wa = std::exp(m - mn), wb = std::exp(b.m - mn);
    m = mn;
    d = d * wa + b.d * wb;
    for (int i = 0; i < head_dim; ++i) o[i] = o[i] * wa + b.o[i] * wb;
  }

  // Rescales the state to a new maximum m_new >= m (used before adding a block of scores).
  // Returns the factor applied to d and o.
  float rescale_to(float m_new) {
    if (m_new <= m) return 1.0f;
    const float w = is_empty() ? 0.0f : std::exp(m - m_new);
    m = m_new;
    d *= w;
    for (int i = 0; i < head_dim; ++i) o[i] *= w;
    return w;
  }

  // out[head_dim] = o / d; zeros for an empty state (attention over no keys).
  void finalize(float* out) const {
    if (is_empty()) {
      for (int i = 0; i < head_dim; ++i) out[i] = 0.0f;
      return;
    }
    const float inv = 1.0f / d;
    for (int i = 0; i < head_dim; ++i) out[i] = o[i] * inv;
  }
};

// Element type of a dense (exact) K or V row.
enum class kv_elem : uint8_t { f32, f16, bf16, count };
inline int kv_elem_bytes(kv_elem e) { return e == kv_elem::f32 ? 4 : 2; }

// A dense K/V view of one kv head (STYLE.md habit 3: kernels take views). Row p (p in
// [0, n_pos)) of K is at k + p * row_stride elements; same for V. Position of row p is pos_begin + p.
// Paged rows (page_rows > 0; a paged cache's pages read in place, after FlashInfer's paged_kv_t):
// row p of K is row x % page_rows of page x / page_rows, x = page_row0 + p, whose row 0 is at
// k_pages[x / page_rows] (rows row_stride elements apart within a page); V alike through v_pages;
// k and v are then unused. Every tier's result depends on the rows' values and the view's bounds
// only, never on where the rows lie: a paged view gives bit for bit what the same rows gathered
// into one contiguous view give.
struct kv_dense_view {
  const void* k = nullptr;
  const void* v = nullptr;
  kv_elem type_k = kv_elem::f32, type_v = kv_elem::f32;
  int64_t row_stride = 0;  // elements between consecutive positions (within a page when paged)
  int pos_begin = 0;       // absolute position of row 0
  int n_pos = 0;           // rows in this view
  int head_dim = 0;
  const void* const* k_pages = nullptr;  // [(page_row0 + n_pos - 1) / page_rows + 1] when paged
  const void* const* v_pages = nullptr;  // alike
  int page_rows = 0;                     // rows per page; 0: not paged (k / v)
  int page_row0 = 0;                     // row of the first page that holds view row 0, < page_rows

  // K (V: v_row) row p's first element (the row's address; bytes of its element type).
  const void* k_row(int p) const { return row_at(k, k_pages, type_k, p); }
  const void* v_row(int p) const { return row_at(v, v_pages, type_v, p); }

 private:
  const void* row_at(const void* base, const void* const* pages, kv_elem e, int p) const {
    const int eb = kv_elem_bytes(e);
    if (page_rows <= 0) return static_cast<const char*>(base) + (int64_t)p * row_stride * eb;
    const int x = page_row0 + p;
    return static_cast<const char*>(pages[x / page_rows]) + (int64_t)(x % page_rows) * row_stride * eb;
  }
};

// Key positions [lo, hi) (absolute, tokens).
struct key_span {
  int lo = 0, hi = 0;
  bool empty() const { return hi <= lo; }
};

// The attention variant of a layer, as data (STYLE.md "attention variants are data", after
// FlashInfer's variants.cuh LogitsTransform / LogitsMask): every tier reads it from the query view
// and derives the keys a query may see from key_range() alone.
//   logit    = softcap(scale * q·k)
//   softcap  c > 0: x -> c * tanh(x / c) (Gemma 2, arXiv:2408.00118 §2); 0 = none
//   window   W > 0: a query at position p sees keys [p - W + 1, p] (sliding-window attention as in
//            Mistral 7B, arXiv:2310.06825 §2, and llama.cpp's standard SWA); 0 = global (causal
//            only: [0, p])
// Room for learned attention sinks (one extra logit per head in the softmax denominator, gpt-oss):
// a field here, honoured by every tier, when a model needs it.
struct attn_spec {
  float scale = 1.0f;
  int window = 0;         // tokens; 0 = global
  float softcap = 0.0f;   // 0 = none

  // The keys a query at position pos may see (hi = pos + 1: causal).
  key_span key_range(int pos) const { return {window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, pos + 1}; }
  // The same span as rows [lo, hi) of a view whose row 0 is position pos_begin, clamped to [0, n_pos).
  key_span view_rows(int pos, int pos_begin, int n_pos) const {
    const key_span k = key_range(pos);
    auto clamp = [&](int x) { return x < pos_begin ? 0 : x - pos_begin > n_pos ? n_pos : x - pos_begin; };
    return {clamp(k.lo), clamp(k.hi)};
  }
  // The logit of a scaled score x = scale * q·k.
  float logit(float x) const { return softcap > 0.0f ? softcap * std::tanh(x / softcap) : x; }
  double logit(double x) const { return softcap > 0.0f ? softcap * std::tanh(x / softcap) : x; }
};

// The queries of the GQA group that shares one kv head. Query token t (t < n_tokens), group member
// g (g < n_group) is at q + t * stride_t + g * head_dim, sits at absolute position pos0 + t and
// attends to spec.key_range(pos0 + t). Logits are spec.logit(spec.scale * q·k).
struct attn_query_view {
  const float* q = nullptr;
  int64_t stride_t = 0;  // elements between consecutive query tokens
  int n_tokens = 0;
  int n_group = 0;
  int head_dim = 0;
  int pos0 = 0;
  attn_spec spec;
  // Rows [lo, hi) of a view (row 0 at pos_begin, n_pos rows) that query token t may see.
  key_span rows(int t, int pos_begin, int n_pos) const { return spec.view_rows(pos0 + t, pos_begin, n_pos); }
  // rows() of every query token into span[0, n_tokens), and the rows any of them sees: [lo of the
  // first row any token sees, hi of the last); {n_pos, 0} (empty) when none sees a row.
  key_span tile_rows(int pos_begin, int n_pos, key_span* span) const {
    key_span all{n_pos, 0};
    for (int t = 0; t < n_tokens; ++t) {
      span[t] = rows(t, pos_begin, n_pos);
      if (span[t].empty()) continue;
      all.lo = span[t].lo < all.lo ? span[t].lo : all.lo;
      all.hi = span[t].hi > all.hi ? span[t].hi : all.hi;
    }
    return all;
  }
  // The same queries quantized to int8, required by views whose K is per-token quantized: q8 uses
  // the same indexing as q. q8_group == 0: one scale per head (quantize_q8_ref over head_dim),
  // q8_scale[t * q8_scale_stride_t + g]. q8_group == K's group (elements along head_dim): one
  // scale per K group, as llama.cpp's q8_0 quantizes the query per 32-element block;
  // q8_scale[t * q8_scale_stride_t + g * (head_dim / q8_group) + i] for group i.
  const int8_t* q8 = nullptr;
  const float* q8_scale = nullptr;
  int64_t q8_scale_stride_t = 0;
  int q8_group = 0;
  // 8-bit K only, optional: the queries as int16 (quantize_q16_ref, same indexing as q8), used
  // instead of q8 when set; q8_scale then holds the int16 scales. An int8 query's rounding error is
  // as large as 8-bit K's own and about a sixth of q8's KL divergence on tinylit; int16 removes it
  // while the dots stay exact integers (|q| <= kq16_max, |code| <= 128: sums fit i32 up to
  // head_dim 256).
  const int16_t* q16 = nullptr;
};

// One side (K or V) of a compressed (or dense) body of one kv head. Row j (token pos_begin + j)
// has its codes at codes + j * code_stride (bytes). Scales (f16):
//   per_token:   row j's kv_row_scale_count values at scales + j * scale_stride;
//   per_channel: rows [T*i, T*i + T) share scales + i * scale_stride: [head_dim] scales then
//                [head_dim] zeros (T = group, tokens per group; row 0 starts a group);
//   dense:       unused (codes are f32/f16/bf16 elements).
struct kv_quant_side {
  kv_format format = kv_format::f16;
  const uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  const uint16_t* scales = nullptr;
  int64_t scale_stride = 0;
  int group = 0;  // per_token: elements per scale along head_dim; per_channel: tokens per group
};
struct kv_quant_view {
  kv_quant_side k, v;  // v.format is dense or per_token
  int pos_begin = 0;
  int n_pos = 0;
  int head_dim = 0;
};

// Adds the dense view's contribution to states[t * n_group + g] (only the keys of
// q.spec.key_range(pos0 + t)). Scalar reference tier (float64-free, f32 accumulation in blocks of 64 keys).
void attn_dense_ref(const kv_dense_view& kv, const attn_query_view& q, attn_state* states);
// Same contract; runtime-dispatched to the best tier (AVX2 when available).
void attn_dense(const kv_dense_view& kv, const attn_query_view& q, attn_state* states);

// Fused compressed-domain attention over a quantized view, same contract as attn_dense. Per-token
// K: scores = q8_scale * sum_groups scale * (int8(q) . codes, accumulated in i32) (+ zero terms);
// per-channel K: float q folded with the per-channel scales; V accumulated from the packed codes
// one row at a time (never a dequantized copy). The _ref tier is the oracle; attn_quant picks the
// best tier at run time (KVQ_ISA lowers it). Integer dot products are bit-exact across tiers.
// Errors: unsupported for 8-bit per-token K with a group above kq8_k_group_max (its i32 group dot
// could wrap), in every tier.
void attn_quant_ref(const kv_quant_view& kv, const attn_query_view& q, attn_state* states);
void attn_quant(const kv_quant_view& kv, const attn_query_view& q, attn_state* states);
// The tier attn_quant (and attn_dense, for dense formats) runs for views of these formats, groups
// and head_dim on this machine: best_isa() (lowered by KVQ_ISA) when the SIMD engine takes the
// shape (head_dim a multiple of 16 up to 256, per-token groups a multiple of 32 or head_dim),
// else isa::scalar (the reference tier, 10-30x slower). Only the formats, groups and head_dim of
// kv are read.
isa attn_quant_tier(const kv_quant_view& kv);

// Baseline only (benchmarks and tests): dequantizes the whole view into f32 K/V buffers (AVX2
// dequantizer where available), then attends in f32 (attn_dense) with the query each kernel would
// see (int8-dequantized q for per-token K, f32 q otherwise), so it equals attn_quant up to f32
// rounding. Allocates.
void attn_dequant_ref(const kv_quant_view& kv, const attn_query_view& q, attn_state* states);

}  // namespace kvq
