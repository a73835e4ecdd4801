// Greedy generation and next-token logits against llama.cpp's golden outputs on real models.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/error.h"
#include "kvq/generate.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

generate_params greedy(const std::string& prompt, const std::string& kv, int n_ctx) {
  generate_params p;
  p.prompt = prompt;
  p.n_predict = 64;
  p.n_ctx = n_ctx;
  p.n_threads = 2;
  p.sampling.temp = 0.0f;
  p.cache.type_k = p.cache.type_v = parse_kv_cache_type(kv);
  return p;
}

// Every llama.cpp f16 greedy run (3 prompts x 64 tokens, -c 512) is reproduced token for token
// by kvq with the f32 and the f16 cache.
void check_golden_generation(const std::string& model_rel, const std::string& golden_rel,
                             const std::vector<std::string>& kv_types) {
  KVQ_REQUIRE_DATA(model_path, model_rel);
  KVQ_REQUIRE_DATA(golden_path, golden_rel);
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto golden = read_json(golden_path);
  int n_checked = 0;
  for (const auto& run : golden["runs"]) {
    const std::string id = run["id"];
    if (id.find("_f16_fa-on") == std::string::npos || id.find("_n256") != std::string::npos) continue;
    const auto want_prompt = run["prompt_token_ids"].get<std::vector<int32_t>>();
    const auto want = run["generated_token_ids"].get<std::vector<int32_t>>();
    for (const auto& kv : kv_types) {
      const generate_result r = generate(*m, *tok, greedy(run["prompt"], kv, 512));
      EXPECT_EQ(r.prompt_ids, want_prompt) << id << " kv " << kv;
      EXPECT_EQ(r.ids, want) << id << " kv " << kv;
      ++n_checked;
    }
  }
  EXPECT_GE(n_checked, 3 * (int)kv_types.size());
}

TEST(GenerateGolden, Stories260KGreedyMatchesLlamaCpp) {
  check_golden_generation("models/stories260K/stories260K.gguf", "golden/stories260K/generation.json", {"f32", "f16"});
}

TEST(GenerateGolden, TinylitGreedyMatchesLlamaCpp) {
  check_golden_generation("models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf", "golden/tinylit-hd64-gqa4/generation.json",
                          {"f32", "f16"});
}

// stories260K with its llama.cpp golden runs, loaded in SetUp (where GTEST_SKIP skips the test
// when the shared data is absent).
class Stories260KGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
    KVQ_REQUIRE_DATA(golden_path, "golden/stories260K/generation.json");
    m = model::load(model_path);
    tok = tokenizer::from_gguf(m->gguf());
    golden = read_json(golden_path);
  }
  std::unique_ptr<model> m;
  std::unique_ptr<tokenizer> tok;
  nlohmann::json golden;
};

TEST_F(Stories260KGolden, Greedy256Tokens) {
  for (const auto& run : golden["runs"]) {
    if (run["id"] != "p1_f16_fa-on_n256") continue;
    generate_params p = greedy(run["prompt"], "f16", 512);
    p.n_predict = 256;
    const generate_result r = generate(*m, *tok, p);
    EXPECT_EQ(r.ids, run["generated_token_ids"].get<std::vector<int32_t>>());
    return;
  }
  FAIL() << "run p1_f16_fa-on_n256 not found in the golden file";
}

// Identical leading tokens of a and b.
int identical_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return (int)n;
}

// The K channel scale's calibration positions in the greedy runs below: the prompts' (4+ tokens), as
// when it was calibrated on the first append. At the default 256 a prompt + 64 tokens would stay in
// the staging rows, attended exactly (docs/formats.md), and every per-token format would equal f16.
constexpr int kPromptCalib = 16;

// Teacher-forced agreement: the cache `type` is fed the prompt, then f16's generated tokens one at a
// time (generate's prefill and decode path); counts the steps whose greedy token (first argmax, as
// the sampler) equals f16's. Unlike the identical prefix it keeps measuring after a divergence.
int forced_agreement(model& m, const std::vector<int32_t>& prompt, const std::vector<int32_t>& f16_ids,
                     const std::string& type) {
  kv_cache_params cp = m.cache_params(512);
  cp.type_k = cp.type_v = parse_kv_cache_type(type);
  cp.channel_calib = kPromptCalib;
  auto cache = make_kv_cache(cp);
  thread_pool pool(2);
  std::vector<float> logits(m.hparams().n_vocab);
  m.forward(prompt, 0, 0, *cache, pool, logits.data(), false);
  int agree = 0, pos = (int)prompt.size();
  for (int32_t id : f16_ids) {
    agree += std::max_element(logits.begin(), logits.end()) - logits.begin() == id;
    m.forward(std::span<const int32_t>(&id, 1), pos++, 0, *cache, pool, logits.data(), false);
  }
  return agree;
}

