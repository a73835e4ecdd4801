// Fused compressed-domain attention, AVX2 tier (also serves the dense f32/f16/bf16 views).
//
// One call handles one kv head and the queries of its GQA group (and of a prefill tile), in blocks
// of 32 keys: (1) the block's K rows are unpacked once into an L1 buffer (codes, not values, for
// the integer formats); (2) every query scores them: per-token K with int8(Q)·codes accumulated in
// i32 (maddubs/madd; bit-exact with qk_i32_ref), dense and KIVI K with an f32 dot; (3) online
// softmax with a vector exp; (4) the block's V rows are decoded once and accumulated into every
// query's o with register-blocked FMAs. No dequantized copy of the cache exists beyond 32 rows in
// L1. This file touches only plain data and intrinsics (no inline library code with loops), so no
// AVX2 instruction leaks into code shared with other tiers.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/attn_dense_tiers.h"
#include "kernels/attn_quant_tiers.h"

namespace kvq {

namespace {

constexpr int kB = 32;        // keys per block
constexpr int kMaxHd = 256;   // head_dim supported by this tier
constexpr int kMaxQ = 64;     // (token, head) queries per engine pass

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [sum a, sum b, sum c, sum d] of four 8 x i32 vectors.
inline __m128i hsum4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

// exp(x) for x <= 0 (scores minus the running max), about 2 ulp; exactly 0 below -87.
inline __m256 exp_neg256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

// One row of packed codes (hd % 32 == 0) -> hd bytes: u8 codes (2/3/4 bits) or the int8 codes.
template <int Bits>
inline void unpack_row_t(const uint8_t* src, int hd, uint8_t* dst) {
  const __m128i m0f = _mm_set1_epi8(0x0f);
  const __m256i m03 = _mm256_set1_epi8(0x03);
  for (int b = 0; b < hd; b += 32) {
    if constexpr (Bits == 8) {
      _mm256_storeu_si256((__m256i*)(dst + b), _mm256_loadu_si256((const __m256i*)src));
      src += 32;
    } else if constexpr (Bits == 4) {
      const __m128i v = _mm_loadu_si128((const __m128i*)src);
      _mm_storeu_si128((__m128i*)(dst + b), _mm_and_si128(v, m0f));
      _mm_storeu_si128((__m128i*)(dst + b + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m0f));
      src += 16;
    } else {  // 2 or 3 bits: the 2-bit plane, then (3 bits) the bit-2 plane
      uint64_t w;
      std::memcpy(&w, src, 8);
      __m256i v = _mm256_and_si256(
          _mm256_srlv_epi64(_mm256_set1_epi64x((long long)w), _mm256_set_epi64x(6, 4, 2, 0)), m03);
      src += 8;
      if constexpr (Bits == 3) {
        uint32_t h;
        std::memcpy(&h, src, 4);
        const __m256i idx = _mm256_set_epi8(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,  //
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        const __m256i hb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), idx);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(4)));
        src += 4;
      }
      _mm256_storeu_si256((__m256i*)(dst + b), v);
    }
  }
}

// n rows (row stride `stride` bytes) -> dst[n * hd]; the bit width dispatched once. Contiguous
// rows (stride == packed row bytes) unpack as one stream: 32-element blocks never straddle rows.
inline void unpack_rows(int bits, const uint8_t* src, int64_t stride, int n, int hd, uint8_t* dst) {
  if (stride == (int64_t)hd * bits / 8) {
    hd *= n;
    n = 1;
  }
  switch (bits) {
    case 8: for (int j = 0; j < n; ++j) unpack_row_t<8>(src + j * stride, hd, dst + j * hd); break;
    case 4: for (int j = 0; j < n; ++j) unpack_row_t<4>(src + j * stride, hd, dst + j * hd); break;
    case 3: for (int j = 0; j < n; ++j) unpack_row_t<3>(src + j * stride, hd, dst + j * hd); break;
    default: for (int j = 0; j < n; ++j) unpack_row_t<2>(src + j * stride, hd, dst + j * hd); break;
  }
}
inline void unpack_row(int bits, const uint8_t* src, int hd, uint8_t* dst) { unpack_rows(bits, src, 0, 1, hd, dst); }

