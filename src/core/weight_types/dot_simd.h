// SIMD tiers of the weight dots (same contract as dot_ref.h; bit-identical results).
#pragma once
#include <cstdint>

namespace kvq {

#define KVQ_DECLARE_DOTS(tier)                                            \
  float vec_dot_q2_k_##tier(int64_t n, const void* w, const void* x);     \
  float vec_dot_q3_k_##tier(int64_t n, const void* w, const void* x);     \
  float vec_dot_iq4_xs_##tier(int64_t n, const void* w, const void* x);  \
  float vec_dot_q4_1_##tier(int64_t n, const void* w, const void* x);    \
  float vec_dot_q5_1_##tier(int64_t n, const void* w, const void* x);
KVQ_DECLARE_DOTS(avx2)
KVQ_DECLARE_DOTS(avx512)
#undef KVQ_DECLARE_DOTS

}  // namespace kvq
