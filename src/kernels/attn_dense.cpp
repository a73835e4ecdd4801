// Dense (f32/f16/bf16) attention over one kv head: the scalar reference tier and the dispatcher.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvq/attention.h"
#include "kvq/cpu.h"
#include "kvq/f16.h"
#include "kernels/attn_dense_tiers.h"

namespace kvq {

namespace {

inline float load_elem(const void* base, kv_elem e, int64_t i) {
  switch (e) {
    case kv_elem::f32: return static_cast<const float*>(base)[i];
    case kv_elem::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

constexpr int kBlock = 64;  // keys per online-softmax step

}  // namespace

void attn_dense_ref(const kv_dense_view& kv, const attn_query_view& qv, attn_state* states) {
  const int hd = kv.head_dim, ng = qv.n_group;
  std::vector<key_span> span(qv.n_tokens);  // rows each query token may see (qv.spec)
  const key_span all = qv.tile_rows(kv.pos_begin, kv.n_pos, span.data());
  const int lo_min = all.lo, max_limit = all.hi;
  std::vector<float> rows((size_t)kBlock * hd), s((size_t)qv.n_tokens * ng * kBlock);
  for (int p0 = lo_min; p0 < max_limit; p0 += kBlock) {
    const int n = std::min(kBlock, max_limit - p0);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < hd; ++i) rows[(size_t)j * hd + i] = load_elem(kv.k_row(p0 + j), kv.type_k, i);
    for (int t = 0; t < qv.n_tokens; ++t) {
      const int j0 = std::clamp(span[t].lo - p0, 0, n), nt = std::clamp(span[t].hi - p0, 0, n);
      for (int g = 0; g < ng; ++g) {
        if (nt <= j0) continue;
        const float* q = qv.q + t * qv.stride_t + (int64_t)g * hd;
        float* sc = &s[(size_t)(t * ng + g) * kBlock];
        float mx = -INFINITY;
        for (int j = j0; j < nt; ++j) {
          float acc = 0.0f;
          for (int i = 0; i < hd; ++i) acc += q[i] * rows[(size_t)j * hd + i];
          sc[j] = qv.spec.logit(acc * qv.spec.scale);
          mx = std::max(mx, sc[j]);
        }
        attn_state& st = states[t * ng + g];
        st.rescale_to(mx);
        for (int j = j0; j < nt; ++j) {
          sc[j] = std::exp(sc[j] - st.m);
          st.d += sc[j];
        }
      }
    }
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < hd; ++i) rows[(size_t)j * hd + i] = load_elem(kv.v_row(p0 + j), kv.type_v, i);
    for (int t = 0; t < qv.n_tokens; ++t) {
      const int j0 = std::clamp(span[t].lo - p0, 0, n), nt = std::clamp(span[t].hi - p0, 0, n);
      for (int g = 0; g < ng; ++g) {
        float* o = states[t * ng + g].o;
        const float* sc = &s[(size_t)(t * ng + g) * kBlock];
        for (int j = j0; j < nt; ++j)
          for (int i = 0; i < hd; ++i) o[i] += sc[j] * rows[(size_t)j * hd + i];
      }
    }
  }
}

void attn_dense(const kv_dense_view& kv, const attn_query_view& q, attn_state* states) {
  if (best_isa() >= isa::avx512 && attn_dense_supported_avx512(kv)) return attn_dense_avx512(kv, q, states);
  if (best_isa() >= isa::avx2 && attn_dense_supported_avx2(kv)) return attn_dense_avx2(kv, q, states);
  attn_dense_ref(kv, q, states);
}

}  // namespace kvq
