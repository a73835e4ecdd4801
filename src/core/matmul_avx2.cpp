// AVX2 + FMA + F16C row kernels for matmul (compiled with -mavx2 -mfma -mf16c; called only after
// runtime dispatch). Register-tiled: an R-row x T-token tile keeps R*T accumulators, so each weight
// vector loaded (and widened from f16/bf16) is used T times and each x vector R times.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "core/matmul_kernels.h"
#include "kvq/f16.h"

namespace kvq::detail {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Loaders: 8 weights starting at element i of a row, widened to f32; and one scalar.
struct load_f32 {
  static __m256 v8(const uint8_t* row, int64_t i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
  static float s1(const uint8_t* row, int64_t i) { return reinterpret_cast<const float*>(row)[i]; }
};
struct load_f16 {
  static __m256 v8(const uint8_t* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  }
  static float s1(const uint8_t* row, int64_t i) {
    return f16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
  }
};
struct load_bf16 {
  static __m256 v8(const uint8_t* row, int64_t i) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static float s1(const uint8_t* row, int64_t i) {
    return bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
  }
};

// y[t, r] for R rows starting at w0 and T tokens starting at x0.
template <class L, int R, int T>
inline void tile_float(const uint8_t* w0, size_t row_bytes, const float* x0, int64_t n_in, float* y0,
                       int64_t n_out) {
  __m256 acc[R][T];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t n8 = n_in & ~(int64_t)7;
  for (int64_t i = 0; i < n8; i += 8) {
    __m256 xv[T];
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x0 + t * n_in + i);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 wv = L::v8(w0 + r * row_bytes, i);
      #pragma GCC unroll 16
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t i = n8; i < n_in; ++i) s += L::s1(w0 + r * row_bytes, i) * x0[t * n_in + i];
      y0[t * n_out + r] = s;
    }
}

template <class L>
void rows_float(const matmul_task& task, int64_t r0, int64_t r1) {
  const weight_view& w = task.w;
  const int64_t n_in = w.n_in, n_out = w.n_out, n_tok = task.n_tokens;
  const size_t rb = w.row_bytes;
  auto wrow = [&](int64_t r) { return w.data + (size_t)r * rb; };
  if (n_tok == 1) {  // decode: 8 rows per pass -> 8 independent FMA chains
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) tile_float<L, 8, 1>(wrow(r), rb, task.x, n_in, task.y + r, n_out);
    for (; r < r1; ++r) tile_float<L, 1, 1>(wrow(r), rb, task.x, n_in, task.y + r, n_out);
    return;
  }
  // Prefill: token chunks whose x fits in ~128 KiB of L2, rows in tiles of 4, tokens in tiles of 3
  // (12 accumulators + 3 x vectors + 1 weight vector = the 16 ymm registers).
  constexpr int R = 4, T = 3;
  const int64_t tc = std::max<int64_t>(T, (32768 / std::max<int64_t>(n_in, 1)) / T * T);
  for (int64_t t0 = 0; t0 < n_tok; t0 += tc) {
    const int64_t t1 = std::min(n_tok, t0 + tc);
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      int64_t t = t0;
      for (; t + T <= t1; t += T)
        tile_float<L, R, T>(wrow(r), rb, task.x + t * n_in, n_in, task.y + t * n_out + r, n_out);
      for (; t < t1; ++t)
        tile_float<L, R, 1>(wrow(r), rb, task.x + t * n_in, n_in, task.y + t * n_out + r, n_out);
    }
    for (; r < r1; ++r) {
      int64_t t = t0;
      for (; t + T <= t1; t += T)
        tile_float<L, 1, T>(wrow(r), rb, task.x + t * n_in, n_in, task.y + t * n_out + r, n_out);
      for (; t < t1; ++t)
        tile_float<L, 1, 1>(wrow(r), rb, task.x + t * n_in, n_in, task.y + t * n_out + r, n_out);
    }
  }
}

// --- 32-value symmetric weights (q8_0, q4_0, q5_0, iq4_nl) x q8_0 activations --------------------

// 32 signed weights of block b of a row, and its scale.
struct load_q8_0 {
  static __m256i q32(const uint8_t* row, int64_t b, float* d) {
    const auto& blk = reinterpret_cast<const block_q8_0*>(row)[b];
    *d = f16_to_f32(blk.d);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
  }
};
struct load_q4_0 {
  static __m256i q32(const uint8_t* row, int64_t b, float* d) {
    const auto& blk = reinterpret_cast<const block_q4_0*>(row)[b];
    *d = f16_to_f32(blk.d);
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(p, m);                     // elements 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(p, 4), m);  // elements 16..31
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
  }
};

