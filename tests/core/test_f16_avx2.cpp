// f16/bf16 scalar conversions (include/kvq/f16.h) checked bit-exactly: f16 against the F16C
// instructions over all 65536 inputs and a sweep of f32 values; bf16 against an independent
// nearest-even rounding computed in double. Compiled with -mf16c; skipped on CPUs without F16C.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "kvq/cpu.h"
#include "kvq/f16.h"

namespace kvq {
namespace {

// f32 inputs that exercise rounding: every representable f16/bf16 boundary neighbourhood
// (the value, +-1 ulp, the midpoint to the next value, +-1 ulp of it), a strided sweep of all
// 2^32 bit patterns, and specials.
std::vector<uint32_t> f32_sweep(int keep_bits) {
  std::vector<uint32_t> v;
  const int drop = 32 - keep_bits;  // f16-ish: keep top bits of each pattern
  for (uint64_t top = 0; top < (1ull << keep_bits); ++top) {
    const uint32_t base = (uint32_t)(top << drop);
    const uint32_t half = 1u << (drop - 1);
    for (uint32_t d : {0u, 1u, half - 1, half, half + 1, (1u << drop) - 1}) v.push_back(base + d);
  }
  for (uint64_t x = 0; x < (1ull << 32); x += 65521) v.push_back((uint32_t)x);
  for (uint32_t s : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                     0xffffffffu, 0x477fe000u, 0x477ff000u, 0x477fefffu, 0x33000000u, 0x33000001u,
                     0x387fffffu, 0x38800000u, 0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu})
    v.push_back(s);
  return v;
}

TEST(f16, to_f32_exhaustive_vs_f16c) {
  if (!cpu().f16c) GTEST_SKIP() << "CPU has no F16C";
  int mismatches = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t want = bits_from_f32(_cvtsh_ss((unsigned short)h));
    const uint32_t got = bits_from_f32(f16_to_f32((uint16_t)h));
    if (want != got && ++mismatches <= 5)
      ADD_FAILURE() << std::hex << "f16 0x" << h << ": got 0x" << got << " want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(f16, from_f32_sweep_vs_f16c) {
  if (!cpu().f16c) GTEST_SKIP() << "CPU has no F16C";
  // f32 -> f16 drops 13 mantissa bits: keep the top 19 bits so every f16 boundary is visited.
  const std::vector<uint32_t> xs = f32_sweep(19);
  int mismatches = 0;
  for (uint32_t x : xs) {
    const float f = f32_from_bits(x);
    const uint16_t want = (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    const uint16_t got = f32_to_f16(f);
    if (want != got && ++mismatches <= 5)
      ADD_FAILURE() << std::hex << "f32 0x" << x << ": got 0x" << got << " want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0) << "of " << xs.size() << " inputs";
  // Round trip of every finite f16 is exact.
  for (uint32_t h = 0; h < 65536; ++h)
    if ((h & 0x7c00) != 0x7c00) {
      ASSERT_EQ(f32_to_f16(f16_to_f32((uint16_t)h)), h);
    }
}

// Nearest-even rounding of f32 to bf16 computed in double, with overflow to Inf per IEEE 754
// (a value at or beyond max + half an ulp rounds to Inf; the tie goes to the even Inf).
uint16_t bf16_oracle(uint32_t x) {
  const float f = f32_from_bits(x);
  if (std::isnan(f)) return (uint16_t)((x >> 16) | 0x40);
  const uint16_t lo = (uint16_t)(x >> 16);  // truncation toward zero
  const uint16_t hi = (uint16_t)(lo + 1);   // next away from zero (may be Inf)
  auto mag = [](uint16_t b) {
    if ((b & 0x7fff) == 0x7f80) return std::ldexp(1.0, 128);
    return std::fabs((double)bf16_to_f32(b));
  };
  if (std::isinf(f)) return lo;
  const double a = std::fabs((double)f);
  const double dl = a - mag(lo), dh = mag(hi) - a;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(bf16, conversions_vs_oracle) {
  for (uint32_t h = 0; h < 65536; ++h) {  // bf16 -> f32 is a shift: check the value
    const float f = bf16_to_f32((uint16_t)h);
    if (!std::isnan(f)) {
      ASSERT_EQ(f32_to_bf16(f), h) << std::hex << h;
    }
  }
  const std::vector<uint32_t> xs = f32_sweep(16);
  int mismatches = 0;
  for (uint32_t x : xs) {
    const uint16_t want = bf16_oracle(x), got = f32_to_bf16(f32_from_bits(x));
    if (want != got && ++mismatches <= 5)
      ADD_FAILURE() << std::hex << "f32 0x" << x << ": got 0x" << got << " want 0x" << want;
  }
  EXPECT_EQ(mismatches, 0) << "of " << xs.size() << " inputs";
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7f7fffffu)), 0x7f80);  // max f32 rounds to Inf
}

}  // namespace
}  // namespace kvq
