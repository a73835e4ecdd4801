// Rotation correctness against float64 references built independently of the code under test:
// dense Sylvester Hadamard matrices, the analytic cos/sin basis of the real DFT, and dot products.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kvq/cpu.h"
#include "kvq/error.h"
#include "kvq/rotation.h"
#include "rotation/fwht.h"

namespace {

using kvq::rotation;
using kvq::rotation_kind;

constexpr rotation_kind kKinds[] = {rotation_kind::none, rotation_kind::hadamard, rotation_kind::srht,
                                    rotation_kind::srft};
constexpr int kHeadDims[] = {8, 64, 80, 96, 112, 128, 192, 256};

// Sylvester Hadamard entry H_n[i][j] = (-1)^popcount(i & j), unnormalized.
double sylvester(int i, int j) { return (__builtin_popcount(i & j) & 1) ? -1.0 : 1.0; }

std::vector<float> random_vec(int n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// [d, d] row-major, R[i][j] = (R e_j)_i, from the implementation (float outputs held in double).
std::vector<double> matrix_of(const rotation& r, bool inverse = false) {
  const int d = r.head_dim;
  std::vector<double> m(size_t(d) * d);
  std::vector<float> e(d);
  for (int j = 0; j < d; ++j) {
    std::fill(e.begin(), e.end(), 0.f);
    e[j] = 1.f;
    inverse ? r.inverse(e.data()) : r.forward(e.data());
    for (int i = 0; i < d; ++i) m[size_t(i) * d + j] = e[i];
  }
  return m;
}

// The float64 reference matrix of a rotation, from its definition (signs taken from the plan).
std::vector<double> reference_matrix(const rotation& r) {
  const int d = r.head_dim;
  std::vector<double> m(size_t(d) * d, 0.0);
  auto sign = [&](int j) { return r.signs.empty() ? 1.0 : double(r.signs[j]); };
  switch (r.kind) {
    case rotation_kind::none:
      for (int i = 0; i < d; ++i) m[size_t(i) * d + i] = 1.0;
      break;
    case rotation_kind::hadamard:
    case rotation_kind::srht: {
      const int b = kvq::largest_pow2_divisor(d);
      const double s = 1.0 / std::sqrt(double(b));
      for (int o = 0; o < d; o += b)
        for (int i = 0; i < b; ++i)
          for (int j = 0; j < b; ++j) m[size_t(o + i) * d + o + j] = s * sylvester(i, j) * sign(o + j);
      break;
    }
    case rotation_kind::srft: {
      for (int j = 0; j < d; ++j) {
        m[j] = sign(j) / std::sqrt(double(d));                                // DC
        m[size_t(d) + j] = sign(j) * ((j & 1) ? -1.0 : 1.0) / std::sqrt(double(d));  // Nyquist
        for (int k = 1; k < d / 2; ++k) {
          const double a = -2.0 * std::numbers::pi * double(j) * k / d, c = std::sqrt(2.0 / d);
          m[size_t(2 * k) * d + j] = sign(j) * c * std::cos(a);
          m[size_t(2 * k + 1) * d + j] = sign(j) * c * std::sin(a);
        }
      }
      break;
    }
    default: ADD_FAILURE() << "unknown kind";
  }
  return m;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}
double norm(const std::vector<float>& a) { return std::sqrt(dot(a, a)); }

// ---------------------------------------------------------------------------------------------
// FWHT against the dense Sylvester product.

using fwht_fn = void (*)(float*, int);

double fwht_rel_err(fwht_fn fn, int n, std::mt19937_64& rng) {
  std::vector<float> x = random_vec(n, rng), y = x;
  fn(y.data(), n);
  double max_err = 0, max_ref = 0;
  for (int i = 0; i < n; ++i) {
    double ref = 0;
    for (int j = 0; j < n; ++j) ref += sylvester(i, j) * double(x[j]);
    ref /= std::sqrt(double(n));
    max_err = std::max(max_err, std::fabs(ref - double(y[i])));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  return max_err / max_ref;
}

TEST(Fwht, EqualsDenseSylvesterFloat64) {
  std::mt19937_64 rng(1);
  for (int n = 1; n <= 1024; n *= 2) {
    EXPECT_LE(fwht_rel_err(&kvq::fwht_radix2, n, rng), 1e-6) << "dispatched, n=" << n;
    EXPECT_LE(fwht_rel_err(&kvq::fwht_radix2_ref, n, rng), 1e-6) << "ref, n=" << n;
  }
}

TEST(Fwht, Avx2EqualsScalarBitExact) {
  if (kvq::best_isa() < kvq::isa::avx2) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937_64 rng(2);
  for (int n = 1; n <= 4096; n *= 2) {
    std::vector<float> a = random_vec(n, rng), b = a;
    kvq::fwht_radix2_ref(a.data(), n);
    kvq::fwht_radix2_avx2(b.data(), n);
    for (int i = 0; i < n; ++i) ASSERT_EQ(a[i], b[i]) << "n=" << n << " i=" << i;
    EXPECT_LE(fwht_rel_err(&kvq::fwht_radix2_avx2, n, rng), 1e-6) << "n=" << n;
  }
}

TEST(Fwht, Involution) {  // H_n orthonormal and symmetric: applying it twice is the identity
  std::mt19937_64 rng(3);
  std::vector<float> x = random_vec(256, rng), y = x;
  kvq::fwht_radix2(y.data(), 256);
  kvq::fwht_radix2(y.data(), 256);
  for (int i = 0; i < 256; ++i) EXPECT_NEAR(y[i], x[i], 1e-6f);
}

TEST(Fwht, RejectsNonPowerOfTwo) {
  std::vector<float> x(12);
  for (int n : {0, -4, 3, 12, 96}) EXPECT_THROW(kvq::fwht_radix2(x.data(), n), kvq::error) << n;
}

// ---------------------------------------------------------------------------------------------
// Block sizes, names, seeds, errors.

TEST(Rotation, BlockSizeTable) {
  const std::pair<int, int> table[] = {{80, 16},  {96, 32},   {112, 16}, {192, 64}, {64, 64},
                                       {128, 128}, {256, 256}, {8, 8},    {1, 1},   {7, 1}};
  for (auto [d, b] : table) {
    EXPECT_EQ(kvq::largest_pow2_divisor(d), b) << d;
    EXPECT_EQ(rotation::make(rotation_kind::hadamard, d, 0).block, b) << d;
    EXPECT_EQ(rotation::make(rotation_kind::srht, d, 0).block, b) << d;
  }
}

TEST(Rotation, NamesRoundTrip) {
  for (rotation_kind k : kKinds) EXPECT_EQ(kvq::parse_rotation(kvq::rotation_name(k)), k);
}

TEST(Rotation, SignsDeterministicFromSeed) {
  for (rotation_kind k : {rotation_kind::srht, rotation_kind::srft}) {
    const rotation a = rotation::make(k, 128, 7), b = rotation::make(k, 128, 7);
    const rotation c = rotation::make(k, 128, 8);
    ASSERT_EQ(a.signs.size(), 128u);
    EXPECT_EQ(a.signs, b.signs);
    EXPECT_NE(a.signs, c.signs);
    int neg = 0;
    for (float s : a.signs) {
      EXPECT_TRUE(s == 1.f || s == -1.f);
      neg += s < 0;
    }
    EXPECT_GT(neg, 32);  // not degenerate (binomial(128, 1/2): 32 is > 5 sigma away)
    EXPECT_LT(neg, 96);
    // Different signs give a different transform.
    std::vector<float> x(128, 1.f), y(128, 1.f);
    a.forward(x.data());
    c.forward(y.data());
    EXPECT_NE(x, y);
  }
  EXPECT_TRUE(rotation::make(rotation_kind::hadamard, 64, 7).signs.empty());
  EXPECT_TRUE(rotation::make(rotation_kind::none, 64, 7).signs.empty());
}

template <class F>
void expect_error(F f, kvq::errc code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const kvq::error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("[rotation]", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Rotation, Errors) {
  expect_error([] { rotation::make(rotation_kind::srft, 7, 0); }, kvq::errc::unsupported, "7");
  expect_error([] { rotation::make(rotation_kind::srft, 81, 0); }, kvq::errc::unsupported, "81");
  for (rotation_kind k : kKinds) {
    expect_error([k] { rotation::make(k, 0, 0); }, kvq::errc::invalid_input, "head_dim");
    expect_error([k] { rotation::make(k, -64, 0); }, kvq::errc::invalid_input, "-64");
  }
  expect_error([] { kvq::parse_rotation("hadamart"); }, kvq::errc::invalid_input, "'hadamart'");
  expect_error([] { kvq::parse_rotation(""); }, kvq::errc::invalid_input, "''");
  expect_error([] { kvq::parse_rotation("count"); }, kvq::errc::invalid_input, "'count'");
  expect_error([] { rotation::make(rotation_kind::count, 64, 0); }, kvq::errc::invalid_input, "kind");
}

// ---------------------------------------------------------------------------------------------
// Per (kind, head_dim): the matrix, orthonormality, q.k preservation, inverse.

struct case_t {
  rotation_kind kind;
  int head_dim;
};
void PrintTo(const case_t& c, std::ostream* os) { *os << kvq::rotation_name(c.kind) << "/" << c.head_dim; }

class RotationMatrix : public ::testing::TestWithParam<case_t> {};

TEST_P(RotationMatrix, MatchesReferenceAndIsOrthonormal) {
  const auto [kind, d] = GetParam();
  const rotation r = rotation::make(kind, d, 0x5eed);
  const std::vector<double> R = matrix_of(r), ref = reference_matrix(r), Rinv = matrix_of(r, true);
  double err_ref = 0, err_orth = 0, err_transpose = 0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) {
      err_ref = std::max(err_ref, std::fabs(R[size_t(i) * d + j] - ref[size_t(i) * d + j]));
      err_transpose = std::max(err_transpose, std::fabs(Rinv[size_t(i) * d + j] - R[size_t(j) * d + i]));
      double s = 0;
      for (int t = 0; t < d; ++t) s += R[size_t(i) * d + t] * R[size_t(j) * d + t];
      err_orth = std::max(err_orth, std::fabs(s - (i == j ? 1.0 : 0.0)));
    }
  EXPECT_LE(err_ref, 1e-6) << "R vs float64 definition";
  EXPECT_LE(err_orth, 1e-5) << "R R^T vs I";
  EXPECT_LE(err_transpose, 1e-6) << "inverse vs R^T";
  RecordProperty("err_ref", std::to_string(err_ref));
  RecordProperty("err_orth", std::to_string(err_orth));
}

TEST_P(RotationMatrix, PreservesDotProducts) {
  const auto [kind, d] = GetParam();
  const rotation r = rotation::make(kind, d, 99);
  std::mt19937_64 rng(d * 31 + int(kind));
  double worst = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> q = random_vec(d, rng), k = random_vec(d, rng);
    if (trial % 2 == 1)  // planted outlier channels, 50-100x the rest, as in real K caches
      for (int c : {0, d / 3, d - 1}) {
        q[c] *= 60.f + trial;
        k[c] *= 100.f - trial;
      }
    const double ref = dot(q, k), scale = norm(q) * norm(k);
    r.forward(q.data());
    r.forward(k.data());
    const double rel = std::fabs(dot(q, k) - ref) / scale;
    worst = std::max(worst, rel);
  }
  EXPECT_LE(worst, 1e-5) << "|Rq.Rk - q.k| / (|q||k|)";
  // One case where q.k is large (k = q + noise): relative to q.k itself.
  std::vector<float> q = random_vec(d, rng), k = random_vec(d, rng);
  for (int i = 0; i < d; ++i) k[i] = q[i] + 0.1f * k[i];
  q[d / 2] *= 80.f;
  k[d / 2] *= 80.f;
  const double ref = dot(q, k);
  r.forward(q.data());
  r.forward(k.data());
  EXPECT_LE(std::fabs(dot(q, k) - ref) / std::fabs(ref), 1e-5);
}

TEST_P(RotationMatrix, InverseOfForwardIsIdentity) {
  const auto [kind, d] = GetParam();
  const rotation r = rotation::make(kind, d, 3);
  std::mt19937_64 rng(d);
  const int n = 17;
  std::vector<float> x = random_vec(n * d, rng);
  x[5] = 300.f;  // outlier
  std::vector<float> y = x, z = x;
  r.forward_n(y.data(), n);
  for (int i = 0; i < n; ++i) r.forward(z.data() + i * d);
  EXPECT_EQ(y, z) << "forward_n == n x forward";
  r.inverse_n(y.data(), n);
  for (int v = 0; v < n; ++v) {
    double max_err = 0, max_x = 0;
    for (int i = 0; i < d; ++i) {
      max_err = std::max(max_err, double(std::fabs(y[v * d + i] - x[v * d + i])));
      max_x = std::max(max_x, double(std::fabs(x[v * d + i])));
    }
    EXPECT_LE(max_err / max_x, 1e-6) << "vector " << v;
  }
}

std::vector<case_t> all_cases() {
  std::vector<case_t> c;
  for (rotation_kind k : kKinds)
    for (int d : kHeadDims) c.push_back({k, d});
  // srft fallback radices (odd prime factors of d/2 = 1, 3, 5, 7, 11, 101) and odd-d Hadamard.
  for (int d : {2, 6, 10, 14, 22, 202}) c.push_back({rotation_kind::srft, d});
  for (int d : {1, 7, 24}) {
    c.push_back({rotation_kind::hadamard, d});
    c.push_back({rotation_kind::srht, d});
  }
  return c;
}

INSTANTIATE_TEST_SUITE_P(All, RotationMatrix, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<case_t>& info) {
                           return std::string(kvq::rotation_name(info.param.kind)) + "_" +
                                  std::to_string(info.param.head_dim);
                         });

TEST(Rotation, CopyIsIndependentAndEqual) {
  const rotation a = rotation::make(rotation_kind::srft, 96, 5);
  rotation b = a;  // shares the immutable FFT plan
  std::vector<float> x(96), y;
  for (int i = 0; i < 96; ++i) x[i] = float(i % 7) - 3.f;
  y = x;
  a.forward(x.data());
  b.forward(y.data());
  EXPECT_EQ(x, y);
}

TEST(Rotation, HandBuiltSrftWithoutPlanStillWorks) {
  rotation a = rotation::make(rotation_kind::srft, 80, 5);
  rotation b = a;
  b.fft.reset();
  std::vector<float> x(80), y;
  for (int i = 0; i < 80; ++i) x[i] = std::sin(0.3f * i);
  y = x;
  a.forward(x.data());
  b.forward(y.data());
  EXPECT_EQ(x, y);
}

TEST(Rotation, DefaultIsIdentityNoop) {
  rotation r;  // kind none, head_dim 0
  float x[3] = {1, 2, 3};
  r.forward(x);
  r.inverse_n(x, 1);
  EXPECT_EQ(x[0], 1.f);
  EXPECT_EQ(x[2], 3.f);
}

}  // namespace
