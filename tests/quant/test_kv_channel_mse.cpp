// KIVI per-channel K quantizer (quantize_channel_group_ref): the searched (zero, scale) of least
// squared error against quantities computed here another way: the plain min/max quantizer, a
// brute-force clipping grid, and the nearest representable level of every element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kvq/f16.h"
#include "kvq/quant.h"

namespace kvq {
namespace {

const kv_format kPerChannel[] = {kv_format::kivi8, kv_format::kivi4, kv_format::kivi2};

float f16r(float x) { return f16_to_f32(f32_to_f16(x)); }

// One channel decoded with (z, s): codes rint((x - z) / s) clamped to [0, levels], value s c + z
// in float (the dequantizer's arithmetic); float64 sum of squared errors.
double sse_of(const std::vector<float>& x, float z, float s, int levels) {
  double e = 0.0;
  for (float v : x) {
    const float c = s > 0.0f ? std::min(std::max(std::rint((v - z) * (1.0f / s)), 0.0f), (float)levels) : 0.0f;
    const double d = (double)(s * c + z) - v;
    e += d * d;
  }
  return e;
}

// The plain KIVI quantizer: zero = min rounded to f16, scale = range / levels rounded up to f16.
double min_max_sse(const std::vector<float>& x, int levels) {
  const float mn = *std::min_element(x.begin(), x.end()), mx = *std::max_element(x.begin(), x.end());
  const float z = f16r(mn);
  return sse_of(x, z, f16_to_f32(f16_round_up(std::max(0.0f, mx - z) / (float)levels)), levels);
}

// Brute force over every clipping [mn + i r / 32, mx - j r / 32], i + j < 32 (no refit).
double grid_sse(const std::vector<float>& x, int levels) {
  const float mn = *std::min_element(x.begin(), x.end()), mx = *std::max_element(x.begin(), x.end());
  double best = min_max_sse(x, levels);
  for (int i = 0; i < 32; ++i)
    for (int j = 0; i + j < 32; ++j) {
      const float z = f16r(mn + (mx - mn) * i / 32.0f);
      const float s = f16r(std::max(0.0f, mx - (mx - mn) * j / 32.0f - z) / (float)levels);
      if (s > 0.0f) best = std::min(best, sse_of(x, z, s, levels));
    }
  return best;
}

enum class data { gauss, outlier, sinus, offset, count };
const char* data_name(data d) {
  static const char* n[] = {"gaussian", "planted outlier", "sinusoid", "offset 500"};
  return n[(int)d];
}

// [T, hd] f16-rounded rows; column c is channel c.
std::vector<float> make_group(std::mt19937& rng, data d, int T, int hd) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 6.2831853f);
  std::vector<float> x((size_t)T * hd);
  for (int c = 0; c < hd; ++c) {
    const float amp = 0.1f + 3.0f * (float)c / hd, phase = ud(rng), w = 0.05f + 1.5f * c / hd;
    const int spike = (int)(rng() % T);
    for (int j = 0; j < T; ++j) {
      float v = amp * nd(rng);
      if (d == data::outlier && j == spike) v = amp * (c % 2 ? 12.0f : -12.0f);
      if (d == data::sinus) v = amp * std::sin(w * j + phase) + 0.05f * amp * nd(rng);
      if (d == data::offset) v = 500.0f + 0.02f * amp * nd(rng);
      x[(size_t)j * hd + c] = f16r(v);
    }
  }
  return x;
}

struct totals {
  double chosen = 0, plain = 0, grid = 0;
};

// Quantizes one group, checks every element against the nearest level of its channel's (z, s)
// and every channel's squared error against min/max; adds the channel errors to tot.
void check_group(kv_format f, const std::vector<float>& x, int T, int hd, totals* tot) {
  const auto& t = kv_traits(f);
  const int levels = t.code_max - t.code_min;
  std::vector<uint8_t> codes((size_t)T * kv_code_bytes(f, hd));
  std::vector<uint16_t> sc(2 * hd);
  std::vector<float> y(x.size());
  quantize_channel_group_ref(f, x.data(), T, hd, codes.data(), sc.data());
  dequantize_channel_group_ref(f, codes.data(), sc.data(), T, hd, y.data());
  for (int c = 0; c < hd; ++c) {
    const float s = f16_to_f32(sc[c]), z = f16_to_f32(sc[hd + c]);
    ASSERT_TRUE(std::isfinite(s) && std::isfinite(z) && s >= 0.0f) << t.name << " c " << c;
    std::vector<float> col(T);
    double chosen = 0.0;
    for (int j = 0; j < T; ++j) {
      const float xv = x[(size_t)j * hd + c], yv = y[(size_t)j * hd + c];
      col[j] = xv;
      // the stored code is the nearest of the levels + 1 levels (ties either way)
      double nearest = std::numeric_limits<double>::infinity();
      for (int k = 0; k <= levels; ++k) nearest = std::min(nearest, std::fabs((double)(s * (float)k + z) - xv));
      ASSERT_LE(std::fabs((double)yv - xv), nearest + 1e-6 * s + 1e-30)
          << t.name << " T " << T << " c " << c << " j " << j << " x " << xv << " y " << yv;
      chosen += ((double)yv - xv) * ((double)yv - xv);
    }
    const double plain = min_max_sse(col, levels);
    ASSERT_LE(chosen, plain * (1 + 1e-12)) << t.name << " T " << T << " c " << c;
    tot->chosen += chosen;
    tot->plain += plain;
    if (tot->grid >= 0) tot->grid += grid_sse(col, levels);
  }
}

