// IEEE-754 binary16 and bfloat16 conversions (scalar, exact round-to-nearest-even).
#pragma once
#include <cstdint>
#include <cstring>

namespace kvq {

inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// binary16 -> f32, exact.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // subnormal: normalise
    int e = -1;
    do { e++; mant <<= 1; } while ((mant & 0x400) == 0);
    mant &= 0x3ff;
    return f32_from_bits(sign | (uint32_t)(127 - 15 - e) << 23 | mant << 13);
  }
  if (exp == 31)  // Inf, or NaN quieted with its payload kept (as F16C's vcvtph2ps does)
    return f32_from_bits(sign | 0x7f800000u | mant << 13 | (mant ? 0x400000u : 0));
  return f32_from_bits(sign | (exp + 127 - 15) << 23 | mant << 13);
}

// f32 -> binary16, round to nearest even; overflow -> Inf, NaN stays NaN. Both directions are
// bit-identical to the F16C instructions (tests/core/test_f16_avx2.cpp checks all inputs).
inline uint16_t f32_to_f16(float f) {
  const uint32_t x = bits_from_f32(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u)  // NaN: quiet, top payload bits kept (as F16C's vcvtps2ph does)
    return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
  if (ax == 0x7f800000u) return (uint16_t)(sign | 0x7c00);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // rounds to >= 65520 -> Inf
  if (ax < 0x38800000u) {                                   // subnormal or zero in f16
    if (ax < 0x33000000u) return (uint16_t)sign;            // < 2^-25 rounds to 0
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14 + (112 - e) ... place at 2^-24 units
    uint32_t r = m >> (shift - 0);
    // m * 2^(e-150) / 2^-24 = m >> (126 - e)
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ((ax >> 13) - ((127 - 15) << 10));
  const uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
  return (uint16_t)(sign | r);
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t x = bits_from_f32(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

}  // namespace kvq