// i32 dot of 32 codes with 32 int8 query values (exact: no i16 saturation for |q| <= 127).
template <bool Signed>
inline __m256i dot32(__m256i codes, __m256i q) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Signed) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(q, codes)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), ones);
  }
}

// dots[g] = sum over group g of q8 * codes for one unpacked row (hd % 32 == 0, group % 32 == 0 or
// group == hd).
template <bool Signed>
inline void group_dots(const uint8_t* codes, const int8_t* q8, int hd, int group, int32_t* dots) {
  const int nc = hd / 32, per = group / 32, ng = hd / group;
  __m256i d[8];
  for (int c = 0; c < nc; ++c)
    d[c] = dot32<Signed>(_mm256_loadu_si256((const __m256i*)(codes + 32 * c)),
                         _mm256_loadu_si256((const __m256i*)(q8 + 32 * c)));
  if (per > 1) {  // fold the chunks of each group
    for (int g = 0; g < ng; ++g) {
      __m256i s = d[g * per];
      for (int c = 1; c < per; ++c) s = _mm256_add_epi32(s, d[g * per + c]);
      d[g] = s;
    }
  }
  int g = 0;
  for (; g + 4 <= ng; g += 4) _mm_storeu_si128((__m128i*)(dots + g), hsum4_epi32(d[g], d[g + 1], d[g + 2], d[g + 3]));
  for (; g < ng; ++g) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(d[g]), _mm256_extracti128_si256(d[g], 1));
    const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    dots[g] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
  }
}

inline float dot_f32(const float* a, const float* b, int hd) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= hd; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i < hd; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}

// Row of a dense side -> f32 (f32 rows are used in place by the caller).
inline void dense_row_to_f32(kv_format f, const uint8_t* p, int hd, float* y) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  if (f == kv_format::f16) {
    for (int i = 0; i < hd; i += 8)
      _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
  } else {  // bf16
    for (int i = 0; i < hd; i += 8)
      _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + i))), 16)));
  }
}

// Unpacked codes (u8, or int8 when bits == 8) of one row -> f32 code values.
inline void codes_to_f32(const uint8_t* u, int bits, int hd, float* y) {
  for (int i = 0; i < hd; i += 8) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)(u + i));
    const __m256i w = bits == 8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    _mm256_storeu_ps(y + i, _mm256_cvtepi32_ps(w));
  }
}

// Eight vectors of 8 x i32 -> one vector of their 8 sums, in order.
inline __m256i reduce8_epi32(const __m256i* v) {
  const __m256i e = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i f = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20), _mm256_permute2x128_si256(e, f, 0x31));
}
inline __m256 reduce8_ps(const __m256* v) {
  const __m256 e = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 f = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20), _mm256_permute2f128_ps(e, f, 0x31));
}

// Scores of 8 consecutive unpacked K rows for one int8 query: lanes are rows. Per group g:
// f * (scale * (q8 . codes - offset * qsum) + zero * qsum), summed over groups.
template <bool Signed>
inline __m256 tile_scores_int(const uint8_t* kb, int hd, int group, const int8_t* q8, const float* ksv,
                              const float* kzv, const int32_t* offq, const float* qsf, bool asym) {
  const int ng = hd / group, per = group / 32;
  __m256 acc = _mm256_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    __m256i d[8];
    const __m256i q0 = _mm256_loadu_si256((const __m256i*)(q8 + g * group));
    for (int r = 0; r < 8; ++r) d[r] = dot32<Signed>(_mm256_loadu_si256((const __m256i*)(kb + r * hd + g * group)), q0);
    for (int c = 1; c < per; ++c) {
      const __m256i qc = _mm256_loadu_si256((const __m256i*)(q8 + g * group + 32 * c));
      for (int r = 0; r < 8; ++r)
        d[r] = _mm256_add_epi32(d[r], dot32<Signed>(_mm256_loadu_si256((const __m256i*)(kb + r * hd + g * group + 32 * c)), qc));
    }
    const __m256 df = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8_epi32(d), _mm256_set1_epi32(offq[g])));
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(ksv + g * kB), df, acc);
    if (asym) acc = _mm256_fmadd_ps(_mm256_loadu_ps(kzv + g * kB), _mm256_set1_ps(qsf[g]), acc);
  }
  return acc;
}

