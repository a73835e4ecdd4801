// Reference dequantizers (to_float) of every weight type: the formulas of llama.cpp's
// dequantize_row_* evaluated in f32 in the same order as the gguf Python package's
// gguf.quants.dequantize (tests/core/test_weight_types.cpp checks them bit for bit). Compiled
// without FMA contraction (ISO C++ mode), so d * q - m stays two rounded operations.
#include <cstring>

#include "core/weight_types/dequant_ref.h"
#include "kvq/f16.h"

namespace kvq {

void to_float_f32(const void* v, float* y, int64_t n) { std::memcpy(y, v, (size_t)n * 4); }

void to_float_f16(const void* v, float* y, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(v);
  for (int64_t i = 0; i < n; ++i) y[i] = f16_to_f32(h[i]);
}

void to_float_bf16(const void* v, float* y, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(v);
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(h[i]);
}

void to_float_q4_0(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q4_0*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * (float)((b[k].qs[j] & 0xF) - 8);
      y[j + 16] = d * (float)((b[k].qs[j] >> 4) - 8);
    }
  }
}

void to_float_q4_1(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q4_1*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d), m = f16_to_f32(b[k].m);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * (float)(b[k].qs[j] & 0xF) + m;
      y[j + 16] = d * (float)(b[k].qs[j] >> 4) + m;
    }
  }
}

namespace {
inline uint32_t load_qh(const uint8_t* qh) {
  uint32_t u;
  std::memcpy(&u, qh, 4);
  return u;
}
}  // namespace

void to_float_q5_0(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q5_0*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d);
    const uint32_t qh = load_qh(b[k].qh);
    for (int j = 0; j < 16; ++j) {
      const int q0 = (b[k].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
      const int q1 = (b[k].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
      y[j] = d * (float)(q0 - 16);
      y[j + 16] = d * (float)(q1 - 16);
    }
  }
}

void to_float_q5_1(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q5_1*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d), m = f16_to_f32(b[k].m);
    const uint32_t qh = load_qh(b[k].qh);
    for (int j = 0; j < 16; ++j) {
      const int q0 = (b[k].qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
      const int q1 = (b[k].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
      y[j] = d * (float)q0 + m;
      y[j + 16] = d * (float)q1 + m;
    }
  }
}

void to_float_q8_0(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q8_0*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d);
    for (int j = 0; j < 32; ++j) y[j] = d * (float)b[k].qs[j];
  }
}

void to_float_iq4_nl(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_iq4_nl*>(v);
  for (int64_t k = 0; k < n / 32; ++k, y += 32) {
    const float d = f16_to_f32(b[k].d);
    for (int j = 0; j < 16; ++j) {
      y[j] = d * (float)kvalues_iq4nl[b[k].qs[j] & 0xF];
      y[j + 16] = d * (float)kvalues_iq4nl[b[k].qs[j] >> 4];
    }
  }
}

void to_float_q2_k(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q2_k*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d), dmin = f16_to_f32(b[k].dmin);
    for (int s = 0; s < 16; ++s, y += 16) {  // sub-block s: elements 16s .. 16s + 15
      const float dl = d * (float)(b[k].scales[s] & 0xF), ml = dmin * (float)(b[k].scales[s] >> 4);
      const int half = s / 8, shift = 2 * ((s % 8) / 2), l0 = 16 * (s % 2);
      for (int l = 0; l < 16; ++l)
        y[l] = dl * (float)((b[k].qs[32 * half + l0 + l] >> shift) & 3) - ml;
    }
  }
}

void to_float_q3_k(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q3_k*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d);
    for (int s = 0; s < 16; ++s, y += 16) {
      const float dl = d * (float)q3_k_scale(b[k].scales, s);
      const int e0 = 16 * s;  // first element; chunk of 32: c = e0 / 32
      const int c = e0 / 32, half = c / 4, shift = 2 * (c % 4);
      for (int l = 0; l < 16; ++l) {
        const int e = e0 + l, li = e % 32;
        const int lo = (b[k].qs[32 * half + li] >> shift) & 3;
        const int hi = (b[k].hmask[li] >> c) & 1;
        y[l] = dl * (float)(lo - (hi ? 0 : 4));
      }
    }
  }
}

void to_float_q4_k(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q4_k*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d), dmin = f16_to_f32(b[k].dmin);
    for (int s = 0; s < 8; ++s, y += 32) {
      uint8_t sc, m;
      unpack_scale_min_k4(s, b[k].scales, &sc, &m);
      const float d1 = d * (float)sc, m1 = dmin * (float)m;
      const uint8_t* q = b[k].qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) y[l] = d1 * (float)((q[l] >> shift) & 0xF) - m1;
    }
  }
}

void to_float_q5_k(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q5_k*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d), dmin = f16_to_f32(b[k].dmin);
    for (int s = 0; s < 8; ++s, y += 32) {
      uint8_t sc, m;
      unpack_scale_min_k4(s, b[k].scales, &sc, &m);
      const float d1 = d * (float)sc, m1 = dmin * (float)m;
      const uint8_t* q = b[k].qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int l = 0; l < 32; ++l) {
        const int qv = ((q[l] >> shift) & 0xF) | ((b[k].qh[l] >> s) & 1) << 4;
        y[l] = d1 * (float)qv - m1;
      }
    }
  }
}

void to_float_q6_k(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_q6_k*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d);
    for (int s = 0; s < 16; ++s, y += 16) {
      const float dl = d * (float)b[k].scales[s];
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l, half = e / 128, c = (e % 128) / 32, li = e % 32;
        const uint8_t qlb = b[k].ql[64 * half + li + 32 * (c & 1)];
        const int lo = c < 2 ? (qlb & 0xF) : (qlb >> 4);
        const int hi = (b[k].qh[32 * half + li] >> (2 * c)) & 3;
        y[l] = dl * (float)((lo | hi << 4) - 32);
      }
    }
  }
}

void to_float_iq4_xs(const void* v, float* y, int64_t n) {
  const auto* b = static_cast<const block_iq4_xs*>(v);
  for (int64_t k = 0; k < n / qk_k; ++k) {
    const float d = f16_to_f32(b[k].d);
    for (int s = 0; s < 8; ++s, y += 32) {
      const float dl = d * (float)iq4_xs_scale(b[k], s);
      const uint8_t* q = b[k].qs + 16 * s;
      for (int l = 0; l < 16; ++l) {
        y[l] = dl * (float)kvalues_iq4nl[q[l] & 0xF];
        y[l + 16] = dl * (float)kvalues_iq4nl[q[l] >> 4];
      }
    }
  }
}

}  // namespace kvq
