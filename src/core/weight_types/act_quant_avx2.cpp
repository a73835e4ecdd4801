// AVX2 activation quantizer (compiled with -mavx2 -mfma -mf16c; the AVX-512 tier uses it too):
// quantize_act's blocks bit for bit (act_blocks.h). The block maximum is exact in any order, the
// scale and 127 / amax are the same scalar f32 operations, x * (127 / amax) is one f32 multiply per
// value and VCVTPS2DQ rounds as nearbyint does (the current rounding mode, nearest-even by default).
#include <immintrin.h>

#include <cstring>

#include "core/weight_types/act_blocks.h"
#include "core/weight_types/act_quant_simd.h"

namespace kvq {
namespace {

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// |x| of 8 values (sign bit cleared).
inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// Quantizes 32 * n32 values (n32 = 1 or 8) with d = amax / 127 into qs; returns d.
inline float quantize_block(const float* x, int n32, int8_t* qs) {
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 32 * n32; i += 8) m = _mm256_max_ps(m, abs8(_mm256_loadu_ps(x + i)));
  const float amax = hmax(m);
  const __m256 id = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int c = 0; c < n32; ++c) {
    const float* xc = x + 32 * c;
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 8 * k), id));
    // |q| <= 127: the saturating packs are exact; they interleave 128-bit halves, undone by `order`.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + 32 * c), _mm256_permutevar8x32_epi32(p, order));
  }
  return amax / 127.0f;
}

// bsums[j] = sum of qs[16j .. 16j + 15] for the 256 values of a q8_k block.
inline void block_sums_q8_k(const int8_t* qs, int16_t* bsums) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  __m256i v[8];  // chunk c: i32 lane j = sum of qs[32c + 4j .. 32c + 4j + 3]
  for (int c = 0; c < 8; ++c) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    v[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
  }
  // Two rounds of pairwise sums leave [b0 b2 b4 b6 | b1 b3 b5 b7] (chunks 0-3) and the same for
  // chunks 4-7 (b_s: the sum of 16-value group s).
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  const __m256i p = _mm256_packs_epi32(a, b);  // [even groups 0..14 | odd groups 1..15] as i16
  const __m128i even = _mm256_castsi256_si128(p), odd = _mm256_extracti128_si256(p, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bsums), _mm_unpacklo_epi16(even, odd));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bsums + 8), _mm_unpackhi_epi16(even, odd));
}

}  // namespace

void quantize_act_avx2(act_type t, const float* x, int64_t n, void* out) {
  switch (t) {
    case act_type::q8_0: {
      auto* q = static_cast<block_q8_x*>(out);
      for (int64_t b = 0; b < n / 32; ++b) q[b].d = quantize_block(x + 32 * b, 1, q[b].qs);
      return;
    }
    case act_type::q8_k: {
      auto* q = static_cast<block_q8_k*>(out);
      for (int64_t b = 0; b < n / qk_k; ++b) {
        q[b].d = quantize_block(x + qk_k * b, qk_k / 32, q[b].qs);
        block_sums_q8_k(q[b].qs, q[b].bsums);
      }
      return;
    }
    default: quantize_act(t, x, n, out); return;  // f32 copy, q8_1: the scalar code
  }
}

}  // namespace kvq
