// kvq bench: row bookkeeping (bytes, ratios, baseline), both fill modes, synthetic models of
// published shapes (weights, loading, cleanup), the up-front checks of depths against the cache
// and memory, the warm-up, and the CLI's bad input and plot handling (exit code 2, "[bench]"
// messages, results printed before the plot). No timing assertions.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvq/bench.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

namespace fs = std::filesystem;

kv_cache_params kv(const std::string& t) {
  kv_cache_params c;
  c.type_k = c.type_v = parse_kv_cache_type(t);
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
    EXPECT_EQ(r.n_ctx, 40 + 8 + 1);  // deepest + max(-n, -p) + 1 untimed decode step
    EXPECT_EQ(r.rows[0].type_k, "f16");
    EXPECT_TRUE(r.rows[0].baseline_only);
    EXPECT_FALSE(r.rows[2].baseline_only);
    auto cp = m->cache_params(r.n_ctx);
    for (const auto& row : r.rows) {
      cp.type_k = parse_kv_cache_type(row.type_k);
      cp.type_v = parse_kv_cache_type(row.type_v);
      EXPECT_EQ(row.kv_bytes_per_token, kv_bytes_per_token(cp));
      EXPECT_GT(row.decode_tokens_per_s, 0.0);
      EXPECT_GT(row.prefill_tokens_per_s, 0.0);
      EXPECT_LE(row.decode_ms_min, row.decode_ms_median);
      EXPECT_LE(row.decode_ms_median, row.decode_ms_max);
      if (row.depth == 0) {
        // an empty cache: nothing, or only K's per-channel μ / λ (per-token K, on by default)
        EXPECT_EQ(row.kv_bytes_used, make_kv_cache(cp)->bytes_used());
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
  // {n_layer, n_embd, n_head, n_kv_head, head_dim, n_ff, n_vocab} as the models' config.json give them
  auto expect_shape = [](const std::string& name, const std::vector<int>& want) {
    const model_shape s = find_model_shape(name);
    EXPECT_EQ((std::vector<int>{s.n_layer, s.n_embd, s.n_head, s.n_kv_head, s.head_dim, s.n_ff, s.n_vocab}), want)
        << name;
  };
  expect_shape("qwen3-1.7b", {28, 2048, 16, 8, 128, 6144, 151936});
  expect_shape("llama3-8b", {32, 4096, 32, 8, 128, 14336, 128256});
  expect_shape("llama3.1-8b", {32, 4096, 32, 8, 128, 14336, 128256});
  expect_shape("qwen2.5-1.5b", {28, 1536, 12, 2, 128, 8960, 151936});
  try {
    find_model_shape("gpt-5");
    ADD_FAILURE();
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("qwen3-1.7b"), std::string::npos);
  }
}

// shape_hparams (what the GPU runner's random-weight models take) equals what model::load reads
// from make_synthetic_model's file, field by field, for the three architectures' variants.
TEST(Bench, ShapeHparamsEqualTheLoadedSyntheticModel) {
  const std::string dir = (fs::temp_directory_path() / ("kvq_test_shape_hp_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (const model_shape& s : {model_shape{"tiny-llama", "llama", 3, 64, 4, 2, 32, 96, 256, 8192, 5e5f, false},
                               model_shape{"tiny-qwen2", "qwen2", 2, 64, 4, 1, 64, 128, 300, 32768, 1e6f, true},
                               model_shape{"tiny-qwen3", "qwen3", 2, 64, 4, 2, 32, 96, 256, 4096, 1e6f, true}}) {
    for (int n_layer : {0, 1}) {
      auto m = make_synthetic_model(s, ggml_type::f16, n_layer, 3, dir);
      const model_hparams& a = m->hparams();
      const model_hparams b = shape_hparams(s, n_layer);
      EXPECT_EQ(a.arch, b.arch);
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ((std::vector<int>{a.n_vocab, a.n_embd, a.n_layer, a.n_head, a.n_kv_head, a.head_dim, a.n_ff,
                                  a.n_ctx_train, a.n_rot}),
                (std::vector<int>{b.n_vocab, b.n_embd, b.n_layer, b.n_head, b.n_kv_head, b.head_dim, b.n_ff,
                                  b.n_ctx_train, b.n_rot}))
          << s.name;
      EXPECT_EQ(a.rope_freq_base, b.rope_freq_base);
      EXPECT_EQ(a.rope_freq_scale, b.rope_freq_scale);
      EXPECT_EQ(a.rope, b.rope);
      EXPECT_EQ(a.rms_eps, b.rms_eps);
      EXPECT_EQ(a.attn_scale, b.attn_scale);
      EXPECT_EQ((std::vector<bool>{a.qkv_bias, a.qk_norm, a.tied_output, a.post_norms}),
                (std::vector<bool>{b.qkv_bias, b.qk_norm, b.tied_output, b.post_norms}))
          << s.name;
      EXPECT_EQ(a.ffn, b.ffn);
      EXPECT_EQ(a.embd_scale, b.embd_scale);
      EXPECT_EQ(a.final_logit_softcap, b.final_logit_softcap);
      EXPECT_EQ(a.sliding_window, b.sliding_window);
      EXPECT_EQ(a.n_params, b.n_params) << s.name;
      ASSERT_EQ(a.layers.size(), b.layers.size());
      for (size_t i = 0; i < a.layers.size(); ++i) {
        EXPECT_EQ(a.layers[i].window, b.layers[i].window);
        EXPECT_EQ(a.layers[i].rope_freq_base, b.layers[i].rope_freq_base);
        EXPECT_EQ(a.layers[i].rope_freq_scale, b.layers[i].rope_freq_scale);
      }
    }
  }
  fs::remove_all(dir);
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
  EXPECT_THROW(kv("q4x"), error);  // names are parsed at the edge (the CLI test below checks the message)
  kv_cache_params bad;
  bad.type_k = bad.type_v = (kv_cache_type)200;
  p.formats = {bad};
  EXPECT_NE(msg(p).find("type_k 200 is not a kv_cache_type"), std::string::npos);
  p.formats = {kv("q4")};
  p.depths = {-1};
  EXPECT_NE(msg(p).find("--depths -1"), std::string::npos);
  p.depths = {0};
  p.fill = "magic";
  EXPECT_NE(msg(p).find("real or synthetic"), std::string::npos);
  p.fill = "real";
  p.n_decode = 0;
  EXPECT_NE(msg(p).find("decode steps"), std::string::npos);
  p.n_decode = 1;
  p.prefill_repeats = 0;
  EXPECT_NE(msg(p).find("prefill repeats 0"), std::string::npos);
}

TEST(Bench, CheckSizesTheCacheAndRefusesDepthsThatCannotRun) {
  kv_cache_params shape;  // qwen3-1.7b's cache shape: 28 layers, 8 kv heads, head_dim 128
  shape.n_layer = 28;
  shape.n_kv_head = 8;
  shape.head_dim = 128;
  bench_params p;
  p.formats = {kv("q4")};
  p.depths = {32768, 0, 4096};
  p.n_decode = 16;
  p.n_prefill = 8;
  // n_ctx: deepest depth + max(decode steps, prefill tokens) + 1 untimed decode step (which follows
  // the prefill of the warm-up and of every depth, so a prefill longer than the decode needs it too)
  EXPECT_EQ(bench_check(shape, p), 32768 + 17);
  p.n_prefill = 64;
  EXPECT_EQ(bench_check(shape, p), 32768 + 65);
  auto msg = [&](const bench_params& q) -> std::string {
    try {
      bench_check(shape, q);
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_input);
      return e.what();
    }
    return "";
  };
  // An explicit cache n_ctx must hold every depth and its timed positions.
  p.n_ctx = 32768;
  std::string m = msg(p);
  EXPECT_EQ(m.rfind("[bench] --depths 32768:", 0), 0u) << m;
  EXPECT_NE(m.find("n_ctx 32768"), std::string::npos) << m;
  EXPECT_NE(m.find("deepest depth it allows is " + std::to_string(32768 - 65)), std::string::npos) << m;
  p.n_ctx = 32768 + 65;
  EXPECT_EQ(bench_check(shape, p), 32768 + 65);
  p.n_ctx = 0;
  // Memory: f16 (the added baseline) 2 x 2 x 28 x 8 x 128 = 114688 bytes/token, q4 (g32: 64 code bytes
  // + 4 f16 scales per head and side) 28 x 8 x 2 x 72 = 32256 bytes/token.
  kv_cache_params f16 = shape, q4 = shape;
  f16.n_ctx = q4.n_ctx = 1;
  f16.type_k = f16.type_v = kv_cache_type::f16;
  q4.type_k = q4.type_v = kv_cache_type::q4;
  EXPECT_EQ(kv_bytes_per_token(f16), 114688.0);
  const double per_token = kv_bytes_per_token(f16) + kv_bytes_per_token(q4);
  p.max_kv_bytes = (size_t)(per_token * (32768 + 65));
  EXPECT_EQ(bench_check(shape, p), 32768 + 65);  // exactly fits
  p.max_kv_bytes -= 1;
  m = msg(p);
  EXPECT_EQ(m.rfind("[bench] --depths 32768:", 0), 0u) << m;
  EXPECT_NE(m.find("f16, q4"), std::string::npos) << m;
  EXPECT_NE(m.find("limit of"), std::string::npos) << m;
  EXPECT_NE(m.find("deepest depth that fits is " + std::to_string(32768 - 1)), std::string::npos) << m;
  p.max_kv_bytes = 0;
  // Depths are checked before anything else runs, whatever their order.
  p.depths = {0, -5, 16};
  EXPECT_NE(msg(p).find("--depths -5"), std::string::npos);
  p.depths = {std::numeric_limits<int>::max()};
  EXPECT_NE(msg(p).find("largest position"), std::string::npos);
  // Errors of the layers below carry bench's tag and the format.
  p.depths = {0};
  kv_cache_params bad;
  bad.type_k = bad.type_v = (kv_cache_type)200;
  p.formats = {kv("q4"), bad};
  m = msg(p);
  EXPECT_EQ(m.rfind("[bench] KV format '", 0), 0u) << m;
  EXPECT_NE(m.find("type_k 200"), std::string::npos) << m;
}

