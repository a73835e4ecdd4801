// Dense f32/f16/bf16 caches against a float64 causal GQA attention reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cache/cache_params.h"
#include "kvq/error.h"
#include "kvq/sys_memory.h"
#include "kvq/f16.h"
#include "kvq/kv_cache.h"
#include "cache/attn_f64.h"

namespace kvq {
namespace {

float round_to(const std::string& type, float x) {
  if (type == "f16") return f16_to_f32(f32_to_f16(x));
  if (type == "bf16") return bf16_to_f32(f32_to_bf16(x));
  return x;
}

using test::attend_f64;

struct dense_case {
  std::string tk, tv;
  int hd, n_kv_head, grp;
};

class dense_cache : public ::testing::TestWithParam<dense_case> {};

TEST_P(dense_cache, matches_f64_reference) {
  const auto c = GetParam();
  kv_cache_params p;
  p.n_layer = 2;
  p.n_kv_head = c.n_kv_head;
  p.head_dim = c.hd;
  p.n_ctx = 300;
  p.n_seq = 2;
  p.type_k = parse_kv_cache_type(c.tk);
  p.type_v = parse_kv_cache_type(c.tv, "V");
  auto cache = make_kv_cache(p);
  const int n_head = c.n_kv_head * c.grp;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  // seq 1 gets 3 chunks (prefill 150, 1, 96) to exercise append at an offset
  const int chunks[] = {150, 1, 96};
  std::vector<float> kall, vall;  // rounded copies [n_pos, n_kv_head, hd] of layer 1
  thread_pool pool(2);
  int pos = 0;
  for (int n : chunks) {
    const size_t sz = (size_t)n * c.n_kv_head * c.hd;
    std::vector<float> k0(sz), v0(sz), k1(sz), v1(sz), q((size_t)n * n_head * c.hd);
    for (auto* b : {&k0, &v0, &k1, &v1, &q})
      for (auto& x : *b) x = nd(rng) * 2.0f;
    cache->append(0, 1, n, k0.data(), v0.data());
    EXPECT_EQ(cache->n_pos(1), pos);  // advances only once the last layer appended
    cache->append(1, 1, n, k1.data(), v1.data());
    for (float x : k1) kall.push_back(round_to(c.tk, x));
    for (float x : v1) vall.push_back(round_to(c.tv, x));
    std::vector<float> out(q.size());
    const float scale = 1.0f / std::sqrt((float)c.hd);
    cache->attend(1, 1, pos, n, n_head, q.data(), scale, out.data(), pool);
    const auto ref = attend_f64(kall, vall, q.data(), c.n_kv_head, c.hd, pos, n, n_head, scale);
    double max_err = 0, max_ref = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      max_err = std::max(max_err, std::abs(out[i] - ref[i]));
      max_ref = std::max(max_ref, std::abs(ref[i]));
    }
    EXPECT_LT(max_err, 2e-5 * std::max(1.0, max_ref)) << c.tk << "/" << c.tv << " chunk " << n;
    pos += n;
    EXPECT_EQ(cache->n_pos(1), pos);
  }
  EXPECT_EQ(cache->n_pos(0), 0);
  const size_t ek = c.tk == "f32" ? 4 : 2, ev = c.tv == "f32" ? 4 : 2;
  EXPECT_EQ(cache->bytes(), (size_t)2 * 2 * c.n_kv_head * 300 * c.hd * (ek + ev));
  EXPECT_EQ(cache->bytes_used(), (size_t)2 * pos * c.n_kv_head * c.hd * (ek + ev));
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(p), 2.0 * c.n_kv_head * c.hd * (ek + ev));
}

INSTANTIATE_TEST_SUITE_P(types, dense_cache,
                         ::testing::Values(dense_case{"f32", "f32", 64, 2, 4}, dense_case{"f16", "f16", 128, 1, 7},
                                           dense_case{"bf16", "bf16", 80, 2, 1}, dense_case{"f16", "f32", 8, 3, 2},
                                           dense_case{"f32", "bf16", 96, 1, 8}));

TEST(kv_cache, unknown_type_is_named) {
  kv_cache_params p = test::one_layer_params("f16", "f16", 64, 1, 16);
  try {
    parse_kv_cache_type("q5", "K");  // names are parsed once, at the edge (CLI, tools)
    FAIL() << "no error";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_input);
    EXPECT_NE(std::string(e.what()).find("[kv_cache] unknown K cache type 'q5' (supported: f32, f16"),
              std::string::npos)
        << e.what();
  }
  try {
    parse_kv_cache_type("q4_0", "K");  // a llama.cpp name gets a hint
    ADD_FAILURE() << "no error for q4_0";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("; llama.cpp's q4_0 is closest to kvq's q4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_kv_cache_type("zz", "V"), error);
  for (const auto& t : kv_type_names()) EXPECT_EQ(kv_cache_type_name(parse_kv_cache_type(t)), t);
  p.type_v = (kv_cache_type)200;  // out of the enum: validate names the field and value
  try {
    make_kv_cache(p);
    ADD_FAILURE() << "no error for type_v 200";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_input);
    EXPECT_NE(std::string(e.what()).find("[kv_cache] type_v 200 is not a kv_cache_type"), std::string::npos) << e.what();
  }
  p.type_v = kv_cache_type::f16;
  p.head_dim = 0;
  EXPECT_THROW(make_kv_cache(p), error);
}

