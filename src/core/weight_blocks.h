// ggml block layouts for the quantized weight types kvq computes with (ggml-common.h).
#pragma once
#include <cstdint>

#include "kvq/f16.h"

namespace kvq {

constexpr int qk8_0 = 32;
constexpr int qk4_0 = 32;

// q8_0: value[i] = d * qs[i].
struct block_q8_0 {
  uint16_t d;        // f16 scale
  int8_t qs[qk8_0];  // signed quants
};
static_assert(sizeof(block_q8_0) == 34, "q8_0 block is 34 bytes");

// q4_0: byte j holds element j (low nibble) and element j + 16 (high nibble);
// value = (nibble - 8) * d.
struct block_q4_0 {
  uint16_t d;             // f16 scale
  uint8_t qs[qk4_0 / 2];  // nibbles
};
static_assert(sizeof(block_q4_0) == 18, "q4_0 block is 18 bytes");

inline void dequant_q8_0(const block_q8_0& b, float* out) {  // out[32]
  const float d = f16_to_f32(b.d);
  for (int i = 0; i < qk8_0; ++i) out[i] = d * (float)b.qs[i];
}

inline void dequant_q4_0(const block_q4_0& b, float* out) {  // out[32]
  const float d = f16_to_f32(b.d);
  for (int j = 0; j < qk4_0 / 2; ++j) {
    out[j] = d * (float)((b.qs[j] & 0x0f) - 8);
    out[j + qk4_0 / 2] = d * (float)((b.qs[j] >> 4) - 8);
  }
}

}  // namespace kvq