TEST(Bench, WarmUpRunsFirstAndTrainContextMarksRows) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  auto m = model::load(mp);
  bench_params p;
  p.formats = {kv("q4")};
  p.depths = {0, 24};
  p.n_decode = 2;
  p.n_prefill = 4;
  p.n_threads = 1;
  p.n_ctx_train = 16;  // stories260K was trained at 512 (its GGUF says 2048): the override wins
  std::vector<std::string> said;
  const bench_result r = bench(*m, {}, p, [&](const std::string& s) { said.push_back(s); });
  // The warm-up comes before any fill, prefill or timed decode.
  const auto warm = std::find(said.begin(), said.end(), "warm-up");
  ASSERT_NE(warm, said.end());
  for (auto it = said.begin(); it != warm; ++it)
    for (const char* step : {"fill", "prefill", "decode"}) EXPECT_EQ(it->find(step), std::string::npos) << *it;
  EXPECT_NE(warm + 1, said.end());
  EXPECT_EQ(r.n_ctx_train, 16);
  ASSERT_EQ(r.rows.size(), 4u);
  for (const auto& row : r.rows) EXPECT_EQ(row.beyond_train_ctx, row.depth == 24) << row.depth;  // 0 + 4 <= 16
  // The caches were truncated back after each depth: the 24-position f16 cache holds exactly 24.
  const auto& hp = m->hparams();
  EXPECT_EQ(r.rows[1].kv_bytes_used, (size_t)24 * 2 * 2 * hp.n_layer * hp.n_kv_head * hp.head_dim);
}