// Greedy 64 tokens with the compressed caches vs the f16 cache, on the three prompts of the f16
// golden runs (whose 64 tokens are checked against llama.cpp above). The 8-bit formats reproduce
// f16 token for token, K q8 / V q4 all but the last token of p1 (64 / 64 / 64 until the staging
// rows of the first kPromptCalib positions became f16 in 5b64630: a near-tie at token 64 of p1,
// 63 / 64 / 64 since); for the 4/3/2-bit formats the identical prefix length is
// recorded (docs/quality.md, "stories260K greedy 64 tokens vs the f16 cache") and held to floors
// set a little under the values measured at this commit.
TEST_F(Stories260KGolden, CompressedCachesVsF16Greedy) {
  auto run_kv = [&](const std::string& prompt, const std::string& k, const std::string& v) {
    generate_params p = greedy(prompt, k, 512);
    p.cache.type_v = parse_kv_cache_type(v, "V");
    p.cache.channel_calib = kPromptCalib;
    const generate_result r = generate(*m, *tok, p);
    EXPECT_EQ(r.ids.size(), 64u) << prompt << " K " << k << " V " << v << ": " << r.stop_reason;
    return r;
  };
  // Measured at this commit (p1 "Once upon a time", p2 "Lily and Tom went to the park.", p3 "The
  // little dog"; identical with 1 and 2 threads and through `kvq generate`):
  //   q4 35/4/14, q4a 21/4/21, kivi4 64/52/64, q3 8/0/0, q2 1/0/0, q2a 1/0/0, kivi2 34/20/28.
  // Since the K channel scale is calibrated on fixed positions (here kPromptCalib = 16, kept exact
  // until they have arrived): q4 35/52/14, q4a 39/34/14 (its p3 floor lowered to 11), kivi4
  // 64/52/64, q3 16/4/14, q2 16/4/18, q2a 16/4/19, kivi2 34/20/28; teacher-forced q4 59/62/61,
  // q4a 62/61/59, q3 58/56/55, q2 46/37/40, q2a 45/43/50, kivi2 61/53/60.
  // Greedy decoding is deterministic, but a legitimate change of rounding order (a kernel tier,
  // a refit) can flip a near-tied token, so each floor sits about 20 % (at least 1-2 tokens)
  // under the measured value; a format whose scales or codes are wrong diverges within a few
  // tokens (q2 keeps 1 token of 64) and fails the 4- and 8-bit floors. 0 where 0 was measured
  // (not asserted: the teacher-forced floors below cover those).
  struct lossy {
    std::string type;
    int floor[3];         // identical-prefix floor per prompt (p1, p2, p3); 0: not asserted
    int forced_floor[3];  // teacher-forced agreement floor per prompt (forced_agreement, of 64)
  };
  // The identical prefix is 0 for q3 / q2 / q2a on p2 and p3 (their first token already differs), so
  // a floor there could not fail; the teacher-forced agreement (forced_agreement) keeps measuring
  // after a divergence and holds every format, those included. Measured at this commit:
  //   q4 56/50/50, q4a 56/53/53, kivi4 64/63/64, q3 34/31/36, q2 16/12/12, q2a 24/19/16,
  //   kivi2 61/53/60 of 64 (f16 itself 64/64/64);
  // floors are 80 % of these, rounded down. At 2 bits the attention output error exceeds uniform
  // attention's (tests/cache), so the q2 / q2a floors guard the measured behaviour against
  // regressions rather than certify quality.
  const std::vector<lossy> lossy_types = {
      {"q4", {28, 2, 11}, {44, 40, 40}}, {"q4a", {16, 2, 11}, {44, 42, 42}}, {"kivi4", {51, 41, 51}, {51, 50, 51}},
      {"q3", {6, 0, 0}, {27, 24, 28}},   {"q2", {1, 0, 0}, {12, 9, 9}},      {"q2a", {1, 0, 0}, {19, 15, 12}},
      {"kivi2", {27, 16, 22}, {48, 42, 48}},
  };
  std::vector<std::vector<int>> prefix(lossy_types.size()), agree(lossy_types.size());
  int n_prompts = 0;
  for (const auto& run : golden["runs"]) {
    const std::string id = run["id"];
    if (id.find("_f16_fa-on") == std::string::npos || id.find("_n256") != std::string::npos) continue;
    ASSERT_LT(n_prompts, 3) << id;
    const std::string prompt = run["prompt"];
    const generate_result f16 = run_kv(prompt, "f16", "f16");
    ASSERT_EQ(f16.ids, run["generated_token_ids"].get<std::vector<int32_t>>()) << id;
    ASSERT_EQ(forced_agreement(*m, f16.prompt_ids, f16.ids, "f16"), 64) << id << ": the forced path is generate's";
    for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{
             {"q8", "q8"}, {"q8a", "q8a"}, {"kivi8", "kivi8"}, {"q8", "q4"}}) {
      const generate_result r = run_kv(prompt, k, v);
      EXPECT_LT(r.kv_bytes_per_token, f16.kv_bytes_per_token) << "K " << k << " V " << v;  // really compressed
      if (k == "q8" && v == "q4") EXPECT_GE(identical_prefix(r.ids, f16.ids), 63) << id << " K " << k << " V " << v;
      else
        EXPECT_EQ(r.ids, f16.ids) << id << " K " << k << " V " << v << ": first " << identical_prefix(r.ids, f16.ids)
                                  << " of 64 identical";
    }
    for (size_t i = 0; i < lossy_types.size(); ++i) {
      const lossy& l = lossy_types[i];
      const generate_result r = run_kv(prompt, l.type, l.type);
      EXPECT_LT(r.kv_bytes_per_token, f16.kv_bytes_per_token) << l.type;
      const int n = identical_prefix(r.ids, f16.ids);
      prefix[i].push_back(n);
      if (l.floor[n_prompts] > 0) {
        EXPECT_GE(n, l.floor[n_prompts]) << id << " " << l.type << ": identical prefix " << n << " of 64";
      }
      const int a = forced_agreement(*m, f16.prompt_ids, f16.ids, l.type);
      agree[i].push_back(a);
      EXPECT_GE(a, l.forced_floor[n_prompts]) << id << " " << l.type << ": teacher-forced agreement " << a << " of 64";
    }
    ++n_prompts;
  }
  ASSERT_EQ(n_prompts, 3);
  // Per-channel K keeps f16's tokens longest at each bit width, as its perplexity says
  // (docs/quality.md, stories260K: kivi4 +3.3 % vs q4 +52 %, q4a +37 %; kivi2 +178 % vs q2 +2621 %).
  auto total = [&](const std::vector<std::vector<int>>& per_type, const std::string& t) {
    for (size_t i = 0; i < lossy_types.size(); ++i)
      if (lossy_types[i].type == t) return per_type[i][0] + per_type[i][1] + per_type[i][2];
    return -1;
  };
  for (const auto* m : {&prefix, &agree}) {
    EXPECT_GT(total(*m, "kivi4"), std::max(total(*m, "q4"), total(*m, "q4a")));
    EXPECT_GT(total(*m, "kivi2"), std::max(total(*m, "q2"), total(*m, "q2a")));
  }
  auto csv = [](const std::vector<int>& v) {
    std::string s;
    for (int n : v) {
      if (!s.empty()) s += ',';
      s += std::to_string(n);
    }
    return s;
  };
  for (size_t i = 0; i < lossy_types.size(); ++i) {
    RecordProperty("identical_prefix_" + lossy_types[i].type, csv(prefix[i]));
    RecordProperty("forced_agreement_" + lossy_types[i].type, csv(agree[i]));
    std::printf("[stories260K greedy 64] %-6s vs f16 (p1,p2,p3): identical prefix %s, teacher-forced agreement %s\n",
                lossy_types[i].type.c_str(), csv(prefix[i]).c_str(), csv(agree[i]).c_str());
  }
}

