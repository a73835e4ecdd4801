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
  const int hd = kv.head_dim;
  float s[kBlock];
  for (int t = 0; t < qv.n_tokens; ++t) {
    // causal: rows whose position <= pos0 + t
    const int last = std::min(kv.n_pos, qv.pos0 + t - kv.pos_begin + 1);
    for (int g = 0; g < qv.n_group; ++g) {
      const float* q = qv.q + t * qv.stride_t + (int64_t)g * hd;
      attn_state& st = states[t * qv.n_group + g];
      for (int p0 = 0; p0 < last; p0 += kBlock) {
        const int n = std::min(kBlock, last - p0);
        float mx = -INFINITY;
        for (int j = 0; j < n; ++j) {
          const int64_t row = (int64_t)(p0 + j) * kv.row_stride;
          float acc = 0.0f;
          for (int i = 0; i < hd; ++i) acc += q[i] * load_elem(kv.k, kv.type_k, row + i);
          s[j] = acc * qv.scale;
          mx = std::max(mx, s[j]);
        }
        st.rescale_to(mx);
        for (int j = 0; j < n; ++j) {
          const float w = std::exp(s[j] - st.m);
          st.d += w;
          const int64_t row = (int64_t)(p0 + j) * kv.row_stride;
          for (int i = 0; i < hd; ++i) st.o[i] += w * load_elem(kv.v, kv.type_v, row + i);
        }
      }
    }
  }
}

void attn_dense(const kv_dense_view& kv, const attn_query_view& q, attn_state* states) {
  if (best_isa() >= isa::avx2 && attn_dense_avx2_supported(kv)) return attn_dense_avx2(kv, q, states);
  attn_dense_ref(kv, q, states);
}

}  // namespace kvq