// ---- the CLI --------------------------------------------------------------------------------

struct tmp_dir {
  std::filesystem::path path;
  tmp_dir() {
    path = std::filesystem::temp_directory_path() / ("kvq_test_bench_cli_" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~tmp_dir() { std::filesystem::remove_all(path); }
};

void expect_bad_input(const test::cmd_result& r, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(r.err.rfind("error: [bench] ", 0), 0u) << r.err;
  for (const auto& s : parts) EXPECT_NE(r.err.find(s), std::string::npos) << "'" << s << "' not in: " << r.err;
  EXPECT_EQ(r.out, "") << "nothing is printed on bad input";
}

TEST(BenchCli, RefusesDepthsUpFrontNamingTheFlagValueAndLimit) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  // Deeper than the memory limit: refused before allocating or filling anything.
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "0,100k", "--max-kv-gib", "0.01", "--no-progress"}),
                   {"--depths 102400", "limit of 0.01 GiB", "deepest depth that fits", "--max-kv-gib"});
  // The default limit (half the available memory) refuses an absurd depth too.
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "2000000k", "--no-progress"}),
                   {"--depths 2048000000"});
  // A depth whose timed positions do not fit an explicit cache size.
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "0,4096", "-c", "4096", "-n", "16", "-p", "0",
                                  "--no-progress"}),
                   {"--depths 4096", "n_ctx 4096", "deepest depth it allows is 4079"});
  // Same checks for a synthetic shape, before the synthetic weights are written.
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "qwen3-1.7b", "--depths", "1000000", "--no-progress"}),
                   {"--depths 1000000", "limit of"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "12,x", "--no-progress"}), {"--depths", "'x'"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "9999999999", "--no-progress"}),
                   {"--depths 9999999999", "too large"});
}