// Next-token logits after "Once upon a time" with the f32 cache equal llama.cpp's f32/FA-off
// logits to 1e-3 absolute (all 512 of them).
TEST(GenerateGolden, Stories260KLogitsMatchLlamaCpp) {
  KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(golden_path, "golden/stories260K/logits_once_upon_a_time.json");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto g = read_json(golden_path);
  const auto ids = tok->encode(g["prompt"].get<std::string>(), true, true);
  ASSERT_EQ(ids, g["prompt_token_ids"].get<std::vector<int32_t>>());
  kv_cache_params cp = m->cache_params(512);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(2);
  std::vector<float> logits(m->hparams().n_vocab);
  m->forward(ids, 0, 0, *cache, pool, logits.data(), false);
  const auto want = g["runs"]["f32_fa-off"]["logits"].get<std::vector<float>>();
  ASSERT_EQ(want.size(), logits.size());
  double max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i) max_diff = std::max(max_diff, (double)std::fabs(want[i] - logits[i]));
  EXPECT_LT(max_diff, 1e-3) << "max |dlogit| vs llama.cpp f32_fa-off";
  RecordProperty("max_abs_logit_diff", std::to_string(max_diff));
}

TEST(GenerateErrors, EmptyPromptLongPromptUnknownType) {
  KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  auto expect_input_error = [&](const generate_params& p, const std::string& needle) {
    try {
      generate(*m, *tok, p);
      FAIL() << "expected an error containing '" << needle << "'";
    } catch (const kvq::error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(e.code(), errc::internal);
    }
  };
  generate_params empty_no_bos = greedy("", "f16", 64);  // with BOS an empty prompt is BOS alone
  empty_no_bos.add_bos = false;
  expect_input_error(empty_no_bos, "empty");
  std::string long_prompt;
  for (int i = 0; i < 100; ++i) long_prompt += "Once upon a time ";
  expect_input_error(greedy(long_prompt, "f16", 64), "more than the context size");
  EXPECT_THROW(greedy("Hello", "q5_zz", 64), error);  // names are parsed at the edge (CLI tests)
  generate_params bad_type = greedy("Hello", "f16", 64);
  bad_type.cache.type_k = (kv_cache_type)200;
  expect_input_error(bad_type, "type_k 200");
  expect_input_error(greedy("Hello", "f16", 1 << 20), "exceeds the model's training context");
}

