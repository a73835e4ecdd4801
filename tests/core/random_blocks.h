// Test helper: random blocks of a quantized weight type (every quant byte pattern, finite f16 scale
// fields including subnormals and negative ones).
#pragma once
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/weight_types/traits.h"
#include "kvq/f16.h"

namespace kvq::test {

// Byte offsets of the f16 scale fields in a block of each type.
inline std::vector<int> f16_fields(ggml_type t) {
  switch (t) {
    case ggml_type::q4_1: case ggml_type::q5_1: case ggml_type::q4_k: case ggml_type::q5_k: return {0, 2};
    case ggml_type::q2_k: return {80, 82};
    case ggml_type::q3_k: return {108};
    case ggml_type::q6_k: return {208};
    default: return {0};
  }
}

// n_blocks blocks of type t: random bytes, f16 fields set to +-2^[lo_exp, hi_exp) (every 7th
// block a random subnormal or zero).
inline std::vector<uint8_t> random_blocks(ggml_type t, int64_t n_blocks, uint32_t seed, int lo_exp = -14,
                                          int hi_exp = 4) {
  const weight_type_traits* tr = find_weight_traits(t);
  std::mt19937 rng(seed);
  std::vector<uint8_t> b((size_t)(n_blocks * tr->bytes));
  for (auto& v : b) v = (uint8_t)rng();
  std::uniform_int_distribution<int> ex(lo_exp, hi_exp - 1);
  for (int64_t k = 0; k < n_blocks; ++k)
    for (int off : f16_fields(t)) {
      uint16_t h = f32_to_f16(std::ldexp(1.0f, ex(rng)) * (1.0f + (float)(rng() % 1024) / 1024.0f));
      if (k % 7 == 3) h = (uint16_t)(rng() % 0x400);
      if (rng() & 1) h |= 0x8000;
      std::memcpy(&b[(size_t)(k * tr->bytes + off)], &h, 2);
    }
  return b;
}

}  // namespace kvq::test