TEST(kv_channel_mse, never_worse_than_min_max_and_nearest_level) {
  std::mt19937 rng(11);
  for (kv_format f : kPerChannel)
    for (int d = 0; d < (int)data::count; ++d)
      for (int T : {1, 2, 17, 32, 64, 97}) {
        totals tot;
        tot.grid = -1;  // not needed here
        const auto x = make_group(rng, (data)d, T, 16);
        check_group(f, x, T, 16, &tot);
        if (HasFatalFailure()) return;
        if (T == 1) {
          EXPECT_EQ(tot.chosen, 0.0) << kv_traits(f).name;  // one token: scale 0, exact
        }
      }
}

// Squared error against min/max and against a brute-force clipping grid, T = 64 (the 4.5-bit
// configuration's group) over 64 channels x 8 groups. A single planted outlier is kept (clipping it
// would cost more than it saves), so its gain is that of the Gaussian bulk. Measured ratios are
// printed; the bounds leave about 10 % margin.
TEST(kv_channel_mse, beats_min_max_and_matches_brute_force_grid) {
  struct want {
    kv_format f;
    data d;
    double max_ratio;  // chosen / min-max squared error
  };
  const want wants[] = {  // measured: 0.830, 0.833, 0.805, 0.513, 0.311, 0.926
      {kv_format::kivi4, data::gauss, 0.92},   {kv_format::kivi4, data::outlier, 0.92},
      {kv_format::kivi4, data::sinus, 0.90},   {kv_format::kivi2, data::gauss, 0.57},
      {kv_format::kivi2, data::outlier, 0.35}, {kv_format::kivi8, data::gauss, 0.98},
  };
  for (const want& w : wants) {
    std::mt19937 rng(100 + (int)w.d);
    totals tot;
    for (int g = 0; g < 8; ++g) {
      const auto x = make_group(rng, w.d, 64, 64);
      check_group(w.f, x, 64, 64, &tot);
      if (HasFatalFailure()) return;
    }
    const double ratio = tot.chosen / tot.plain, vs_grid = tot.chosen / tot.grid;
    std::printf("[kivi mse] %-5s %-15s squared error %.4fx min/max, %.4fx the clipping grid\n",
                kv_traits(w.f).name, data_name(w.d), ratio, vs_grid);
    EXPECT_LE(ratio, w.max_ratio) << kv_traits(w.f).name << " " << data_name(w.d);
    // the descent finds the grid's optimum (or better, through the refit) up to 2 % (measured
    // 0.94-1.009: kivi2's descent can stop next to the grid's best, 4 and 8 bits gain from the refit)
    EXPECT_LE(vs_grid, 1.02) << kv_traits(w.f).name << " " << data_name(w.d);
  }
}

// Constant and all-zero channels stay exact (scale 0); a channel far from 0 keeps its offset.
TEST(kv_channel_mse, constant_and_offset_channels) {
  for (kv_format f : kPerChannel) {
    const int T = 64, hd = 8;
    std::vector<float> x((size_t)T * hd);
    for (int j = 0; j < T; ++j) {
      x[(size_t)j * hd + 0] = 0.0f;
      x[(size_t)j * hd + 1] = f16r(-17.5f);
      x[(size_t)j * hd + 2] = f16r(1000.0f);
      for (int c = 3; c < hd; ++c) x[(size_t)j * hd + c] = f16r(300.0f + 0.25f * std::sin(0.3f * j + c));
    }
    std::vector<uint8_t> codes((size_t)T * kv_code_bytes(f, hd));
    std::vector<uint16_t> sc(2 * hd);
    std::vector<float> y(x.size());
    quantize_channel_group_ref(f, x.data(), T, hd, codes.data(), sc.data());
    dequantize_channel_group_ref(f, codes.data(), sc.data(), T, hd, y.data());
    for (int c = 0; c < 3; ++c) EXPECT_EQ(f16_to_f32(sc[c]), 0.0f) << kv_traits(f).name << " c " << c;
    for (int j = 0; j < T; ++j) {
      ASSERT_EQ(y[(size_t)j * hd + 0], 0.0f);
      ASSERT_EQ(y[(size_t)j * hd + 1], f16r(-17.5f));
      ASSERT_EQ(y[(size_t)j * hd + 2], f16r(1000.0f));
      // f16 spacing at 300 is 0.25, so the zero alone may be off by 0.125; the scale is searched
      // but never worse than min/max, whose error here is <= 0.125 + s / 2
      for (int c = 3; c < hd; ++c) ASSERT_NEAR(y[(size_t)j * hd + c], x[(size_t)j * hd + c], 0.3) << kv_traits(f).name;
    }
  }
}

}  // namespace
}  // namespace kvq