// Dots of 8 consecutive f32 K rows (row stride hd) with one f32 query: lanes are rows.
inline __m256 tile_scores_f32(const float* const* rows, const float* q, int hd) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int c = 0; c < hd; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[r] + c), acc[r]);
  }
  return reduce8_ps(acc);
}

enum class vsrc { f32, f16, bf16, u8, i8 };

// 16 values of row j at column c -> two f32 vectors (codes for u8/i8, values for dense rows).
template <vsrc V>
inline void load16(const void* row, int c, __m256& x0, __m256& x1) {
  if constexpr (V == vsrc::f32) {
    x0 = _mm256_loadu_ps(static_cast<const float*>(row) + c);
    x1 = _mm256_loadu_ps(static_cast<const float*>(row) + c + 8);
  } else if constexpr (V == vsrc::f16) {
    const uint16_t* h = static_cast<const uint16_t*>(row) + c;
    x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
    x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 8)));
  } else if constexpr (V == vsrc::bf16) {
    const uint16_t* h = static_cast<const uint16_t*>(row) + c;
    x0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)h)), 16));
    x1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + 8))), 16));
  } else {
    const __m128i b = _mm_loadu_si128((const __m128i*)(static_cast<const uint8_t*>(row) + c));
    if constexpr (V == vsrc::u8) {
      x0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
      x1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    } else {
      x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    }
  }
}

// o_b[c:c+16] += sum_j w_b[j][g(c)] * x_j[c:c+16] (+ zs_b[g(c)]) for four queries b; weights are
// per column group (the V scale folded in) with row stride kB: w_b + g * 4 * kB. Register-blocked
// 16 columns x 4 queries; each row's 16 columns are converted once for the four queries.
template <vsrc V>
void accumulate4(const uint8_t* vbase, int64_t vstride, int rows, int hd, int group, const float* wsb,
                 const float* zs, float* const* o) {
  for (int c = 0; c < hd; c += 16) {
    const int g = c / group;
    const float* w0 = wsb + (g * 4 + 0) * kB;
    const float* w1 = wsb + (g * 4 + 1) * kB;
    const float* w2 = wsb + (g * 4 + 2) * kB;
    const float* w3 = wsb + (g * 4 + 3) * kB;
    __m256 a00 = _mm256_loadu_ps(o[0] + c), a01 = _mm256_loadu_ps(o[0] + c + 8);
    __m256 a10 = _mm256_loadu_ps(o[1] + c), a11 = _mm256_loadu_ps(o[1] + c + 8);
    __m256 a20 = _mm256_loadu_ps(o[2] + c), a21 = _mm256_loadu_ps(o[2] + c + 8);
    __m256 a30 = _mm256_loadu_ps(o[3] + c), a31 = _mm256_loadu_ps(o[3] + c + 8);
    const uint8_t* vr = vbase;
    auto step = [&](const uint8_t* row, int j) {
      __m256 v0, v1;
      load16<V>(row, c, v0, v1);
      __m256 b = _mm256_broadcast_ss(w0 + j);
      a00 = _mm256_fmadd_ps(b, v0, a00);
      a01 = _mm256_fmadd_ps(b, v1, a01);
      b = _mm256_broadcast_ss(w1 + j);
      a10 = _mm256_fmadd_ps(b, v0, a10);
      a11 = _mm256_fmadd_ps(b, v1, a11);
      b = _mm256_broadcast_ss(w2 + j);
      a20 = _mm256_fmadd_ps(b, v0, a20);
      a21 = _mm256_fmadd_ps(b, v1, a21);
      b = _mm256_broadcast_ss(w3 + j);
      a30 = _mm256_fmadd_ps(b, v0, a30);
      a31 = _mm256_fmadd_ps(b, v1, a31);
    };
    int j = 0;
    for (; j + 2 <= rows; j += 2, vr += 2 * vstride) {
      step(vr, j);
      step(vr + vstride, j + 1);
    }
    if (j < rows) step(vr, j);
    if (zs) {
      const __m256 z0 = _mm256_set1_ps(zs[g * 4 + 0]), z1 = _mm256_set1_ps(zs[g * 4 + 1]);
      const __m256 z2 = _mm256_set1_ps(zs[g * 4 + 2]), z3 = _mm256_set1_ps(zs[g * 4 + 3]);
      a00 = _mm256_add_ps(a00, z0), a01 = _mm256_add_ps(a01, z0);
      a10 = _mm256_add_ps(a10, z1), a11 = _mm256_add_ps(a11, z1);
      a20 = _mm256_add_ps(a20, z2), a21 = _mm256_add_ps(a21, z2);
      a30 = _mm256_add_ps(a30, z3), a31 = _mm256_add_ps(a31, z3);
    }
    _mm256_storeu_ps(o[0] + c, a00);
    _mm256_storeu_ps(o[0] + c + 8, a01);
    _mm256_storeu_ps(o[1] + c, a10);
    _mm256_storeu_ps(o[1] + c + 8, a11);
    _mm256_storeu_ps(o[2] + c, a20);
    _mm256_storeu_ps(o[2] + c + 8, a21);
    _mm256_storeu_ps(o[3] + c, a30);
    _mm256_storeu_ps(o[3] + c + 8, a31);
  }
}

