// Greedy generation and next-token logits against llama.cpp's golden outputs on real models.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

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
  p.cache.type_k = p.cache.type_v = kv;
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

TEST(GenerateGolden, Stories260KGreedy256Tokens) {
  KVQ_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(golden_path, "golden/stories260K/generation.json");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto golden = read_json(golden_path);
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
  cp.type_k = cp.type_v = "f32";
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
  expect_input_error(greedy("Hello", "q5_zz", 64), "q5_zz");
  expect_input_error(greedy("Hello", "f16", 1 << 20), "exceeds the model's training context");
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
