// The text of a certified-cache report (tools/certified_report.h), as kvq perplexity / generate /
// bench print it on stderr: the lines, their prefix, and the figures of a real cache's report.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache/test_certified_util.h"
#include "kvq/thread_pool.h"
#include "tools/certified_report.h"

namespace kvq {
namespace {

using namespace cert_test;

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> r;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) r.push_back(l);
  return r;
}

// A one-layer certified cache (2 kv heads x 3 query heads, head_dim 32) after one attend of n tokens.
certified_report report_after(int n, bool measure) {
  thread_pool pool(1);
  const int nkv = 2, nh = 6, hd = 32;
  std::mt19937 rng(11);
  const std::vector<float> k = gauss(rng, (size_t)n * nkv * hd, 1.0f), v = gauss(rng, (size_t)n * nkv * hd, 1.0f),
                           q = gauss(rng, (size_t)n * nh * hd, 1.0f);
  kv_cache_params p = cert_params(nkv, hd, n, 1e-2);
  p.certify_measure = measure;
  auto c = make_kv_cache_certified(p);
  c->append(0, 0, n, k.data(), v.data());
  std::vector<float> out((size_t)n * nh * hd);
  c->attend(0, 0, 0, n, nh, q.data(), 0.2f, out.data(), pool);
  return c->report();
}

TEST(CertifiedReport, TextLinesOfACacheReport) {
  const int n = 7, nh = 6;
  const certified_report r = report_after(n, /*measure=*/true);
  ASSERT_EQ(r.stats.steps, (uint64_t)n * nh);
  const std::string text = cli::format_certified_report(r, "[x] ");
  EXPECT_EQ(text.rfind("[x] certified: K q8", 0), 0u) << text;
  EXPECT_NE(text.back(), '\n');
  const std::vector<std::string> ls = lines_of(text);
  ASSERT_EQ(ls.size(), 6u) << text;  // cache, steps, bound, bound / actual error, tiers, adaptive precision
  for (const auto& l : ls) EXPECT_EQ(l.rfind("[x] ", 0), 0u) << l;
  EXPECT_EQ(ls[0], "[x] " + r.describe);
  EXPECT_EQ(ls[1].rfind("[x] steps " + std::to_string(n * nh) + " (layer x query head x token): certified " +
                            std::to_string(r.stats.certified) + " (",
                        0),
            0u)
      << ls[1];
  for (const char* w : {"steps", "certified", "partly recomputed", "fully recomputed", "bound / actual error", "tiers"})
    EXPECT_NE(text.find(w), std::string::npos) << w << "\n" << text;
  EXPECT_NE(ls[3].find("violations 0"), std::string::npos) << ls[3];
  EXPECT_NE(ls[4].find("in RAM"), std::string::npos) << ls[4];
  char share[64];  // the fast tier's share of the f16 cache's bytes per token
  std::snprintf(share, sizeof share, ", %.1f%% of f16's %.0f)", 100.0 * r.fast_bytes_per_token / r.f16_bytes_per_token,
                r.f16_bytes_per_token);
  EXPECT_NE(ls[4].find(share), std::string::npos) << ls[4] << " / " << share;
  EXPECT_EQ(ls[5], "[x] adaptive precision: 0 upgrade(s)");

  // without measure there is no bound / actual error line
  const std::string plain = cli::format_certified_report(report_after(n, false));
  EXPECT_EQ(lines_of(plain).size(), 5u) << plain;
  EXPECT_EQ(plain.find("actual error"), std::string::npos) << plain;
}

TEST(CertifiedReport, ListsTheFirstSixteenUpgrades) {
  certified_report r = report_after(5, false);
  for (int i = 0; i < 20; ++i) r.upgrades.push_back("layer " + std::to_string(i) + " kv head 0 V q4->q8");
  r.stats.heads_upgraded = 20;
  const std::vector<std::string> ls = lines_of(cli::format_certified_report(r));
  ASSERT_FALSE(ls.empty());
  const std::string& last = ls.back();
  EXPECT_EQ(last.rfind("adaptive precision: 20 upgrade(s): layer 0 kv head 0 V q4->q8, layer 1 ", 0), 0u) << last;
  EXPECT_NE(last.find("layer 15 kv head 0 V q4->q8, ..."), std::string::npos) << last;
  EXPECT_EQ(last.find("layer 16 "), std::string::npos) << last;
}

}  // namespace
}  // namespace kvq
