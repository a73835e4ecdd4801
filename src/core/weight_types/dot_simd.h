// SIMD tiers of the weight dots (same contract as dot_ref.h; bit-identical results).
#pragma once
#include <cstdint>

namespace kvq {

float vec_dot_q4_k_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q6_k_avx2(int64_t n, const void* w, const void* x);
float vec_dot_q4_k_avx512(int64_t n, const void* w, const void* x);
float vec_dot_q6_k_avx512(int64_t n, const void* w, const void* x);

}  // namespace kvq
