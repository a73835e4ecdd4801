// Scalar reference dots of every quantized weight type against its activation blocks.
#include "core/weight_types/dot_ref.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/weight_types/act_blocks.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

inline int32_t dot_i8(const int8_t* a, const int8_t* b, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += (int32_t)a[i] * (int32_t)b[i];
  return s;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

using unpack_fn = void (*)(const void*, int64_t, int8_t*, float*, float*);

// Symmetric legacy types against q8_0 activations, in llama.cpp's x86 order (ggml_vec_dot_q8_0_q8_0
// and q4_0 / q5_0 in arch/x86/quants.c, which produced the golden outputs): 8 f32 lanes, lane j
// += (d_w * d_x) * (exact integer sum of elements 4j..4j+3) by a fused multiply-add per block, then
// the lanes summed as hsum_float_8 does. The AVX2 / AVX-512 row kernels (matmul_simd.inc) compute
// exactly this, so every tier, decode and prefill give the same bits. (The generic order, one f32
// sum of per-block products, differs by rounding, and Gemma 3 270M turns such differences into
// different greedy tokens and a 1 % different chunk perplexity.)
template <unpack_fn U>
float dot_sym(int64_t n, const void* w, const void* x) {
  const auto* xq = static_cast<const block_q8_x*>(x);
  int8_t q[32];
  float acc[8] = {}, d, m;
  for (int64_t k = 0; k < n / 32; ++k) {
    U(w, k, q, &d, &m);
    const float dd = d * xq[k].d;
    for (int j = 0; j < 8; ++j) acc[j] = std::fma((float)dot_i8(q + 4 * j, xq[k].qs + 4 * j, 4), dd, acc[j]);
  }
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// Legacy types with a minimum against q8_1 activations.
template <unpack_fn U>
float dot_min(int64_t n, const void* w, const void* x) {
  const auto* xq = static_cast<const block_q8_1x*>(x);
  int8_t q[32];
  float acc = 0, d, m;
  for (int64_t k = 0; k < n / 32; ++k) {
    U(w, k, q, &d, &m);
    acc += (float)dot_i8(q, xq[k].qs, 32) * (d * xq[k].d) + m * xq[k].s;
  }
  return acc;
}

}  // namespace

void unpack_q4_0(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_q4_0*>(row)[k];
  for (int j = 0; j < 16; ++j) {
    q[j] = (int8_t)((b.qs[j] & 0xF) - 8);
    q[j + 16] = (int8_t)((b.qs[j] >> 4) - 8);
  }
  *d = f16_to_f32(b.d);
  *m = 0;
}

void unpack_q4_1(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_q4_1*>(row)[k];
  for (int j = 0; j < 16; ++j) {
    q[j] = (int8_t)(b.qs[j] & 0xF);
    q[j + 16] = (int8_t)(b.qs[j] >> 4);
  }
  *d = f16_to_f32(b.d);
  *m = f16_to_f32(b.m);
}

void unpack_q5_0(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_q5_0*>(row)[k];
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    q[j] = (int8_t)(((b.qs[j] & 0xF) | ((qh >> j) & 1) << 4) - 16);
    q[j + 16] = (int8_t)(((b.qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
  }
  *d = f16_to_f32(b.d);
  *m = 0;
}

void unpack_q5_1(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_q5_1*>(row)[k];
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    q[j] = (int8_t)((b.qs[j] & 0xF) | ((qh >> j) & 1) << 4);
    q[j + 16] = (int8_t)((b.qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
  }
  *d = f16_to_f32(b.d);
  *m = f16_to_f32(b.m);
}

void unpack_q8_0(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_q8_0*>(row)[k];
  std::memcpy(q, b.qs, 32);
  *d = f16_to_f32(b.d);
  *m = 0;
}

void unpack_iq4_nl(const void* row, int64_t k, int8_t* q, float* d, float* m) {
  const auto& b = static_cast<const block_iq4_nl*>(row)[k];
  for (int j = 0; j < 16; ++j) {
    q[j] = kvalues_iq4nl[b.qs[j] & 0xF];
    q[j + 16] = kvalues_iq4nl[b.qs[j] >> 4];
  }
  *d = f16_to_f32(b.d);
  *m = 0;
}

float vec_dot_q4_0_ref(int64_t n, const void* w, const void* x) { return dot_sym<unpack_q4_0>(n, w, x); }
float vec_dot_q5_0_ref(int64_t n, const void* w, const void* x) { return dot_sym<unpack_q5_0>(n, w, x); }
float vec_dot_q8_0_ref(int64_t n, const void* w, const void* x) { return dot_sym<unpack_q8_0>(n, w, x); }
float vec_dot_iq4_nl_ref(int64_t n, const void* w, const void* x) { return dot_sym<unpack_iq4_nl>(n, w, x); }
float vec_dot_q4_1_ref(int64_t n, const void* w, const void* x) { return dot_min<unpack_q4_1>(n, w, x); }
float vec_dot_q5_1_ref(int64_t n, const void* w, const void* x) { return dot_min<unpack_q5_1>(n, w, x); }

// --- K-quants against q8_k ------------------------------------------------------------------------

float vec_dot_q2_k_ref(int64_t n, const void* w, const void* x) {
  const auto* b = static_cast<const block_q2_k*>(w);
  const auto* xq = static_cast<const block_q8_k*>(x);
  float acc = 0;
  int8_t q[qk_k];
  for (int64_t k = 0; k < n / qk_k; ++k) {
    for (int e = 0; e < qk_k; ++e) {
      const int half = e / 128, shift = 2 * ((e % 128) / 32);
      q[e] = (int8_t)((b[k].qs[32 * half + e % 32] >> shift) & 3);
    }
    int32_t isum = 0, msum = 0;
    for (int s = 0; s < 16; ++s) {
      isum += (b[k].scales[s] & 0xF) * dot_i8(q + 16 * s, xq[k].qs + 16 * s, 16);
      msum += (b[k].scales[s] >> 4) * xq[k].bsums[s];
    }
    const float dx = xq[k].d;
    acc += dx * f16_to_f32(b[k].d) * (float)isum - dx * f16_to_f32(b[k].dmin) * (float)msum;
  }
  return acc;
}

float vec_dot_q3_k_ref(int64_t n, const void* w, const void* x) {
  const auto* b = static_cast<const block_q3_k*>(w);
  const auto* xq = static_cast<const block_q8_k*>(x);
  float acc = 0;
  int8_t q[qk_k];
  for (int64_t k = 0; k < n / qk_k; ++k) {
    for (int e = 0; e < qk_k; ++e) {
      const int c = e / 32, half = c / 4, shift = 2 * (c % 4), l = e % 32;
      const int lo = (b[k].qs[32 * half + l] >> shift) & 3, hi = (b[k].hmask[l] >> c) & 1;
      q[e] = (int8_t)(lo - (hi ? 0 : 4));
    }
    int32_t isum = 0;
    for (int s = 0; s < 16; ++s)
      isum += q3_k_scale(b[k].scales, s) * dot_i8(q + 16 * s, xq[k].qs + 16 * s, 16);
    acc += xq[k].d * f16_to_f32(b[k].d) * (float)isum;
  }
  return acc;
}

namespace {
// q4_k / q5_k share everything but the fifth bit.
template <bool Five>
float dot_q45_k(int64_t n, const void* w, const void* x) {
  using blk = std::conditional_t<Five, block_q5_k, block_q4_k>;
  const auto* b = static_cast<const blk*>(w);
  const auto* xq = static_cast<const block_q8_k*>(x);
  float acc = 0;
  int8_t q[32];
  for (int64_t k = 0; k < n / qk_k; ++k) {
    int32_t isum = 0, msum = 0;
    for (int s = 0; s < 8; ++s) {
      uint8_t sc, m;
      unpack_scale_min_k4(s, b[k].scales, &sc, &m);
      const uint8_t* qs = b[k].qs + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) {
        int v = (qs[l] >> (4 * (s % 2))) & 0xF;
        if constexpr (Five) v |= ((b[k].qh[l] >> s) & 1) << 4;
        q[l] = (int8_t)v;
      }
      isum += sc * dot_i8(q, xq[k].qs + 32 * s, 32);
      msum += m * (xq[k].bsums[2 * s] + xq[k].bsums[2 * s + 1]);
    }
    const float dx = xq[k].d;
    acc += dx * f16_to_f32(b[k].d) * (float)isum - dx * f16_to_f32(b[k].dmin) * (float)msum;
  }
  return acc;
}
}  // namespace

float vec_dot_q4_k_ref(int64_t n, const void* w, const void* x) { return dot_q45_k<false>(n, w, x); }
float vec_dot_q5_k_ref(int64_t n, const void* w, const void* x) { return dot_q45_k<true>(n, w, x); }

float vec_dot_q6_k_ref(int64_t n, const void* w, const void* x) {
  const auto* b = static_cast<const block_q6_k*>(w);
  const auto* xq = static_cast<const block_q8_k*>(x);
  float acc = 0;
  int8_t q[qk_k];
  for (int64_t k = 0; k < n / qk_k; ++k) {
    for (int e = 0; e < qk_k; ++e) {
      const int half = e / 128, c = (e % 128) / 32, l = e % 32;
      const uint8_t qlb = b[k].ql[64 * half + l + 32 * (c & 1)];
      const int lo = c < 2 ? (qlb & 0xF) : (qlb >> 4);
      const int hi = (b[k].qh[32 * half + l] >> (2 * c)) & 3;
      q[e] = (int8_t)((lo | hi << 4) - 32);
    }
    int32_t isum = 0;
    for (int s = 0; s < 16; ++s) isum += b[k].scales[s] * dot_i8(q + 16 * s, xq[k].qs + 16 * s, 16);
    acc += xq[k].d * f16_to_f32(b[k].d) * (float)isum;
  }
  return acc;
}

float vec_dot_iq4_xs_ref(int64_t n, const void* w, const void* x) {
  const auto* b = static_cast<const block_iq4_xs*>(w);
  const auto* xq = static_cast<const block_q8_k*>(x);
  float acc = 0;
  int8_t q[32];
  for (int64_t k = 0; k < n / qk_k; ++k) {
    int32_t isum = 0;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* qs = b[k].qs + 16 * s;
      for (int l = 0; l < 16; ++l) {
        q[l] = kvalues_iq4nl[qs[l] & 0xF];
        q[l + 16] = kvalues_iq4nl[qs[l] >> 4];
      }
      isum += iq4_xs_scale(b[k], s) * dot_i8(q, xq[k].qs + 32 * s, 32);
    }
    acc += xq[k].d * f16_to_f32(b[k].d) * (float)isum;
  }
  return acc;
}

}  // namespace kvq