// The warm-up (a prefill at 0, then one decode step) and each depth append max(-n, -p) + 1 positions:
// the automatic cache holds them, and an explicit -c that cannot is refused before the run.
TEST(BenchCli, CacheHoldsAPrefillLongerThanTheDecode) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  const auto r = test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0", "-n", "2", "-p", "16",
                                "-r", "1", "--json", "--no-progress"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["n_ctx"].get<int>(), 16 + 1);
  EXPECT_EQ(j["rows"].size(), 2u);  // f16 baseline + q4
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0", "-n", "2", "-p", "16",
                                  "-c", "16", "--no-progress"}),
                   {"n_ctx 16 (-c)", "17 timed positions", "no depth fits: -c must be >= 17"});
  // -c 17 is enough.
  EXPECT_EQ(test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0", "-n", "2", "-p", "16", "-r", "1",
                           "-c", "17", "--no-progress"}).rc, 0);
}

TEST(BenchCli, SyntheticOptionsAndMemoryLimitAreValidated) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  // --weights / --shape-layers set the synthetic model: refused with -m instead of being ignored.
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--weights", "q3", "--shape-layers", "3", "--no-progress"}),
                   {"--weights", "--shape", "-m"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--weights", "q8_0", "--no-progress"}), {"--weights"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--shape-layers", "3", "--no-progress"}),
                   {"--shape-layers", "--shape"});
  // An invalid weight type is refused (before any synthetic weights are written).
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "qwen3-0.6b", "--weights", "q3", "--no-progress"}),
                   {"--weights 'q3'", "f16, q8_0 or q4_0"});
  // --max-kv-gib: > 0, 0 (auto) or -1 (no limit).
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--max-kv-gib", "-5", "--no-progress"}),
                   {"--max-kv-gib -5", "-1 (no limit)"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--max-kv-gib", "-0.5", "--no-progress"}),
                   {"--max-kv-gib -0.5"});
  EXPECT_EQ(test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0", "-n", "1", "-p", "0",
                           "--max-kv-gib", "-1", "--no-progress"}).rc, 0);
}

// --device cuda (batched decode on the GPU): its options are validated before any work, and without
// a GPU (or a CUDA build) it is a clear "not supported" error, never a crash.
TEST(BenchCli, CudaDeviceOptionsAreValidated) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--batch", "4", "--no-progress"}),
                   {"--batch is an option of --device cuda"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--capacity", "128k", "--no-progress"}),
                   {"--capacity is an option of --device cuda"});
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "llama3.1-8b", "--device", "cuda", "--weights", "q4_0",
                                  "--no-progress"}),
                   {"--weights q4_0", "the GPU runs f16 weights"});
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "llama3.1-8b", "--device", "cuda", "--batch", "0",
                                  "--no-progress"}),
                   {"batch 0 must be >= 1"});
  // a type the GPU has no kernels for: refused by name before the GPU is looked for
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "llama3.1-8b", "--device", "cuda", "--types", "f16,q3",
                                  "--no-progress"}),
                   {"cache type 'q3' has no GPU kernels"});
  // KIVI with a V the GPU has no KIVI kernels for: refused by name before the GPU is looked for
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "llama3.1-8b", "--device", "cuda", "--types", "f16,kivi2",
                                  "--cuda-graphs", "--no-progress"}),
                   {"other KIVI types have no GPU kernels"});
  // -m with a head_dim the kernels do not take
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--device", "cuda", "--no-progress"}),
                   {"unsupported head_dim 8"});
  const test::cmd_result r =
      test::run_cmd({bin, "bench", "--shape", "qwen2.5-1.5b", "--device", "cuda", "--depths", "64", "-n", "2",
                     "--no-progress"});
  if (r.rc == 0) GTEST_SKIP() << "a GPU is visible: the run itself is checked on the GPU machine";
  // as every other command says it (README; CliDevice.CudaWithoutGpuIsNotSupported), not "[bench] ..."
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_TRUE(r.err.rfind("error: [cuda] not supported: kvq was built without KVQ_BUILD_CUDA", 0) == 0 ||
              r.err.rfind("error: [cuda] no GPU visible", 0) == 0)
      << r.err;
  EXPECT_EQ(r.out, "");
}