TEST(kv_cache, overflow_truncate_clear) {
  const kv_cache_params p = test::one_layer_params("f16", "f16", 4, 1, 4);
  auto c = make_kv_cache(p);
  std::vector<float> k(4 * 5, 1.0f), v(4 * 5, 2.0f);
  c->append(0, 0, 3, k.data(), v.data());
  EXPECT_THROW(c->append(0, 0, 2, k.data(), v.data()), error);
  EXPECT_EQ(c->n_pos(0), 3);
  c->truncate(0, 1);
  EXPECT_EQ(c->n_pos(0), 1);
  c->append(0, 0, 3, k.data(), v.data());
  EXPECT_EQ(c->n_pos(0), 4);
  c->clear(0);
  EXPECT_EQ(c->n_pos(0), 0);
  EXPECT_EQ(c->bytes_used(), 0u);
  thread_pool pool(1);
  std::vector<float> q(4, 1.0f), out(4);
  EXPECT_THROW(c->attend(0, 0, 0, 1, 1, q.data(), 0.5f, out.data(), pool), error);
}

// A cache larger than the memory available is refused up front with the bytes it needs (not an
// OOM kill or std::bad_alloc), for dense and compressed types alike.
TEST(kv_cache, larger_than_available_memory_is_refused) {
  const size_t avail = mem_available_bytes();
  if (avail == 0) GTEST_SKIP() << "MemAvailable unknown on this system";
  for (const char* t : {"f32", "q4"}) {
    kv_cache_params p;
    p.n_layer = 64;
    p.n_kv_head = 8;
    p.head_dim = 128;
    p.type_k = p.type_v = parse_kv_cache_type(t);
    // the smallest n_ctx (a multiple of 1024) whose cache exceeds MemAvailable by 25 %
    p.n_ctx = 1024;
    while ((double)kv_bytes_at_ctx(p) < 1.25 * (double)avail && p.n_ctx < (1 << 30) / 2) p.n_ctx *= 2;
    ASSERT_GT((double)kv_bytes_at_ctx(p), (double)avail) << t;
    try {
      make_kv_cache(p);
      ADD_FAILURE() << t << ": no error";
    } catch (const error& e) {
      const std::string m = e.what();
      EXPECT_EQ(e.code(), errc::invalid_input) << m;
      EXPECT_NE(m.find("[kv_cache] a cache of n_ctx " + std::to_string(p.n_ctx)), std::string::npos) << m;
      EXPECT_NE(m.find("MemAvailable"), std::string::npos) << m;
    }
  }
}

// NaN / Inf policy of the dense caches (docs/formats.md): they store what they are given, f16
// overflow becomes Inf, and attention passes it through without a crash: with one key the output
// is its V row exactly, so channel 1 (1e5 -> f16 Inf, f32 keeps it) and channel 2 (NaN) come back
// as stored while the other channels stay finite.
TEST(kv_cache, dense_caches_store_non_finite_values_as_given) {
  for (const char* t : {"f32", "f16", "bf16"}) {
    SCOPED_TRACE(t);
    kv_cache_params p;
    p.n_layer = 1;
    p.n_kv_head = 1;
    p.head_dim = 32;
    p.n_ctx = 4;
    p.type_k = p.type_v = parse_kv_cache_type(t);
    auto c = make_kv_cache(p);
    std::vector<float> k(32, 0.5f), v(32, 0.25f);
    v[1] = 1e5f;
    v[2] = NAN;
    ASSERT_NO_THROW(c->append(0, 0, 1, k.data(), v.data()));
    thread_pool pool(1);
    std::vector<float> q(32, 1.0f), out(32);
    c->attend(0, 0, 0, 1, 1, q.data(), 0.125f, out.data(), pool);
    EXPECT_EQ(out[0], 0.25f);
    if (std::string(t) == "f16") {
      EXPECT_TRUE(std::isinf(out[1]) && out[1] > 0) << out[1];
    } else {
      EXPECT_NEAR(out[1], 1e5f, 1e5f / 128) << out[1];  // bf16 rounds to 8 significant bits
    }
    EXPECT_TRUE(std::isnan(out[2])) << out[2];
    for (int i = 3; i < 32; ++i) ASSERT_EQ(out[i], 0.25f) << i;
  }
}

}  // namespace
}  // namespace kvq
