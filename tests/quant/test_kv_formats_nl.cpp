// Non-uniform per-token formats (q4nl, q3nl, q2nl; quant.h): the codebook rows, the reference
// quantizer against its definition recomputed in float64, and the error against the uniform
// symmetric formats of the same bits on Gaussian groups (the claim of quant.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvq/f16.h"
#include "kvq/quant.h"

namespace kvq {
namespace {

const kv_format kNl[] = {kv_format::q4nl, kv_format::q3nl, kv_format::q2nl};

float f16r(float x) { return f16_to_f32(f32_to_f16(x)); }

struct coded {
  std::vector<uint8_t> u;     // [head_dim] codes
  std::vector<uint16_t> sc;   // [head_dim / group] f16 scales
  std::vector<float> y;       // [head_dim] dequantized
};

coded roundtrip(kv_format f, const std::vector<float>& x, int group) {
  const int hd = (int)x.size();
  coded c;
  std::vector<uint8_t> codes(kv_code_bytes(f, hd));
  c.sc.resize(kv_row_scale_count(f, hd, group));
  c.u.resize(hd);
  c.y.resize(hd);
  quantize_row_ref(f, x.data(), hd, group, codes.data(), c.sc.data());
  unpack_codes(kv_traits(f).bits, codes.data(), hd, c.u.data());
  dequantize_row_ref(f, codes.data(), c.sc.data(), hd, group, c.y.data());
  return c;
}

// Squared error of x[0, n) coded as the nearest levels of scale s (float64).
double sse_at(const int8_t* lv, int nl, const float* x, int n, double s) {
  double e = 0;
  for (int i = 0; i < n; ++i) {
    double best = INFINITY;
    for (int k = 0; k < nl; ++k) best = std::min(best, std::fabs(s * lv[k] - x[i]));
    e += best * best;
  }
  return e;
}

TEST(kv_formats_nl, codebook_rows) {
  for (kv_format f : kNl) {
    const auto& t = kv_traits(f);
    ASSERT_NE(t.levels, nullptr) << t.name;
    EXPECT_EQ(t.layout, kv_layout::per_token);
    EXPECT_FALSE(t.asymmetric);
    EXPECT_EQ(t.code_offset, 0);
    EXPECT_EQ(t.code_min, 0);
    EXPECT_EQ(t.code_max, (1 << t.bits) - 1) << t.name;
    EXPECT_EQ(t.levels[0], -127) << t.name;
    for (int k = 1; k < 1 << t.bits; ++k) EXPECT_LT(t.levels[k - 1], t.levels[k]) << t.name << " level " << k;
    EXPECT_EQ(kv_row_scale_count(f, 128, 32), 4);
  }
  for (kv_format f : {kv_format::q4, kv_format::q3a, kv_format::kivi4}) EXPECT_EQ(kv_traits(f).levels, nullptr);
}

// Every code is a nearest level of its group's scale, the value is scale * level exactly, and the
// scale is no worse (squared error) than the start scale extreme / levels[0], which puts the
// element of largest magnitude on the levels[0] end.
TEST(kv_formats_nl, nearest_levels_and_no_worse_than_the_absmax_start) {
  std::mt19937 rng(5);
  int refits = 0, groups = 0;
  for (kv_format f : kNl) {
    const auto& t = kv_traits(f);
    const int nl = 1 << t.bits;
    for (int hd : {8, 64, 80, 128, 256})
      for (int group : {32, 64, 128, hd}) {
        if (hd % group || group > hd) continue;
        for (float mag : {1e-3f, 1.0f, 300.0f}) {
          std::normal_distribution<float> nd(0.f, mag);
          std::vector<float> x(hd);
          for (auto& v : x) v = f16r(nd(rng));
          x[rng() % hd] = f16r(mag * (rng() % 2 ? 6.0f : -6.0f));
          const coded c = roundtrip(f, x, group);
          for (int g = 0; g < hd / group; ++g) {
            const float* xg = &x[g * group];
            const double s = f16_to_f32(c.sc[g]);
            double ext = 0;
            for (int i = 0; i < group; ++i)
              if (std::fabs(xg[i]) > std::fabs(ext)) ext = xg[i];
            const double s0 = f16_to_f32(f32_to_f16((float)(ext / t.levels[0])));
            ASSERT_NE(s, 0.0);
            ++groups;
            refits += s != s0;
            double e = 0;
            for (int i = g * group; i < (g + 1) * group; ++i) {
              ASSERT_EQ(c.y[i], (float)(s * t.levels[c.u[i]])) << t.name;
              const double d = std::fabs(s * t.levels[c.u[i]] - x[i]);
              for (int k = 0; k < nl; ++k)
                ASSERT_LE(d, std::fabs(s * t.levels[k] - x[i]) * (1 + 1e-6) + 1e-30)
                    << t.name << " hd " << hd << " g " << group << " i " << i << ": level " << k << " is nearer";
              e += d * d;
            }
            ASSERT_LE(e, sse_at(t.levels, nl, xg, group, s0) * (1 + 1e-9)) << t.name;
          }
        }
      }
  }
  EXPECT_GT(refits, groups / 4);  // the least-squares refit changes the scale in many groups
}

TEST(kv_formats_nl, zero_and_constant_groups) {
  for (kv_format f : kNl) {
    const auto& t = kv_traits(f);
    std::vector<float> x(64, 0.0f);
    coded c = roundtrip(f, x, 32);
    for (uint16_t s : c.sc) EXPECT_EQ(f16_to_f32(s), 0.0f) << t.name;
    for (float v : c.y) ASSERT_EQ(v, 0.0f) << t.name;
    for (float v0 : {-3.25f, 0.7f, 1000.0f}) {
      std::fill(x.begin(), x.end(), f16r(v0));
      c = roundtrip(f, x, 32);
      for (float v : c.y) {
        ASSERT_TRUE(std::isfinite(v));
        ASSERT_LE(std::fabs(v - f16r(v0)), std::fabs(v0) * 2e-3f) << t.name << " " << v0;  // f16 scale rounding
      }
    }
  }
}

// The claim of quant.h: on i.i.d. Gaussian groups of 32 (what the Hadamard rotation makes of a
// row), mean squared error against the uniform symmetric format of the same bits.
TEST(kv_formats_nl, lower_error_than_uniform_on_gaussian_groups) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int hd = 64, rows = 4000;
  std::vector<float> x((size_t)rows * hd);
  for (auto& v : x) v = f16r(nd(rng));
  auto mse = [&](kv_format f) {
    double e = 0;
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> row(x.begin() + (size_t)r * hd, x.begin() + (size_t)(r + 1) * hd);
      const coded c = roundtrip(f, row, 32);
      for (int i = 0; i < hd; ++i) e += (double)(c.y[i] - row[i]) * (c.y[i] - row[i]);
    }
    return e / x.size();
  };
  const struct {
    kv_format nl, uniform;
    double max_ratio;
  } cases[] = {{kv_format::q4nl, kv_format::q4, 0.85}, {kv_format::q3nl, kv_format::q3, 0.78},
               {kv_format::q2nl, kv_format::q2, 0.45}};
  for (const auto& c : cases) {
    const double a = mse(c.nl), b = mse(c.uniform);
    std::printf("[nl] %s mse %.5f, %s %.5f: %.3fx\n", kv_traits(c.nl).name, a, kv_traits(c.uniform).name, b, a / b);
    EXPECT_LT(a / b, c.max_ratio) << kv_traits(c.nl).name;
  }
}

}  // namespace
}  // namespace kvq