inline void scale_o(float* o, int hd, float w) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int i = 0; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), wv));
}

// 8 rows x 4 f16 values (row stride `stride` f16) -> out[g * kB + r], g < 4, r < 8 (f32).
inline void transpose4x8_f16(const uint16_t* p, int64_t stride, float* out) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    const __m128i a = _mm_loadl_epi64((const __m128i*)(p + (2 * i) * stride));
    const __m128i b = _mm_loadl_epi64((const __m128i*)(p + (2 * i + 1) * stride));
    v[i] = _mm256_cvtph_ps(_mm_unpacklo_epi64(a, b));  // [r g0..g3 | r+1 g0..g3]
  }
  const __m256 lo01 = _mm256_unpacklo_ps(v[0], v[1]), hi01 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 lo23 = _mm256_unpacklo_ps(v[2], v[3]), hi23 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // [r0 r2 r4 r6 | r1 r3 r5 r7] -> r0..r7
  _mm256_storeu_ps(out + 0 * kB, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo01, lo23, 0x44), order));
  _mm256_storeu_ps(out + 1 * kB, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(lo01, lo23, 0xEE), order));
  _mm256_storeu_ps(out + 2 * kB, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(hi01, hi23, 0x44), order));
  _mm256_storeu_ps(out + 3 * kB, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(hi01, hi23, 0xEE), order));
}

// The block's per-token scales (and zeros) in [group][row] f32 layout; rows [n, kB) are zero.
inline void block_scales(const uint16_t* sc, int64_t stride, int n, int ng, bool asym, float* s_out, float* z_out) {
  int j = 0;
  if (ng == 4)
    for (; j + 8 <= n; j += 8) {
      transpose4x8_f16(sc + j * stride, stride, s_out + j);
      if (asym) transpose4x8_f16(sc + j * stride + 4, stride, z_out + j);
    }
  for (; j < n; ++j)
    for (int g = 0; g < ng; ++g) {
      s_out[g * kB + j] = f16(sc[j * stride + g]);
      if (asym) z_out[g * kB + j] = f16(sc[j * stride + ng + g]);
    }
  for (int g = 0; g < ng; ++g)
    for (int r = n; r < kB; ++r) s_out[g * kB + r] = z_out[g * kB + r] = 0.0f;
  if (!asym)
    for (int g = 0; g < ng; ++g)
      for (int r = 0; r < n; ++r) z_out[g * kB + r] = 0.0f;
}

struct engine_args {
  const kv_quant_view* kv;
  const attn_query_view* qv;
  attn_state* states;
  int64_t states_stride_t;  // states[t * states_stride_t + g]
};

// Folds the per-channel scales of KIVI group `gi` into one float query: fa[c] = q[c] * s[c],
// fa[kMaxHd] = sum_c q[c] * (z[c] - offset * s[c]).
inline void fold_query(const kv_quant_side& k, int gi, int offset, const float* q, int hd, float* fa) {
  const uint16_t* ks = k.scales + (int64_t)gi * k.scale_stride;
  __m256 bias = _mm256_setzero_ps();
  for (int c = 0; c < hd; c += 8) {
    const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + c)));
    const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + hd + c)));
    const __m256 qv = _mm256_loadu_ps(q + c);
    _mm256_storeu_ps(fa + c, _mm256_mul_ps(qv, sv));
    bias = _mm256_fmadd_ps(qv, _mm256_fnmadd_ps(_mm256_set1_ps((float)offset), sv, zv), bias);
  }
  fa[kMaxHd] = hsum8(bias);
}

