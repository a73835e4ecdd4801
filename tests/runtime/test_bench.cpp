// kvq bench: row bookkeeping (bytes, ratios, baseline), both fill modes, synthetic models of
// published shapes (weights, loading, cleanup), and bad input. No timing assertions.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "kvq/bench.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

namespace fs = std::filesystem;

kv_cache_params kv(const std::string& t) {
  kv_cache_params c;
  c.type_k = c.type_v = t;
  return c;
}

TEST(Bench, RowsBytesAndRatiosOnStories260K) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  auto m = model::load(mp);
  for (const std::string fill : {"real", "synthetic"}) {
    bench_params p;
    p.formats = {kv("q8"), kv("q4")};  // f16 is added as the baseline
    p.depths = {40, 0};
    p.n_decode = 3;
    p.n_prefill = 8;
    p.n_batch = 16;
    p.n_threads = 2;
    p.fill = fill;
    const bench_result r = bench(*m, {}, p);
    ASSERT_EQ(r.rows.size(), 6u) << fill;
    EXPECT_EQ(r.n_ctx, 40 + 8);
    EXPECT_EQ(r.rows[0].type_k, "f16");
    EXPECT_TRUE(r.rows[0].baseline_only);
    EXPECT_FALSE(r.rows[2].baseline_only);
    auto cp = m->cache_params(r.n_ctx);
    for (const auto& row : r.rows) {
      cp.type_k = row.type_k;
      cp.type_v = row.type_v;
      EXPECT_EQ(row.kv_bytes_per_token, kv_bytes_per_token(cp));
      EXPECT_GT(row.decode_tokens_per_s, 0.0);
      EXPECT_GT(row.prefill_tokens_per_s, 0.0);
      EXPECT_LE(row.decode_ms_min, row.decode_ms_median);
      EXPECT_LE(row.decode_ms_median, row.decode_ms_max);
      if (row.depth == 0) {
        EXPECT_EQ(row.kv_bytes_used, 0u);
        EXPECT_DOUBLE_EQ(row.kv_bytes_ratio_vs_f16, r.rows[0].kv_bytes_per_token / row.kv_bytes_per_token);
      } else {
        EXPECT_GT(row.kv_bytes_used, 0u);
        EXPECT_DOUBLE_EQ(row.kv_bytes_ratio_vs_f16, (double)r.rows[1].kv_bytes_used / row.kv_bytes_used);
      }
      if (row.type_k == "f16") {
        // dense f16: 2 bytes x (K + V) x layers x kv heads x head_dim per stored position
        const auto& hp = m->hparams();
        EXPECT_EQ(row.kv_bytes_used, (size_t)row.depth * 2 * 2 * hp.n_layer * hp.n_kv_head * hp.head_dim);
        EXPECT_EQ(row.decode_speedup_vs_f16, 1.0);
        EXPECT_EQ(row.kv_bytes_ratio_vs_f16, 1.0);
      }
    }
    EXPECT_TRUE(r.rows[1].beyond_train_ctx == false);
  }
}

