// mk::gemm_skinny (the decode steps' weight products on tensor cores) against a float64 product of
// the same f16 values, the bits of a row whatever the number of rows beside it, and what it refuses.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <cstring>
#include <vector>

#include "cuda_test_util.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "model_cuda/model_kernels.h"

namespace kvq::cuda::test {
namespace {

std::vector<uint16_t> random_f16(std::mt19937& rng, size_t n, float a) {
  std::uniform_real_distribution<float> u(-a, a);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_f16(u(rng));
  return v;
}

struct product_case {
  int n_out, n_in;
};

// y [n][n_out] f32 from the device
std::vector<float> run(const dbuf& w, const dbuf& x, int n_out, int n_in, int n) {
  dbuf y((size_t)n * n_out * sizeof(float));
  mk::gemm_skinny(w.as<uint16_t>(), n_out, n_in, x.as<uint16_t>(), n, y.as<float>(), nullptr);
  return to_host<float>(y.p, (size_t)n * n_out);
}

TEST(GemmSkinny, EqualsFloat64ProductWithinSummationBound) {
  KVQ_REQUIRE_GPU();
  std::mt19937 rng(7);
  // row counts not multiples of the 32-row block, k from one 32-wide block to the Llama down product
  for (const product_case pc : {product_case{1, 32}, {37, 96}, {200, 4096}, {1152, 896}, {4096, 14336}}) {
    const std::vector<uint16_t> w = random_f16(rng, (size_t)pc.n_out * pc.n_in, 1.0f);
    const std::vector<uint16_t> x = random_f16(rng, (size_t)16 * pc.n_in, 2.0f);
    const dbuf dw = dbuf::from(w), dx = dbuf::from(x);
    for (int n : {1, 3, 8, 9, 16}) {
      const std::vector<float> y = run(dw, dx, pc.n_out, pc.n_in, n);
      // |error| <= gamma_m * sum |w x| for m sequential f32 additions (u = 2^-23: truncating adders
      // allowed): n_in / 16 MMA accumulations, 16 products inside one, 8 split-K partial sums
      const double m = pc.n_in / 16.0 + 16 + 8, u = std::ldexp(1.0, -23), gamma = m * u / (1 - m * u);
      double worst = 0;
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < pc.n_out; ++r) {
          double ref = 0, mag = 0;
          for (int k = 0; k < pc.n_in; ++k) {
            const double p = (double)f16_to_f32(w[(size_t)r * pc.n_in + k]) * f16_to_f32(x[(size_t)t * pc.n_in + k]);
            ref += p;
            mag += std::fabs(p);
          }
          const double err = std::fabs((double)y[(size_t)t * pc.n_out + r] - ref);
          ASSERT_LE(err, gamma * mag + 1e-30) << "n_out " << pc.n_out << " n_in " << pc.n_in << " rows " << n << " row "
                                              << t << " output " << r << ": " << y[(size_t)t * pc.n_out + r] << " vs " << ref;
          if (mag > 0) worst = std::max(worst, err / mag);
        }
      if (n == 16)
        std::printf("[ gemm_skinny %d x %d ] max |err| / sum|w x| %.3g (bound %.3g)\n", pc.n_out, pc.n_in, worst, gamma);
    }
  }
}

TEST(GemmSkinny, RowBitsDoNotDependOnTheOtherRows) {
  KVQ_REQUIRE_GPU();
  std::mt19937 rng(11);
  const int n_out = 4096 + 48, n_in = 4096;
  const dbuf dw = dbuf::from(random_f16(rng, (size_t)n_out * n_in, 1.0f));
  std::vector<uint16_t> x = random_f16(rng, (size_t)16 * n_in, 1.0f);
  const dbuf dx = dbuf::from(x);
  const std::vector<float> y16 = run(dw, dx, n_out, n_in, 16);
  for (int n : {1, 2, 7, 8, 9, 15}) {
    const std::vector<float> y = run(dw, dx, n_out, n_in, n);
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_EQ(std::memcmp(&y[i], &y16[i], sizeof(float)), 0) << "rows " << n << " element " << i;
  }
  // the same row alone, at the start of its own buffer
  const std::vector<uint16_t> row5(x.begin() + 5 * n_in, x.begin() + 6 * n_in);
  const std::vector<float> y1 = run(dw, dbuf::from(row5), n_out, n_in, 1);
  for (int r = 0; r < n_out; ++r) ASSERT_EQ(std::memcmp(&y1[r], &y16[(size_t)5 * n_out + r], sizeof(float)), 0) << r;
}

TEST(GemmSkinny, RefusesWhatItCannotDo) {
  // host-side checks: run everywhere
  alignas(16) static uint16_t buf[64] = {};
  EXPECT_TRUE(mk::gemm_skinny_supported(16, 10, 32, buf, buf));
  EXPECT_FALSE(mk::gemm_skinny_supported(17, 10, 32, buf, buf));  // more rows than a decode step
  EXPECT_FALSE(mk::gemm_skinny_supported(0, 10, 32, buf, buf));
  EXPECT_FALSE(mk::gemm_skinny_supported(4, 10, 48, buf, buf));   // n_in not a multiple of 32
  EXPECT_FALSE(mk::gemm_skinny_supported(4, 0, 32, buf, buf));
  EXPECT_FALSE(mk::gemm_skinny_supported(4, 10, 32, buf + 1, buf));  // W not 16-byte aligned
  EXPECT_FALSE(mk::gemm_skinny_supported(4, 10, 32, buf, buf + 4));  // x not 16-byte aligned
  try {
    mk::gemm_skinny(buf, 10, 48, buf, 4, nullptr, nullptr);
    FAIL() << "n_in 48 accepted";
  } catch (const kvq::error& e) {
#if KVQ_HAVE_CUDA
    EXPECT_EQ(e.code(), errc::internal);
    EXPECT_NE(std::string(e.what()).find("n_in 48"), std::string::npos) << e.what();
#else
    EXPECT_EQ(e.code(), errc::unsupported) << e.what();
#endif
  }
}

}  // namespace
}  // namespace kvq::cuda::test