TEST(BenchCli, ErrorsCarryTheBenchTag) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  expect_bad_input(test::run_cmd({bin, "bench", "-m", "/nonexistent/model.gguf", "--no-progress"}),
                   {"-m '/nonexistent/model.gguf'"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "-f", "/nonexistent/text.txt", "--no-progress"}),
                   {"-f", "/nonexistent/text.txt"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "-ctk", "q4x", "--no-progress"}),
                   {"KV format 'q4x/f16'", "unknown K cache type 'q4x'"});
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--types", "f16,q4,q5", "--no-progress"}),
                   {"KV format 'q5'"});
  expect_bad_input(test::run_cmd({bin, "bench", "--shape", "gpt-5", "--no-progress"}), {"gpt-5", "qwen3-1.7b"});
}

TEST(BenchCli, PlotFailureKeepsTheResults) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  tmp_dir dir;
  // A plot into a missing directory is refused before the run.
  const std::string missing = (dir.path / "no" / "such" / "dir" / "b.png").string();
  expect_bad_input(test::run_cmd({bin, "bench", "-m", mp, "--depths", "0,8", "-n", "2", "-p", "2", "--plot", missing,
                                  "--no-progress"}),
                   {"--plot '" + missing + "'", "does not exist"});
  // A plotter that passes the check before the run and fails after it (a stand-in for python3,
  // selected by KVQ_PYTHON): the table is on stdout, the error names the file, exit code 2.
  const std::string fake = (dir.path / "fake_python.sh").string();
  {
    std::ofstream f(fake);
    f << "#!/bin/sh\n"
         "if [ -e \"" << (dir.path / "called").string() << "\" ]; then echo 'plotter broke' >&2; exit 3; fi\n"
         "touch \"" << (dir.path / "called").string() << "\" && touch \"$3\"\n";
  }
  ::chmod(fake.c_str(), 0755);
  const std::string png = (dir.path / "b.png").string();
  ::setenv("KVQ_PYTHON", fake.c_str(), 1);
  const auto r = test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0,8", "-n", "2", "-p", "2",
                                "-t", "1", "--plot", png, "--no-progress"});
  ::unsetenv("KVQ_PYTHON");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.out.find("| f16               |      8 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| q4+sink4+recent32 |      8 |"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("error: [bench] --plot '" + png + "'"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(png));
  EXPECT_FALSE(std::filesystem::exists(png + ".check.png")) << "the probe plot is removed";
  // --json: the object is printed (and parses) before the plot fails.
  std::filesystem::remove(dir.path / "called");
  ::setenv("KVQ_PYTHON", fake.c_str(), 1);
  const auto rj = test::run_cmd({bin, "bench", "-m", mp, "--types", "q4", "--depths", "0", "-n", "1", "-p", "0",
                                 "-t", "1", "--plot", png, "--json", "--no-progress"});
  ::unsetenv("KVQ_PYTHON");
  EXPECT_EQ(rj.rc, 2) << rj.err;
  const auto j = nlohmann::json::parse(rj.out);
  EXPECT_EQ(j["rows"].size(), 2u);
  EXPECT_EQ(j["machine"]["n_cpu"].get<int>(), (int)::sysconf(_SC_NPROCESSORS_ONLN));
}

TEST(BenchCli, PlotWritesAPng) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  if (test::run_cmd({"/usr/bin/python3", "-c", "import matplotlib"}).rc != 0)
    GTEST_SKIP() << "/usr/bin/python3 with matplotlib (python3-matplotlib) not available";
  tmp_dir dir;
  const std::string png = (dir.path / "bench.png").string();
  const auto r = test::run_cmd({test::kvq_bin(), "bench", "-m", mp, "--types", "q4", "--depths", "0,8", "-n", "2", "-p",
                                "2", "-t", "1", "--plot", png, "--no-progress"});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::ifstream f(png, std::ios::binary);
  char magic[8] = {};
  f.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()), 1)
      << "only the PNG is left (no probe or temporary files)";
}

}  // namespace
}  // namespace kvq