// The block engine for queries t in [0, qv.n_tokens), g in [0, qv.n_group) with n_tokens *
// n_group <= kMaxQ.
void engine(const engine_args& a) {
  const kv_quant_view& kv = *a.kv;
  const attn_query_view& qv = *a.qv;
  const int hd = kv.head_dim, ng = qv.n_group, nq = qv.n_tokens * ng;
  const kv_format_traits& tk = kv_traits(kv.k.format);
  const kv_format_traits& tv = kv_traits(kv.v.format);
  const bool k_int = tk.layout == kv_layout::per_token, k_chan = tk.layout == kv_layout::per_channel;
  const bool v_tok = tv.layout == kv_layout::per_token;
  const vsrc vs = v_tok ? (tv.bits == 8 ? vsrc::i8 : vsrc::u8)
                        : kv.v.format == kv_format::f32 ? vsrc::f32
                        : kv.v.format == kv_format::f16 ? vsrc::f16 : vsrc::bf16;
  int limit[kMaxQ];
  int max_limit = 0;
  for (int t = 0; t < qv.n_tokens; ++t) {
    int l = qv.pos0 + t - kv.pos_begin + 1;
    l = l < 0 ? 0 : l > kv.n_pos ? kv.n_pos : l;
    limit[t] = l;
    max_limit = l > max_limit ? l : max_limit;
  }
  if (max_limit == 0) return;

  alignas(32) static thread_local uint8_t kbuf[kB * kMaxHd * 4];  // unpacked codes or f32 rows
  alignas(32) static thread_local uint8_t vbuf[kB * kMaxHd];      // unpacked V codes
  alignas(32) static thread_local float fold[kMaxQ * (kMaxHd + 8)];  // KIVI: q * scale, then the bias
  alignas(32) float sc[kMaxQ][kB];
  alignas(32) float ksv[8 * kB], kzv[8 * kB];          // K scales / zeros of the block, [group][row]
  alignas(32) float vsv[8 * kB], vzv[8 * kB];          // V scales / (zero - offset * scale), [group][row]
  alignas(32) float wsb[8 * 4 * kB];                   // V weights with scales folded, [group][query][row]
  float zs[8 * 4];
  int32_t qsum[kMaxQ][8], offq[kMaxQ][8];
  float qsf[kMaxQ][8];
  const int ngk = k_int ? hd / kv.k.group : 0;
  const int ngv = v_tok ? hd / kv.v.group : 1;
  if (k_int)
    for (int t = 0; t < qv.n_tokens; ++t)
      for (int g = 0; g < ng; ++g) {
        const int qi = t * ng + g;
        q8_group_sums(qv.q8 + t * qv.stride_t + (int64_t)g * hd, hd, kv.k.group, qsum[qi]);
        for (int gr = 0; gr < ngk; ++gr) {
          offq[qi][gr] = tk.code_offset * qsum[qi][gr];
          qsf[qi][gr] = (float)qsum[qi][gr];
        }
      }
  int cur_group[kMaxQ];
  for (int i = 0; i < nq; ++i) cur_group[i] = -1;

  for (int p0 = 0; p0 < max_limit; p0 += kB) {
    const int n = max_limit - p0 < kB ? max_limit - p0 : kB;
    // (1) K rows of the block -> kbuf (codes, or f32 rows), and the block's K scales
    const float* krow[kB] = {};
    if (k_int) unpack_rows(tk.bits, kv.k.codes + (int64_t)p0 * kv.k.code_stride, kv.k.code_stride, n, hd, kbuf);
    for (int j = 0; j < n; ++j) {
      const uint8_t* src = kv.k.codes + (int64_t)(p0 + j) * kv.k.code_stride;
      if (k_int) {
        continue;
      } else if (k_chan) {
        alignas(32) uint8_t u[kMaxHd];
        unpack_row(tk.bits, src, hd, u);
        float* y = reinterpret_cast<float*>(kbuf) + j * hd;
        codes_to_f32(u, tk.bits, hd, y);
        krow[j] = y;
      } else if (kv.k.format == kv_format::f32) {
        krow[j] = reinterpret_cast<const float*>(src);
      } else {
        float* y = reinterpret_cast<float*>(kbuf) + j * hd;
        dense_row_to_f32(kv.k.format, src, hd, y);
        krow[j] = y;
      }
    }
    if (k_int)
      block_scales(kv.k.scales + (int64_t)p0 * kv.k.scale_stride, kv.k.scale_stride, n, ngk, tk.asymmetric, ksv, kzv);
    for (int j = n; j < kB; ++j) krow[j] = krow[0];  // rows past the block: finite, and masked below
    // (2) scores, 8 rows at a time, and (3) the online softmax of each query
    for (int t = 0; t < qv.n_tokens; ++t) {
      const int nt = limit[t] - p0 < n ? limit[t] - p0 : n;
      if (nt <= 0) continue;
      for (int g = 0; g < ng; ++g) {
        const int qi = t * ng + g;
        float* s = sc[qi];
        if (k_int) {
          const int8_t* q8 = qv.q8 + t * qv.stride_t + (int64_t)g * hd;
          const __m256 f = _mm256_set1_ps(qv.q8_scale[t * qv.q8_scale_stride_t + g] * qv.scale);
          for (int r0 = 0; r0 < nt; r0 += 8) {
            const __m256 x = tk.bits == 8
                                 ? tile_scores_int<true>(kbuf + r0 * hd, hd, kv.k.group, q8, ksv + r0, kzv + r0,
                                                         offq[qi], qsf[qi], tk.asymmetric)
                                 : tile_scores_int<false>(kbuf + r0 * hd, hd, kv.k.group, q8, ksv + r0, kzv + r0,
                                                          offq[qi], qsf[qi], tk.asymmetric);
            _mm256_storeu_ps(s + r0, _mm256_mul_ps(x, f));
          }
        } else {
          const float* q = qv.q + t * qv.stride_t + (int64_t)g * hd;
          const __m256 f = _mm256_set1_ps(qv.scale);
          for (int r0 = 0; r0 < nt; r0 += 8) {
            if (k_chan) {
              const int g0 = (p0 + r0) / kv.k.group, g1 = (p0 + r0 + 7) / kv.k.group;
              if (g0 != g1) {  // a KIVI group boundary inside the tile: row by row
                for (int r = r0; r < r0 + 8 && r < nt; ++r) {
                  const int gi = (p0 + r) / kv.k.group;
                  float* fa = fold + qi * (kMaxHd + 8);
                  if (gi != cur_group[qi]) fold_query(kv.k, cur_group[qi] = gi, tk.code_offset, q, hd, fa);
                  s[r] = (dot_f32(fa, krow[r], hd) + fa[kMaxHd]) * qv.scale;
                }
                continue;
              }
              float* fa = fold + qi * (kMaxHd + 8);
              if (g0 != cur_group[qi]) fold_query(kv.k, cur_group[qi] = g0, tk.code_offset, q, hd, fa);
              const __m256 x = tile_scores_f32(krow + r0, fa, hd);
              _mm256_storeu_ps(s + r0, _mm256_mul_ps(_mm256_add_ps(x, _mm256_set1_ps(fa[kMaxHd])), f));
            } else {
              _mm256_storeu_ps(s + r0, _mm256_mul_ps(tile_scores_f32(krow + r0, q, hd), f));
            }
          }
        }
        attn_state& st = a.states[t * a.states_stride_t + g];
        __m256 mxv = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < nt; j += 8) {
          const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nt), lane));
          mxv = _mm256_max_ps(mxv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), valid));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mxv), _mm256_extractf128_ps(mxv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float mx = _mm_cvtss_f32(m4);
        if (mx > st.m) {
          if (st.d > 0.0f) {
            const float w = std::exp(st.m - mx);
            st.d *= w;
            scale_o(st.o, hd, w);
          }
          st.m = mx;
        }
        const __m256 mv = _mm256_set1_ps(st.m);
        __m256 dsum = _mm256_setzero_ps();
        for (int j = 0; j < kB; j += 8) {
          const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nt), lane));
          const __m256 x = _mm256_and_ps(valid, _mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
          const __m256 e = _mm256_and_ps(valid, exp_neg256(x));
          _mm256_storeu_ps(s + j, e);
          dsum = _mm256_add_ps(dsum, e);
        }
        st.d += hsum8(dsum);
      }
    }
    // (4) V: rows of the block (codes unpacked once, or dense rows in place), accumulated into
    // every query with the V scales folded into the weights (weights of masked keys are 0)
    const uint8_t* vbase = kv.v.codes + (int64_t)p0 * kv.v.code_stride;  // dense rows in place
    int64_t vstride = kv.v.code_stride;
    if (v_tok) {  // codes unpacked once, contiguous
      unpack_rows(tv.bits, vbase, kv.v.code_stride, n, hd, vbuf);
      vbase = vbuf;
      vstride = hd;
    }
    if (v_tok) {  // scales, and zero - offset * scale, in [group][row] layout
      block_scales(kv.v.scales + (int64_t)p0 * kv.v.scale_stride, kv.v.scale_stride, n, ngv, tv.asymmetric, vsv, vzv);
      const __m256 off = _mm256_set1_ps((float)tv.code_offset);
      for (int i = 0; i < ngv * kB; i += 8)
        _mm256_storeu_ps(vzv + i, _mm256_fnmadd_ps(off, _mm256_loadu_ps(vsv + i), _mm256_loadu_ps(vzv + i)));
    } else {
      for (int j = 0; j < kB; ++j) vsv[j] = j < n ? 1.0f : 0.0f;
    }
    int active[kMaxQ], na = 0, nrows[kMaxQ];
    for (int t = 0; t < qv.n_tokens; ++t) {
      const int nt = limit[t] - p0 < n ? limit[t] - p0 : n;
      if (nt <= 0) continue;
      for (int g = 0; g < ng; ++g) {
        nrows[na] = nt;
        active[na++] = t * ng + g;
      }
    }
    alignas(32) static thread_local float dummy_o[kMaxHd];
    for (int b0 = 0; b0 < na; b0 += 4) {
      const int nb = na - b0 < 4 ? na - b0 : 4;
      int rows = 0;
      float* o[4];
      for (int b = 0; b < 4; ++b) {
        const int qi = active[b0 + (b < nb ? b : 0)];
        o[b] = b < nb ? a.states[(qi / ng) * a.states_stride_t + qi % ng].o : dummy_o;  // padding: dropped
        rows = nrows[b0 + (b < nb ? b : 0)] > rows ? nrows[b0 + (b < nb ? b : 0)] : rows;
        const float* w = sc[qi];
        for (int gr = 0; gr < ngv; ++gr) {
          __m256 zacc = _mm256_setzero_ps();
          for (int j = 0; j < kB; j += 8) {
            const __m256 wv = _mm256_loadu_ps(w + j);
            _mm256_storeu_ps(wsb + (gr * 4 + b) * kB + j, _mm256_mul_ps(wv, _mm256_loadu_ps(vsv + gr * kB + j)));
            if (v_tok) zacc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vzv + gr * kB + j), zacc);
          }
          zs[gr * 4 + b] = hsum8(zacc);
        }
      }
      const int group = v_tok ? kv.v.group : hd;
      const float* z = v_tok ? zs : nullptr;
      switch (vs) {
        case vsrc::f32: accumulate4<vsrc::f32>(vbase, vstride, rows, hd, group, wsb, z, o); break;
        case vsrc::f16: accumulate4<vsrc::f16>(vbase, vstride, rows, hd, group, wsb, z, o); break;
        case vsrc::bf16: accumulate4<vsrc::bf16>(vbase, vstride, rows, hd, group, wsb, z, o); break;
        case vsrc::u8: accumulate4<vsrc::u8>(vbase, vstride, rows, hd, group, wsb, z, o); break;
        case vsrc::i8: accumulate4<vsrc::i8>(vbase, vstride, rows, hd, group, wsb, z, o); break;
      }
    }
  }
}

