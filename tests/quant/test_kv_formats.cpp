// KV formats: traits table, bit packing, per-element error bounds, zero/constant groups.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvq/f16.h"
#include "kvq/quant.h"

namespace kvq {
namespace {

const kv_format kPerToken[] = {kv_format::q8,  kv_format::q4,  kv_format::q3,  kv_format::q2,
                               kv_format::q8a, kv_format::q4a, kv_format::q3a, kv_format::q2a};
const kv_format kPerChannel[] = {kv_format::kivi8, kv_format::kivi4, kv_format::kivi2};

float f16r(float x) { return f16_to_f32(f32_to_f16(x)); }

TEST(kv_formats, table_and_names) {
  for (int i = 0; i < (int)kv_format::count; ++i) {
    const auto& t = kv_traits((kv_format)i);
    EXPECT_EQ((int)t.format, i);
    kv_format f;
    ASSERT_TRUE(find_kv_format(t.name, &f));
    EXPECT_EQ(f, t.format);
    if (t.layout != kv_layout::dense) {
      EXPECT_EQ(t.block_bytes, 32 * t.bits / 8) << t.name;  // one 32-element block
      EXPECT_EQ(kv_code_bytes(t.format, 128), (size_t)4 * t.block_bytes);
    }
  }
  kv_format f;
  EXPECT_FALSE(find_kv_format("q5", &f));
  EXPECT_EQ(kv_code_bytes(kv_format::q4, 8), 4u);
  EXPECT_EQ(kv_code_bytes(kv_format::q3, 80), 30u);
  EXPECT_EQ(kv_row_scale_count(kv_format::q4, 128, 32), 4);
  EXPECT_EQ(kv_row_scale_count(kv_format::q4a, 128, 32), 8);
  EXPECT_EQ(kv_row_scale_count(kv_format::kivi4, 128, 32), 0);
}

TEST(kv_formats, pack_unpack_roundtrip_bit_exact) {
  std::mt19937 rng(1);
  for (int bits : {2, 3, 4, 8})
    for (int n : {8, 16, 24, 32, 40, 64, 80, 96, 112, 128, 256}) {
      std::vector<uint8_t> u(n), back(n), packed((size_t)n * bits / 8 + 1, 0xAB);
      for (auto& x : u) x = (uint8_t)(rng() & ((1u << bits) - 1));
      pack_codes(bits, u.data(), n, packed.data());
      EXPECT_EQ(packed[(size_t)n * bits / 8], 0xAB) << "wrote past the end";
      unpack_codes(bits, packed.data(), n, back.data());
      EXPECT_EQ(u, back) << bits << " bits, n " << n;
    }
}

TEST(kv_formats, documented_bit_layout) {
  std::vector<uint8_t> e(32), p(32);
  for (int i = 0; i < 32; ++i) e[i] = i & 15;
  pack_codes(4, e.data(), 32, p.data());
  EXPECT_EQ(p[3], 0x33);  // e[3] | e[19] << 4
  for (int i = 0; i < 32; ++i) e[i] = (i / 8) & 3;
  pack_codes(2, e.data(), 32, p.data());
  EXPECT_EQ(p[0], 0xE4);  // e[0] | e[8] << 2 | e[16] << 4 | e[24] << 6
  std::fill(e.begin(), e.end(), 0);
  e[13] = 4;  // bit 2 only
  pack_codes(3, e.data(), 32, p.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(p[i], 0);
  EXPECT_EQ(p[8 + 1], 1 << 5);  // byte 13/8 of the high plane, bit 13%8
  // partial block of 8 elements, 4 bits: byte i = e[i] | e[i + 4] << 4
  for (int i = 0; i < 8; ++i) e[i] = (uint8_t)(i + 1);
  pack_codes(4, e.data(), 8, p.data());
  EXPECT_EQ(p[0], 0x51);
}

// Random rows with a few large values; returns f16-rounded data as the cache feeds it.
std::vector<float> random_row(std::mt19937& rng, int n, float mag) {
  std::normal_distribution<float> nd(0.f, mag);
  std::vector<float> x(n);
  for (auto& v : x) v = f16r(nd(rng));
  x[rng() % n] = f16r(mag * 9.0f);
  return x;
}

TEST(kv_formats, per_token_error_at_most_half_scale) {
  std::mt19937 rng(2);
  for (kv_format f : kPerToken)
    for (int hd : {8, 64, 80, 128, 256})
      for (int group : {32, 64, 128, hd}) {
        if (hd % group) continue;
        const auto& t = kv_traits(f);
        for (float mag : {1e-3f, 1.0f, 300.0f}) {
          const auto x = random_row(rng, hd, mag);
          std::vector<uint8_t> codes(kv_code_bytes(f, hd));
          std::vector<uint16_t> sc(kv_row_scale_count(f, hd, group));
          std::vector<float> y(hd);
          quantize_row_ref(f, x.data(), hd, group, codes.data(), sc.data());
          dequantize_row_ref(f, codes.data(), sc.data(), hd, group, y.data());
          std::vector<uint8_t> u(hd);
          unpack_codes(t.bits, codes.data(), hd, u.data());
          for (int i = 0; i < hd; ++i) {
            const int c = t.bits == 8 ? (int)(int8_t)u[i] : (int)u[i];
            ASSERT_GE(c, t.code_min);
            ASSERT_LE(c, t.code_max);
            const float s = std::fabs(f16_to_f32(sc[i / group]));  // 4/3/2-bit scales carry a sign
            ASSERT_LE(std::fabs(y[i] - x[i]), s * 0.5f * (1 + 1e-5f) + 1e-30f)
                << t.name << " hd " << hd << " g " << group << " i " << i << " x " << x[i] << " y " << y[i];
          }
        }
      }
}

TEST(kv_formats, zero_and_constant_groups) {
  for (kv_format f : kPerToken) {
    const auto& t = kv_traits(f);
    const int hd = 64;
    std::vector<uint8_t> codes(kv_code_bytes(f, hd));
    std::vector<uint16_t> sc(kv_row_scale_count(f, hd, 32));
    std::vector<float> x(hd, 0.0f), y(hd, 1.0f);
    quantize_row_ref(f, x.data(), hd, 32, codes.data(), sc.data());
    dequantize_row_ref(f, codes.data(), sc.data(), hd, 32, y.data());
    EXPECT_EQ(f16_to_f32(sc[0]), 0.0f) << t.name;
    for (float v : y) ASSERT_EQ(v, 0.0f) << t.name;
    // constant groups: asymmetric gives the exact constant with scale 0; symmetric 4/3/2-bit the
    // exact constant too (it takes the -8/-4/-2 code and the scale c / 8, c / 4, c / 2 is exact in
    // f16); q8 within s/2 (c / 127 is not exact in f16)
    for (float c : {-3.25f, 0.7f, 1000.0f}) {
      std::fill(x.begin(), x.end(), f16r(c));
      quantize_row_ref(f, x.data(), hd, 32, codes.data(), sc.data());
      dequantize_row_ref(f, codes.data(), sc.data(), hd, 32, y.data());
      for (int i = 0; i < hd; ++i) {
        ASSERT_TRUE(std::isfinite(y[i]));
        if (t.asymmetric) {
          EXPECT_EQ(f16_to_f32(sc[i / 32]), 0.0f) << t.name;
          ASSERT_EQ(y[i], f16r(c)) << t.name;
        } else if (t.bits < 8) {
          ASSERT_EQ(y[i], f16r(c)) << t.name << " c " << c;
        } else {
          ASSERT_LE(std::fabs(y[i] - f16r(c)), std::fabs(f16_to_f32(sc[i / 32])) * 0.5f) << t.name;
        }
      }
    }
  }
}

// The signed scale of the 4/3/2-bit symmetric formats (llama.cpp q4_0's convention): the extreme
// element lands on the negative end of the code range, whichever its sign, and the step is
// max(extreme / qneg, other side / qpos), recomputed here from the definition.
TEST(kv_formats, signed_scale_uses_the_negative_end) {
  std::mt19937 rng(11);
  for (kv_format f : {kv_format::q4, kv_format::q3, kv_format::q2}) {
    const auto& t = kv_traits(f);
    const int qpos = t.code_max - t.code_offset, qneg = t.code_offset - t.code_min;
    ASSERT_EQ(qneg, qpos + 1) << t.name;
    int n_neg_scale = 0;
    for (int trial = 0; trial < 200; ++trial) {
      auto x = random_row(rng, 32, 1.0f);  // one planted +9 outlier: flip every other row
      if (trial % 2)
        for (auto& v : x) v = -v;
      std::vector<uint8_t> codes(kv_code_bytes(f, 32)), u(32);
      uint16_t sc = 0;
      quantize_row_ref(f, x.data(), 32, 32, codes.data(), &sc);
      unpack_codes(t.bits, codes.data(), 32, u.data());
      double mn = 0, mx = 0;
      int iext = 0;
      for (int i = 0; i < 32; ++i) {
        mn = std::min(mn, (double)x[i]);
        mx = std::max(mx, (double)x[i]);
        if (std::fabs(x[i]) > std::fabs(x[iext])) iext = i;
      }
      const bool neg = -mn >= mx;
      const double want = neg ? std::max(-mn / qneg, mx / qpos) : std::max(mx / qneg, -mn / qpos);
      const double s = f16_to_f32(sc);
      ASSERT_EQ(s < 0, !neg) << t.name;
      n_neg_scale += s < 0;
      ASSERT_GE(std::fabs(s), want * (1 - 1e-7)) << t.name;          // rounded up to f16
      ASSERT_LE(std::fabs(s), want * (1 + 1.0 / 1024)) << t.name;     // by at most one f16 ulp
      if (std::fabs(x[iext]) >= qpos * std::fabs(s) * 1.0001) {      // strictly beyond +qpos steps
        ASSERT_EQ((int)u[iext] - t.code_offset, -qneg) << t.name << " x " << x[iext];
      }
    }
    EXPECT_GT(n_neg_scale, 40) << t.name;  // both signs of the extreme occur in random rows
    EXPECT_LT(n_neg_scale, 160) << t.name;
  }
}

TEST(kv_formats, per_channel_error_and_constant_channels) {
  std::mt19937 rng(3);
  for (kv_format f : kPerChannel)
    for (int hd : {8, 64, 96}) {
      const int T = 32;
      std::vector<float> x((size_t)T * hd);
      for (int j = 0; j < T; ++j) {
        const auto r = random_row(rng, hd, 2.0f);
        std::copy(r.begin(), r.end(), x.begin() + (size_t)j * hd);
        x[(size_t)j * hd + 1] = 0.0f;           // all-zero channel
        x[(size_t)j * hd + 2] = f16r(-17.5f);    // constant channel
        x[(size_t)j * hd + 3] = f16r(40.0f * (j % 3));  // an outlier channel
      }
      std::vector<uint8_t> codes((size_t)T * kv_code_bytes(f, hd));
      std::vector<uint16_t> sc(2 * hd);
      std::vector<float> y(x.size());
      quantize_channel_group_ref(f, x.data(), T, hd, codes.data(), sc.data());
      dequantize_channel_group_ref(f, codes.data(), sc.data(), T, hd, y.data());
      const int levels = kv_traits(f).code_max - kv_traits(f).code_min;
      for (int j = 0; j < T; ++j)
        for (int c = 0; c < hd; ++c) {
          // The range [z, z + levels s] may clip (searched scale, test_kv_channel_mse.cpp): inside
          // it the error is at most s / 2, outside the value is the nearer end of the range.
          const float s = f16_to_f32(sc[c]), z = f16_to_f32(sc[hd + c]), top = s * (float)levels + z;
          const float xv = x[(size_t)j * hd + c], yv = y[(size_t)j * hd + c];
          if (xv <= z) ASSERT_EQ(yv, z) << kv_traits(f).name << " c " << c;
          else if (xv >= top) ASSERT_EQ(yv, top) << kv_traits(f).name << " c " << c;
          else ASSERT_LE(std::fabs(yv - xv), s * 0.5f * (1 + 1e-5f)) << kv_traits(f).name << " c " << c;
        }
      EXPECT_EQ(y[1], 0.0f);
      EXPECT_EQ(y[2], f16r(-17.5f));
      EXPECT_EQ(f16_to_f32(sc[2]), 0.0f);
    }
}

TEST(kv_formats, q8_query_and_scale_rounding) {
  std::vector<float> x(64, 0.0f);
  std::vector<int8_t> q(64, 5);
  EXPECT_EQ(quantize_q8_ref(x.data(), 64, q.data()), 0.0f);
  for (int8_t v : q) EXPECT_EQ(v, 0);
  for (int i = 0; i < 64; ++i) x[i] = std::sin(i * 0.7f) * 3.0f;
  const float s = quantize_q8_ref(x.data(), 64, q.data());
  for (int i = 0; i < 64; ++i) {
    EXPECT_LE(std::abs((int)q[i]), 127);
    EXPECT_LE(std::fabs(q[i] * s - x[i]), s * 0.5f * (1 + 1e-5f));
  }
  for (float v : {0.0f, 1e-7f, 0.1f, 1.0f, 3.14159f, 65504.0f}) {
    const float r = f16_to_f32(f16_round_up(v));
    EXPECT_GE(r, v);
    EXPECT_LE(r, v * (1 + 1.0f / 1024) + 6e-8f);
  }
}

}  // namespace
}  // namespace kvq