// A generation cut by the context ends with the context full: the prompt and the generated ids
// take n_ctx positions, never n_ctx + 1 (it used to sample once more from the last position, a
// token no position could hold, and to accept a prompt of n_ctx tokens and sample after it). The
// ids it keeps are the first ones of the same greedy run in a larger context.
TEST(GenerateErrors, EndsWithTheContextFull) {
  KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const int n_ctx = 24;
  for (const std::string prompt : {"", "Once", "Once upon a time there was a little girl named Lily."}) {
    generate_params p = greedy(prompt, "f16", n_ctx);
    p.n_predict = -1;
    p.ignore_eos = true;
    const generate_result r = generate(*m, *tok, p);
    const int n_prompt = (int)r.prompt_ids.size();
    ASSERT_LT(n_prompt, n_ctx) << prompt;
    EXPECT_EQ(n_prompt + (int)r.ids.size(), n_ctx) << "prompt '" << prompt << "' of " << n_prompt << " tokens";
    EXPECT_EQ(r.stop_reason, "context_full");
    generate_params wide = p;
    wide.n_ctx = 4 * n_ctx;
    wide.n_predict = n_ctx - n_prompt;
    const generate_result w = generate(*m, *tok, wide);
    EXPECT_EQ(r.ids, w.ids) << prompt;
    EXPECT_EQ(w.stop_reason, "n_predict");
    // a prompt of n_ctx tokens leaves no position to generate into, and -n 0 still prefills it
    generate_params full = p;
    full.n_ctx = n_prompt;
    try {
      generate(*m, *tok, full);
      ADD_FAILURE() << "a prompt of n_ctx = " << n_prompt << " tokens generated";
    } catch (const kvq::error& e) {
      EXPECT_NE(std::string(e.what()).find("leave no position for a generated token"), std::string::npos) << e.what();
      EXPECT_EQ(e.code(), errc::invalid_input);
    }
    full.n_predict = 0;
    const generate_result z = generate(*m, *tok, full);
    EXPECT_TRUE(z.ids.empty());
  }
}

// Sampling with a fixed seed is reproducible and differs from greedy on a flat distribution.
TEST(GenerateSampling, SeedReproducible) {
  KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  generate_params p = greedy("Once upon a time", "f16", 256);
  p.sampling = sampling_params{1.0f, 40, 0.95f, 0.05f, 1234};
  const auto a = generate(*m, *tok, p), b = generate(*m, *tok, p);
  EXPECT_EQ(a.ids, b.ids);
  p.sampling.seed = 99;
  const auto c = generate(*m, *tok, p);
  EXPECT_NE(a.ids, c.ids);
}

}  // namespace
}  // namespace kvq