bool shapes_supported(int hd, const kv_quant_side& k, const kv_quant_side& v) {
  if (hd % 32 != 0 || hd > kMaxHd) return false;
  for (const kv_quant_side* s : {&k, &v}) {
    const auto& t = kv_traits(s->format);
    if (t.layout == kv_layout::per_token && !(s->group % 32 == 0 || s->group == hd)) return false;
  }
  return true;
}

void run(const kv_quant_view& kv, const attn_query_view& q, attn_state* states) {
  // split the (token, head) queries into passes of at most kMaxQ
  const int ng = q.n_group;
  const int g_step = ng < kMaxQ ? ng : kMaxQ;
  const int t_step = g_step == ng ? (kMaxQ / ng) : 1;
  for (int t0 = 0; t0 < q.n_tokens; t0 += t_step)
    for (int g0 = 0; g0 < ng; g0 += g_step) {
      attn_query_view s = q;
      s.n_tokens = q.n_tokens - t0 < t_step ? q.n_tokens - t0 : t_step;
      s.n_group = ng - g0 < g_step ? ng - g0 : g_step;
      s.pos0 = q.pos0 + t0;
      s.q = q.q + t0 * q.stride_t + (int64_t)g0 * q.head_dim;
      if (q.q8) {
        s.q8 = q.q8 + t0 * q.stride_t + (int64_t)g0 * q.head_dim;
        s.q8_scale = q.q8_scale + t0 * q.q8_scale_stride_t + g0;
      }
      engine_args a{&kv, &s, states + t0 * ng + g0, ng};
      engine(a);
    }
}

}  // namespace

