// Sampler semantics checked against distributions computed by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

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

TEST(Sampling, BadInputs) {
  EXPECT_THROW(sampler({NAN, 40, 0.9f, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({1.0f, 40, 0.0f, 0.0f, 1}), kvq::error);
  EXPECT_THROW(sampler({1.0f, 40, 0.9f, 1.5f, 1}), kvq::error);
  sampler s({0.0f, 40, 0.9f, 0.0f, 1});
  const float l[] = {NAN, -INFINITY};
  EXPECT_THROW(s.sample(l, 2), kvq::error);
}

}  // namespace
}  // namespace kvq
