// AVX2 FWHT. The three in-register stages (h = 1, 2, 4) use a permute plus a blend of (v + t) and
// (t - v); with t the partner element this yields exactly a + b and a - b as in the scalar oracle,
// so the two tiers agree bit for bit.
#include <immintrin.h>

#include <cmath>

#include "rotation/fwht.h"

namespace kvq {

static inline __m256 stage_in_register(__m256 v) {
  __m256 t = _mm256_permute_ps(v, 0xB1);  // h = 1: swap neighbours
  v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xAA);
  t = _mm256_permute_ps(v, 0x4E);  // h = 2: swap pairs
  v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xCC);
  t = _mm256_permute2f128_ps(v, v, 0x01);  // h = 4: swap 128-bit halves
  return _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xF0);
}

void fwht_radix2_avx2(float* x, int n) {
  if (n < 8) {
    fwht_radix2_ref(x, n);
    return;
  }
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, stage_in_register(_mm256_loadu_ps(x + i)));
  for (int h = 8; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
  const __m256 s = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
}

}  // namespace kvq