void qk_i32_avx2(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots) {
  const auto& t = kv_traits(k.format);
  alignas(32) uint8_t u[kMaxHd];
  const int ng = hd / k.group;
  for (int j = 0; j < n_rows; ++j) {
    unpack_row(t.bits, k.codes + (int64_t)(r0 + j) * k.code_stride, hd, u);
    int32_t d[8];
    if (t.bits == 8) group_dots<true>(u, q8, hd, k.group, d);
    else group_dots<false>(u, q8, hd, k.group, d);
    for (int g = 0; g < ng; ++g) dots[j * ng + g] = d[g];
  }
}

void dequantize_rows_avx2(const kv_quant_side& side, int r0, int n_rows, int hd, float* y) {
  const auto& t = kv_traits(side.format);
  const int ng = hd / side.group;
  alignas(32) uint8_t u[kMaxHd];
  for (int j = 0; j < n_rows; ++j) {
    unpack_row(t.bits, side.codes + (int64_t)(r0 + j) * side.code_stride, hd, u);
    const uint16_t* sc = side.scales + (int64_t)(r0 + j) * side.scale_stride;
    float* row = y + (int64_t)j * hd;
    for (int g = 0; g < ng; ++g) {
      const __m256 sv = _mm256_set1_ps(f16(sc[g]));
      const __m256 zv = _mm256_set1_ps((t.asymmetric ? f16(sc[ng + g]) : 0.0f) - (float)t.code_offset * f16(sc[g]));
      for (int i = g * side.group; i < (g + 1) * side.group; i += 8) {
        const __m128i b = _mm_loadl_epi64((const __m128i*)(u + i));
        const __m256i w = t.bits == 8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
        _mm256_storeu_ps(row + i, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(w), zv));
      }
    }
  }
}

