// Sampler semantics checked against distributions computed by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "kvq/error.h"
#include "kvq/sampling.h"

namespace kvq {
namespace {

TEST(Sampling, GreedyPicksFirstMaximum) {
  sampler s({0.0f, 40, 0.95f, 0.05f, 1});
  const float l[] = {1.0f, 3.0f, 3.0f, -2.0f};
  EXPECT_EQ(s.sample(l, 4), 1);
}

TEST(Sampling, TopKOneIsGreedy) {
  sampler s({1.0f, 1, 1.0f, 0.0f, 7});
  const float l[] = {0.1f, 0.2f, 5.0f, 0.3f};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(l, 4), 2);
}

// With top-k/top-p/min-p off, empirical frequencies follow softmax(l / T).
TEST(Sampling, FrequenciesFollowSoftmaxAtTemperature) {
  const float l[] = {0.0f, 1.0f, 2.0f};
  const float T = 2.0f;
  sampler s({T, 0, 1.0f, 0.0f, 42});
  std::map<int, int> count;
  const int N = 20000;
  for (int i = 0; i < N; ++i) count[s.sample(l, 3)]++;
  double z = 0;
  for (float x : l) z += std::exp(x / T);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(count[i] / (double)N, std::exp(l[i] / T) / z, 0.015) << i;
}

// top-p 0.5 over probs {0.6, 0.3, 0.1} keeps only the first token; min-p 0.4 keeps {0.6, 0.3}.
TEST(Sampling, TopPAndMinPCut) {
  const float l[] = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  sampler a({1.0f, 0, 0.5f, 0.0f, 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(l, 3), 0);
  sampler b({1.0f, 0, 1.0f, 0.4f, 3});
  for (int i = 0; i < 300; ++i) EXPECT_NE(b.sample(l, 3), 2);
}

// A seed below 2^32 seeds mt19937 directly (reference: std::discrete_distribution over 64 equal
// weights drawn with std::mt19937(seed), which the sampler's flat row reduces to); a 64-bit seed
// (the server takes OpenAI's) is reproducible and not the stream of its low 32 bits.
TEST(Sampling, SeedsBelowAndAbove2To32) {
  const int n = 64, draws = 40;
  std::vector<float> flat(n, 0.5f);
  auto run = [&](uint64_t seed) {
    sampler s({1.0f, 0, 1.0f, 0.0f, seed});
    std::vector<int32_t> ids;
    for (int i = 0; i < draws; ++i) ids.push_back(s.sample(flat.data(), n));
    return ids;
  };
  std::mt19937 rng(7);
  const std::vector<double> weights(n, 1.0 / n);  // the sampler's softmax of a flat row, exactly
  std::discrete_distribution<size_t> dist(weights.begin(), weights.end());
  std::vector<int32_t> want;
  for (int i = 0; i < draws; ++i) want.push_back((int32_t)dist(rng));
  EXPECT_EQ(run(7), want);
  const uint64_t big = 7 + (1ull << 32);
  EXPECT_EQ(run(big), run(big));
  EXPECT_NE(run(big), run(7));
  EXPECT_NE(run(~0ull - 1), run(0xFFFFFFFEu));  // -2 as the server maps it, and its low half
}

TEST(Sampling, BadInputs) {
  EXPECT_THROW(sampler({NAN, 40, 0.9f, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({INFINITY, 40, 0.9f, 0.0f, 1}), kvq::error);   // was uniform over the top-k
  EXPECT_THROW(sampler({-INFINITY, 40, 0.9f, 0.0f, 1}), kvq::error);  // was greedy
  EXPECT_THROW(sampler({1.0f, 40, INFINITY, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({1.0f, 40, NAN, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({1.0f, 40, 0.0f, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({1.0f, 40, 0.9f, 1.5f, 1}), kvq::error);
  sampler s({0.0f, 40, 0.9f, 0.0f, 1});
  const float l[] = {NAN, -INFINITY};
  EXPECT_THROW(s.sample(l, 2), kvq::error);
}

}  // namespace
}  // namespace kvq