// The 16 nibbles of qs as 32 bytes: low nibbles (elements 0..15), then high (16..31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m), _mm_and_si128(p, m));
}

struct load_q5_0 {
  static __m256i q32(const uint8_t* row, int64_t b, float* d) {
    const auto& blk = reinterpret_cast<const block_q5_0*>(row)[b];
    *d = f16_to_f32(blk.d);
    uint32_t qh;
    std::memcpy(&qh, blk.qh, 4);
    // Byte i of `bits` is 0xff when bit i of qh is set: spread byte i/8 of qh to byte i, then
    // compare with a mask that has every bit but bit i%8 set.
    __m256i bits = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
    const __m256i q = _mm256_or_si256(nibbles32(blk.qs), _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
  }
};
struct load_iq4_nl {
  static __m256i q32(const uint8_t* row, int64_t b, float* d) {
    const auto& blk = reinterpret_cast<const block_iq4_nl*>(row)[b];
    *d = f16_to_f32(blk.d);
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kvalues_iq4nl));
    return _mm256_shuffle_epi8(_mm256_set_m128i(lut, lut), nibbles32(blk.qs));
  }
};

// sum over 32 lanes of w*x as 8 int32 partial sums converted to f32. |w| <= 128, |x| <= 127, so
// each maddubs pair sum is <= 32512 and does not saturate.
inline __m256 dot32(__m256i aw, __m256i wq, __m256i xq) {
  const __m256i sx = _mm256_sign_epi8(xq, wq);
  const __m256i p16 = _mm256_maddubs_epi16(aw, sx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

template <class L, int R, int T>
inline void tile_quant(const uint8_t* w0, size_t row_bytes, const block_q8_x* xq0, int64_t nb,
                       float* y0, int64_t n_out) {
  __m256 acc[R][T];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      float dw;
      const __m256i wq = L::q32(w0 + r * row_bytes, b, &dw);
      const __m256i aw = _mm256_sign_epi8(wq, wq);
      #pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const block_q8_x& xb = xq0[t * nb + b];
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
        acc[r][t] = _mm256_fmadd_ps(dot32(aw, wq, xv), _mm256_set1_ps(dw * xb.d), acc[r][t]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int t = 0; t < T; ++t) y0[t * n_out + r] = hsum(acc[r][t]);
}

template <class L>
void rows_quant(const matmul_task& task, int64_t r0, int64_t r1) {
  const weight_view& w = task.w;
  const int64_t nb = w.n_in / qk8_0, n_out = w.n_out, n_tok = task.n_tokens;
  const size_t rb = w.row_bytes;
  auto wrow = [&](int64_t r) { return w.data + (size_t)r * rb; };
  const auto* xq = static_cast<const block_q8_x*>(task.xq);  // [n_tok, nb]
  constexpr int R = 4, T = 2;
  // Token chunks whose quantized x (36 bytes per 32 values) stays in ~16 KiB of L1.
  const int64_t tc = std::max<int64_t>(T, (16384 / (nb * (int64_t)sizeof(block_q8_x))) / T * T);
  for (int64_t t0 = 0; t0 < n_tok; t0 += tc) {
    const int64_t t1 = std::min(n_tok, t0 + tc);
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
      int64_t t = t0;
      for (; t + T <= t1; t += T)
        tile_quant<L, R, T>(wrow(r), rb, xq + t * nb, nb, task.y + t * n_out + r, n_out);
      for (; t < t1; ++t)
        tile_quant<L, R, 1>(wrow(r), rb, xq + t * nb, nb, task.y + t * n_out + r, n_out);
    }
    for (; r < r1; ++r)
      for (int64_t t = t0; t < t1; ++t)
        tile_quant<L, 1, 1>(wrow(r), rb, xq + t * nb, nb, task.y + t * n_out + r, n_out);
  }
}

}  // namespace

void matmul_rows_avx2(const matmul_task& task, int64_t r0, int64_t r1) {
  switch (task.w.type) {
    case ggml_type::f32: return rows_float<load_f32>(task, r0, r1);
    case ggml_type::f16: return rows_float<load_f16>(task, r0, r1);
    case ggml_type::bf16: return rows_float<load_bf16>(task, r0, r1);
    case ggml_type::q8_0: return rows_quant<load_q8_0>(task, r0, r1);
    case ggml_type::q4_0: return rows_quant<load_q4_0>(task, r0, r1);
    case ggml_type::q5_0: return rows_quant<load_q5_0>(task, r0, r1);
    case ggml_type::iq4_nl: return rows_quant<load_iq4_nl>(task, r0, r1);
    default: return matmul_rows_vec_dot(task, r0, r1);  // unreachable: the traits rows say which
  }
}

}  // namespace kvq::detail