TEST(Bench, SyntheticModelHasTheShapeAndWeightStatistics) {
  model_shape s{"tiny", "qwen3", 2, 64, 4, 2, 32, 96, 256, 4096, 1e6f, true};
  const std::string dir = (fs::temp_directory_path() / ("kvq_test_bench_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (ggml_type wt : {ggml_type::f16, ggml_type::q8_0, ggml_type::q4_0}) {
    auto m = make_synthetic_model(s, wt, 0, 7, dir);
    EXPECT_TRUE(fs::is_empty(dir)) << "the temporary GGUF must be unlinked after loading";
    const auto& hp = m->hparams();
    EXPECT_EQ(hp.arch, "qwen3");
    EXPECT_EQ(hp.n_layer, 2);
    EXPECT_EQ(hp.n_embd, 64);
    EXPECT_EQ(hp.n_head, 4);
    EXPECT_EQ(hp.n_kv_head, 2);
    EXPECT_EQ(hp.head_dim, 32);
    EXPECT_EQ(hp.n_ff, 96);
    EXPECT_EQ(hp.n_vocab, 256);
    EXPECT_TRUE(hp.tied_output);
    EXPECT_TRUE(hp.qk_norm);
    const gguf_tensor_info& t = m->gguf().tensor("blk.1.ffn_down.weight");
    EXPECT_EQ(t.type, wt);
    EXPECT_EQ(t.ne[0], 96);
    // Element variance of the weights: 1 / n_in (uniform; q4_0's levels -8..7 of d = a/8 give
    // E[k^2] * 3 / 64 = 21.5 * 3 / 64 of it).
    const gguf_tensor_info& w = m->gguf().tensor("blk.0.attn_q.weight");
    double s2 = 0;
    const int64_t n = w.n_elements();
    for (int64_t i = 0; i < n; ++i) {
      double x;
      if (wt == ggml_type::f16) {
        uint16_t h;
        std::memcpy(&h, w.data + 2 * i, 2);
        x = f16_to_f32(h);
      } else if (wt == ggml_type::q8_0) {
        uint16_t d;
        std::memcpy(&d, w.data + (i / 32) * 34, 2);
        x = f16_to_f32(d) * (int8_t)w.data[(i / 32) * 34 + 2 + i % 32];
      } else {
        uint16_t d;
        std::memcpy(&d, w.data + (i / 32) * 18, 2);
        const uint8_t b = w.data[(i / 32) * 18 + 2 + (i % 32) % 16];
        x = f16_to_f32(d) * (((i % 32) < 16 ? (b & 15) : (b >> 4)) - 8);
      }
      s2 += x * x;
    }
    const double expect = (wt == ggml_type::q4_0 ? 21.5 * 3 / 64 : 1.0) / 64.0;
    EXPECT_NEAR(s2 / n, expect, 0.1 * expect) << ggml_type_name(wt);
    // It runs: a short bench with synthetic fill (the forward checks activations are finite).
    bench_params p;
    p.formats = {kv("f16")};
    p.depths = {0, 33};
    p.n_decode = 2;
    p.n_prefill = 4;
    p.fill = "synthetic";
    const bench_result r = bench(*m, {}, p);
    ASSERT_EQ(r.rows.size(), 2u);
    EXPECT_FALSE(r.rows[0].baseline_only);
  }
  fs::remove_all(dir);
}

TEST(Bench, PublishedShapes) {
  const model_shape q = find_model_shape("qwen3-1.7b");
  EXPECT_EQ(q.n_layer, 28);
  EXPECT_EQ(q.n_embd, 2048);
  EXPECT_EQ(q.n_head, 16);
  EXPECT_EQ(q.n_kv_head, 8);
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.n_ff, 6144);
  EXPECT_EQ(q.n_vocab, 151936);
  const model_shape l = find_model_shape("llama3-8b");
  EXPECT_EQ(l.n_layer, 32);
  EXPECT_EQ(l.n_embd, 4096);
  EXPECT_EQ(l.n_head, 32);
  EXPECT_EQ(l.n_kv_head, 8);
  EXPECT_EQ(l.head_dim, 128);
  EXPECT_EQ(l.n_ff, 14336);
  EXPECT_EQ(l.n_vocab, 128256);
  try {
    find_model_shape("gpt-5");
    ADD_FAILURE();
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("qwen3-1.7b"), std::string::npos);
  }
}

TEST(Bench, BadInput) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  auto m = model::load(mp);
  auto msg = [&](const bench_params& p) -> std::string {
    try {
      bench(*m, {}, p);
    } catch (const error& e) {
      return e.what();
    }
    return "";
  };
  bench_params p;
  p.n_decode = 1;
  p.n_prefill = 0;
  EXPECT_NE(msg(p).find("no KV formats"), std::string::npos);
  p.formats = {kv("q4x")};
  EXPECT_NE(msg(p).find("unknown K cache type 'q4x'"), std::string::npos);
  p.formats = {kv("q4")};
  p.depths = {-1};
  EXPECT_NE(msg(p).find("depth -1"), std::string::npos);
  p.depths = {0};
  p.fill = "magic";
  EXPECT_NE(msg(p).find("real or synthetic"), std::string::npos);
  p.fill = "real";
  p.n_decode = 0;
  EXPECT_NE(msg(p).find("decode steps"), std::string::npos);
}

}  // namespace
}  // namespace kvq