bool attn_quant_avx2_supported(const kv_quant_view& kv) { return shapes_supported(kv.head_dim, kv.k, kv.v); }

void attn_quant_avx2(const kv_quant_view& kv, const attn_query_view& q, attn_state* states) { run(kv, q, states); }

// Dense views run through the same engine as dense-format sides.
bool attn_dense_avx2_supported(const kv_dense_view& kv) {
  return kv.head_dim % 32 == 0 && kv.head_dim <= kMaxHd;
}

void attn_dense_avx2(const kv_dense_view& d, const attn_query_view& q, attn_state* states) {
  static const kv_format fmt[] = {kv_format::f32, kv_format::f16, kv_format::bf16};
  kv_quant_view kv;
  kv.k.format = fmt[(int)d.type_k];
  kv.v.format = fmt[(int)d.type_v];
  kv.k.codes = static_cast<const uint8_t*>(d.k);
  kv.v.codes = static_cast<const uint8_t*>(d.v);
  kv.k.code_stride = d.row_stride * kv_elem_bytes(d.type_k);
  kv.v.code_stride = d.row_stride * kv_elem_bytes(d.type_v);
  kv.pos_begin = d.pos_begin;
  kv.n_pos = d.n_pos;
  kv.head_dim = d.head_dim;
  run(kv, q, states);
}

}  // namespace kvq
