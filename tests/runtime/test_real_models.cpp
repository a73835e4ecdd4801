// Real models against llama.cpp's golden outputs (golden/qwen2.5-coder-0.5b-instruct-q4_k_m/ and
// golden/gemma-3-270m-q4_k_m/, see their READMEs): greedy generation with an f16 cache and
// wikitext-2 perplexity at -c 512. The models are the Q4_K_M files of scripts/fetch-models.sh in
// KVQ_MODEL_DIR (default <source dir>/models); each test skips, naming the file, without them.
//
// CI budget (2 cores): the generation tests run all 3 prompts x 64 tokens; the Qwen perplexity
// test checks the first 4 of the golden's 40 chunks (each chunk's PPL and the running PPL after it
// within 1 % of llama.cpp's, the running PPL after 4 chunks within 0.2 %), Gemma's its first 4 of
// 20 (against llama.cpp's per-chunk values re-run at the golden's commit, tests/data/golden-derived/);
// KVQ_LONG_TESTS=1 runs all 40 and all 20.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/generate.h"
#include "kvq/perplexity.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

constexpr const char* kQwenFile = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
constexpr const char* kGemmaFile = "gemma-3-270m-q4_k_m.gguf";

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

bool long_tests() {
  const char* e = std::getenv("KVQ_LONG_TESTS");
  return e && std::string(e) == "1";
}

// Greedy 64 tokens with an f16 cache on each golden prompt (llama.cpp: -c 1024, f16 K/V, FA on)
// must reproduce llama.cpp's tokens. A divergence at token i is accepted only as
//  - a near-tie (the rule): kvq's logit of llama.cpp's token is within 1e-3 of kvq's top
//    logit, on llama.cpp's prefix evaluated exactly as generation does (the prompt in one batch,
//    then one token at a time, so these are generation's own logits at step i); or
//  - Gemma 3 only, a fragile point (see Gemma3GreedyF16MatchesLlamaCpp): llama.cpp's own q8_0 or
//    q4_0 KV run of the prompt, or its own f16 run with one setting changed (`variants_path`,
//    tests/data/golden-derived/), has already left its f16 tokens at or before i, and llama.cpp's
//    token is among kvq's top 4 there, within 0.6 of kvq's top logit.
// The golden has no logits of its own, so kvq's logits are the evidence; every case is printed.
enum class tie_rule { strict, fragile };

void check_greedy_f16(const std::string& model_file, const std::string& golden_rel, tie_rule rule,
                      const std::string& variants_path = "") {
  KVQ_REQUIRE_MODEL(model_path, model_file);
  KVQ_REQUIRE_DATA(golden_path, golden_rel);
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto golden = read_json(golden_path);
  const nlohmann::json variants =  // llama.cpp's f16 runs with one setting changed (Gemma 3)
      variants_path.empty() ? nlohmann::json::object({{"runs", nlohmann::json::array()}}) : read_json(variants_path);
  auto run_of = [&](const std::string& id) -> const nlohmann::json* {
    for (const auto& run : golden["runs"])
      if (run["id"] == id) return &run;
    return nullptr;
  };
  int n_runs = 0;
  for (const auto& run : golden["runs"]) {
    const std::string id = run["id"];
    if (id.find("_f16_fa-on") == std::string::npos) continue;
    ++n_runs;
    const auto want_prompt = run["prompt_token_ids"].get<std::vector<int32_t>>();
    const auto want = run["generated_token_ids"].get<std::vector<int32_t>>();
    ASSERT_EQ(want.size(), 64u) << id;
    generate_params p;
    p.prompt = run["prompt"];
    p.n_predict = 64;
    p.n_ctx = 1024;
    p.n_threads = 2;
    p.sampling.temp = 0.0f;
    p.cache.type_k = p.cache.type_v = kv_cache_type::f16;
    const generate_result r = generate(*m, *tok, p);
    ASSERT_EQ(r.prompt_ids, want_prompt) << id;
    size_t i = 0;
    while (i < r.ids.size() && i < want.size() && r.ids[i] == want[i]) ++i;
    if (i == want.size()) {
      std::printf("[golden greedy] %s %s: 64/64 tokens identical\n", model_file.c_str(), id.c_str());
      continue;
    }
    ASSERT_LT(i, r.ids.size()) << id << ": kvq stopped (" << r.stop_reason << ") after " << r.ids.size() << " tokens";
    // Divergence at i: generation's logits at step i (prompt prefilled, then want[0..i) decoded).
    auto cache = make_kv_cache(m->cache_params(1024, p.cache));
    thread_pool pool(2);
    std::vector<float> logits(m->hparams().n_vocab);
    m->forward(want_prompt, 0, 0, *cache, pool, logits.data(), false);
    for (size_t j = 0; j < i; ++j)
      m->forward(std::span<const int32_t>(&want[j], 1), (int)(want_prompt.size() + j), 0, *cache, pool, logits.data(),
                 false);
    const int top = (int)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const double gap = (double)logits[r.ids[i]] - logits[want[i]];
    int rank = 1;  // of llama.cpp's token in kvq's logits
    for (float l : logits) rank += l > logits[want[i]];
    std::printf(
        "[golden greedy] %s %s: first divergence at token %zu: llama.cpp %d (kvq rank %d, logit %.6f), kvq %d "
        "(logit %.6f), gap %.2e\n",
        model_file.c_str(), id.c_str(), i, want[i], rank, logits[want[i]], r.ids[i], logits[r.ids[i]], gap);
    EXPECT_EQ(logits[top], logits[r.ids[i]]) << id << ": generation's step " << i << " is not reproduced";
    if (gap <= 1e-3) continue;  // near-tie
    ASSERT_EQ(rule, tie_rule::fragile) << id << ": divergence at token " << i << " is not a near-tie (gap " << gap
                                       << ")";
    const std::string prompt_id = id.substr(0, id.find('_'));
    size_t peer = want.size();  // where llama.cpp's own 8- or 4-bit KV run first leaves its f16 tokens
    for (const char* kv : {"_q8_0_fa-on", "_q4_0_fa-on"}) {
      const nlohmann::json* q = run_of(prompt_id + kv);
      ASSERT_NE(q, nullptr) << prompt_id << kv << " not in the golden";
      if (!(*q)["first_divergence_vs_f16_fa-on"].is_null())
        peer = std::min(peer, (*q)["first_divergence_vs_f16_fa-on"].get<size_t>());
    }
    // llama.cpp's f16 runs of this prompt with one setting changed
    for (const auto& v : variants.at("runs")) {
      if (v["prompt"] == run["prompt"] && v["change"] == "") {  // the golden's own command, re-run
        EXPECT_TRUE(v["first_divergence_vs_golden_f16"].is_null()) << variants_path << ": " << v["id"];
      }
      if (v["prompt"] != run["prompt"] || v["first_divergence_vs_golden_f16"].is_null()) continue;
      const auto at = v["first_divergence_vs_golden_f16"].get<size_t>();
      peer = std::min(peer, at);
      const auto ids = v["generated_token_ids"].get<std::vector<int32_t>>();
      std::printf("[golden greedy]   llama.cpp f16 with %s leaves its own tokens at %zu%s\n",
                  v["change"].get<std::string>().c_str(), at,
                  at == i && ids.at(i) == r.ids[i] ? ", choosing kvq's token" : "");
    }
    EXPECT_GE(i, peer) << id << ": kvq leaves llama.cpp's f16 tokens at " << i
                       << ", before llama.cpp's own runs (q8_0 / q4_0 KV, f16 with a setting changed) do (" << peer
                       << ")";
    EXPECT_LE(rank, 4) << id << ": llama.cpp's token is not among kvq's top 4 at the divergence";
    EXPECT_LE(gap, 0.6) << id << ": llama.cpp's token is " << gap << " below kvq's at the divergence";
  }
  EXPECT_EQ(n_runs, 3);
}

TEST(RealModels, Qwen25GreedyF16MatchesLlamaCpp) {
  check_greedy_f16(kQwenFile, "golden/qwen2.5-coder-0.5b-instruct-q4_k_m/generation.json", tie_rule::strict);
}

// Gemma 3 270M has near-ties that are not 1e-3 ties: llama.cpp's own q8_0 / q4_0 KV runs leave its
// f16 tokens at tokens 4 / 11, 0 / 0 and 22 / 22 of the three prompts. kvq (f16 cache, measured at
// 5f28e26) left them at 11, 0 and 22, with logit gaps 0.198, 0.124, 0.496 on llama.cpp's prefix
// (llama.cpp's token ranked 2, 4, 3 by kvq). A float64 forward of the same exact weights (numpy, no activation
// rounding) ranks the candidates there within 0.003-0.07 of each other (p2 token 0: 2268 20.095,
// 880 20.036, 1944 20.026, 3953 19.987; 880 / 1944 / 3953 are llama.cpp's q4_0 / f16 / q8_0
// choices) and picks kvq's token at p2 and p3; emulating llama.cpp's CPU numerics (8-bit activation
// blocks, fp16-table GELU, fp16 Q and V accumulation in flash attention) keeps kvq's choice at p1
// and p3 but moves the logit differences by up to 0.4. So the 1e-3 rule cannot hold on this
// model; the test asserts the fragile rule above instead. llama.cpp itself moves the same way: at
// the golden's commit, its f16 run with -fa off leaves its own golden tokens at -, 0, 22, with
// --no-repack at 4, 0, 22, with -b 1 -ub 1 at -, 15, 22 (-t 1 and -c 2048: all 64 identical;
// tests/data/golden-derived/gemma-3-270m-q4_k_m/generation_variants.json), and at p2 token 0 and p3
// token 22 it picks kvq's tokens there (2268, 24261). kvq at 9001908: 11 / 0 / 22, as at 5f28e26.
// How fragile: the weight products of every ISA tier are bit-identical (test_matmul), but the dense
// attention tiers differ from their scalar reference by rounding (about 1e-6 relative), and under
// KVQ_ISA=scalar this test leaves llama.cpp's tokens at 18, 0 and 22 with gaps 0.099, 0.082 and
// 0.945 (p3 over the 0.6 bound; Qwen2.5's p2 diverges at token 2, gap 0.013). The goldens are
// asserted on the default (SIMD) tiers, which kvq runs.
TEST(RealModels, Gemma3GreedyF16MatchesLlamaCpp) {
  check_greedy_f16(
      kGemmaFile, "golden/gemma-3-270m-q4_k_m/generation.json", tie_rule::fragile,
      std::string(KVQ_SOURCE_DIR) + "/tests/data/golden-derived/gemma-3-270m-q4_k_m/generation_variants.json");
}

struct ppl_run {
  perplexity_result r;
  nlohmann::json golden;  // the golden's f16_fa-on result
};

// The wikitext-2 test text, tokenized as kvq perplexity does.
std::vector<int32_t> wikitext_ids(const tokenizer& tok) {
  std::ifstream f(test::data_path("data/wikitext-2-raw-test/wiki.test.raw"), std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return perplexity_tokenize(tok, ss.str());
}

// wikitext-2 at -c 512 with an f16 cache, the first n_chunks chunks.
ppl_run run_ppl(const std::string& model_path, const std::string& golden_path, int n_chunks) {
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto ids = wikitext_ids(*tok);
  perplexity_params p;
  p.n_ctx = 512;
  p.n_chunks = n_chunks;
  p.n_threads = 2;
  ppl_run out;
  out.r = perplexity(*m, ids, perplexity_bos(*tok), p);
  const nlohmann::json golden = read_json(golden_path);
  for (const auto& res : golden.at("datasets").at("wikitext2").at("results"))
    if (res.at("config") == "f16_fa-on") out.golden = res;
  return out;
}

// kvq's running PPL after each of the first n chunks (kvq_running) against llama.cpp's (ref_running):
// each chunk's own PPL (from consecutive running values, as the golden derives it) within chunk_tol
// and each running PPL within running_tol (relative), asserted per chunk; returns the worst of each.
struct chunk_diff {
  double worst = 0, worst_running = 0;  // relative differences
  int worst_i = 0, over_1pct = 0;       // chunk of `worst`; chunks whose own PPL is over 1 % off
};
chunk_diff check_chunks(const std::vector<double>& kvq_running, const std::vector<double>& ref_running, int n,
                        double chunk_tol, double running_tol) {
  auto chunk_ppl = [](const std::vector<double>& run_ppl, int i) {  // chunk i's own PPL
    return i == 0 ? run_ppl[0] : std::exp((i + 1) * std::log(run_ppl[i]) - i * std::log(run_ppl[i - 1]));
  };
  chunk_diff d;
  for (int i = 0; i < n; ++i) {
    const double kvq = chunk_ppl(kvq_running, i), ref = chunk_ppl(ref_running, i);
    if (std::fabs(kvq / ref - 1) > d.worst) d.worst = std::fabs(kvq / ref - 1), d.worst_i = i;
    d.over_1pct += std::fabs(kvq / ref - 1) > 0.01;
    EXPECT_NEAR(kvq / ref, 1.0, chunk_tol) << "chunk " << i << ": kvq " << kvq << " llama.cpp " << ref;
    d.worst_running = std::max(d.worst_running, std::fabs(kvq_running[i] / ref_running[i] - 1));
    EXPECT_NEAR(kvq_running[i] / ref_running[i], 1.0, running_tol)
        << "running PPL after chunk " << i << ": kvq " << kvq_running[i] << " llama.cpp " << ref_running[i];
  }
  return d;
}

// Qwen2.5: the golden has llama.cpp's running PPL after each of its 40 chunks (4 decimals). After
// each chunk the running PPL within 1 % and that chunk's own PPL (from consecutive running values,
// as the golden derives it) within 1 %; the running PPL after the last chunk run within 0.2 %.
// Measured over all 40 chunks (docs/quality.md, "Qwen2.5's f16 PPL against llama.cpp, chunk by
// chunk"): running PPL at most 0.29 % from llama.cpp's (after chunk 6), a chunk's own PPL at most
// 0.90 % (chunk 34), final -0.14 %.
TEST(RealModels, Qwen25PerplexityMatchesLlamaCpp) {
  KVQ_REQUIRE_MODEL(model_path, kQwenFile);
  KVQ_REQUIRE_DATA(golden_path, "golden/qwen2.5-coder-0.5b-instruct-q4_k_m/perplexity.json");
  KVQ_REQUIRE_DATA(text_path, "data/wikitext-2-raw-test/wiki.test.raw");
  const int n_chunks = long_tests() ? 40 : 4;
  const ppl_run run = run_ppl(model_path, golden_path, n_chunks);
  ASSERT_FALSE(run.golden.is_null()) << "no f16_fa-on result in " << golden_path;
  const auto running = run.golden["ppl_running_per_chunk"].get<std::vector<double>>();
  ASSERT_EQ(running.size(), 40u);
  ASSERT_EQ(run.r.n_chunk, n_chunks);
  ASSERT_EQ((int)run.r.chunk_ppl.size(), n_chunks);
  EXPECT_EQ(run.r.ppl.n_scored, (int64_t)n_chunks * 255);
  const chunk_diff d = check_chunks(run.r.chunk_ppl, running, n_chunks, 0.01, 0.01);
  const double worst = d.worst, worst_running = d.worst_running;
  const double ref = running[n_chunks - 1];
  EXPECT_NEAR(run.r.ppl.ppl / ref, 1.0, 0.002)
      << "after " << n_chunks << " chunks: kvq " << run.r.ppl.ppl << " llama.cpp " << ref;
  std::printf(
      "[golden ppl] %s: %d chunks kvq %.4f llama.cpp %.4f (%+.3f %%), worst chunk %.3f %%, worst running "
      "%.3f %%\n",
      kQwenFile, n_chunks, run.r.ppl.ppl, ref, 100 * (run.r.ppl.ppl / ref - 1), 100 * worst, 100 * worst_running);
}

// No compressed format of 4 bits or more turns Qwen2.5 into garbage (issue 14: its K bias put
// per-token 4-bit K at mean KLD 0.81 and same-top-1 58 % before the default K channel scale, and
// llama.cpp's q4_0 at 1.59 / 50 %). One wikitext-2 chunk (-c 512, 255 scored tokens) against an
// f16 base written by the same build (top-128 KL). Measured on this chunk (mean KLD, same top-1):
// q8 0.0014 / 97.6 %, q8a 0.0012 / 98.4 %, q4 0.0373 / 91.0 %, q4a 0.0278 / 90.2 %, kivi4/q4
// 0.0145 / 92.2 %, kivi4/q4a with sink 4 0.0102 / 93.7 %. Bounds: 8-bit <= 0.005 and >= 95 %,
// 4-bit <= 0.08 and >= 85 % (about 2-3.5x the worst measured, ten times below garbage).
TEST(RealModels, Qwen25CompressedFormatsAreNotGarbage) {
  KVQ_REQUIRE_MODEL(model_path, kQwenFile);
  KVQ_REQUIRE_DATA(text_path, "data/wikitext-2-raw-test/wiki.test.raw");
  auto m = model::load(model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto ids = wikitext_ids(*tok);
  // per process: two test runs at once (two build trees) must not share the base file
  const std::string base = ::testing::TempDir() + "kvq_qwen_f16_base_" + std::to_string(::getpid()) + ".bin";
  perplexity_params p;
  p.n_ctx = 512;
  p.n_chunks = 1;
  p.n_threads = 2;
  p.kl_base_out = base;
  perplexity(*m, ids, perplexity_bos(*tok), p);
  p.kl_base_out.clear();
  p.kl_base_in = base;
  struct row {
    const char* k;
    const char* v;
    int sink;
    double max_kld, min_top1;
  };
  for (const row& r :
       {row{"q8", "q8", 0, 0.005, 95}, row{"q8a", "q8a", 0, 0.005, 95}, row{"q4", "q4", 0, 0.08, 85},
        row{"q4a", "q4a", 0, 0.08, 85}, row{"kivi4", "q4", 0, 0.08, 85}, row{"kivi4", "q4a", 4, 0.08, 85}}) {
    p.cache.type_k = parse_kv_cache_type(r.k);
    p.cache.type_v = parse_kv_cache_type(r.v, "V");
    p.cache.sink = r.sink;
    const perplexity_result res = perplexity(*m, ids, perplexity_bos(*tok), p);
    ASSERT_TRUE(res.has_kld);
    std::printf("[qwen quality] K %s / V %s sink %d: mean KLD %.4f, same top-1 %.1f %%, dPPL %+.2f %%\n", r.k, r.v,
                r.sink, res.kld.mean, res.kld.same_top1_pct, res.kld.dppl_pct);
    EXPECT_LE(res.kld.mean, r.max_kld) << r.k << "/" << r.v;
    EXPECT_GE(res.kld.same_top1_pct, r.min_top1) << r.k << "/" << r.v;
  }
  std::remove(base.c_str());
}

// Gemma 3: the golden keeps only llama.cpp's 20-chunk PPL, so its running PPL after each chunk comes
// from a re-run of the golden's command at the golden's llama.cpp commit, which reproduces the
// golden's 18.6787 +/- 0.82314 exactly (tests/data/golden-derived/gemma-3-270m-q4_k_m/, its README).
// Two builds of one correct engine differ here by more than the 0.2 % / 1 %: llama.cpp
// against itself at that commit (same command, one setting changed; the derived README's table):
// -t 1 and -b / -ub 128 change no bit, but -fa off moves single chunks by up to 1.02 %, --no-repack
// (the Q4_K weight products in another kernel) the 20-chunk PPL by -0.15 % and chunk 12 by -1.55 %,
// both together the 20-chunk PPL by -0.26 % and chunk 19 by -2.03 % (chunk rms 0.51-0.79 %, running
// PPL at most 0.95 % off, after chunk 0). Every weight product quantizes its activations to 8 bits
// (Q8_0 / Q8_K), so a last-bit difference upstream flips a few roundings, and the flips grow to
// 1-5 % relative differences in the activations within two layers (measured at 22ef2a4: fed
// llama.cpp's residual stream at each layer with its f16 roundings emulated, kvq's Q/K/V agree with
// llama.cpp's to 4e-8 in every layer). kvq at 9001908 lies inside that spread: 20-chunk PPL 18.6411
// (-0.20 %; -0.05 % against llama.cpp --no-repack), chunk rms 0.75 %, worst chunk -1.63 % (chunk 12),
// 6 of 20 chunks past 1 %, running PPL at most 0.61 % off (after chunk 0). Bounds (argued from that
// spread, not the 0.2 % / 1 %): each chunk's PPL within 2.5 %, the running PPL after each
// chunk within 1.5 %, after 20 chunks within 0.5 %. CI runs the first 4 chunks (worst chunk +1.04 %,
// chunk 2; running +0.33 % after 4), KVQ_LONG_TESTS=1 all 20. Model errors on the first 4 chunks
// (kvq 15.1149 at 22ef2a4): the global RoPE base 1e6 on the sliding layers gives 116.98 (+674 %),
// RMSNorm eps 1e-5 for 1e-6 +0.60 % (below these bounds: an error that small is under the noise
// floor of a PPL comparison between two engines on this model).
TEST(RealModels, Gemma3PerplexityMatchesLlamaCpp) {
  KVQ_REQUIRE_MODEL(model_path, kGemmaFile);
  KVQ_REQUIRE_DATA(golden_path, "golden/gemma-3-270m-q4_k_m/perplexity.json");
  KVQ_REQUIRE_DATA(text_path, "data/wikitext-2-raw-test/wiki.test.raw");
  const std::string derived_path =
      std::string(KVQ_SOURCE_DIR) + "/tests/data/golden-derived/gemma-3-270m-q4_k_m/perplexity_chunks.json";
  const nlohmann::json derived = read_json(derived_path);
  const nlohmann::json* peer = nullptr;  // llama.cpp's f16 run with the golden's command
  for (const auto& res : derived.at("results"))
    if (res.at("config") == "f16_fa-on") peer = &res;
  ASSERT_NE(peer, nullptr) << "no f16_fa-on result in " << derived_path;
  const auto running = (*peer)["ppl_running_per_chunk"].get<std::vector<double>>();
  ASSERT_EQ(running.size(), 20u) << derived_path;
  const int n_chunks = long_tests() ? 20 : 4;
  const ppl_run run = run_ppl(model_path, golden_path, n_chunks);
  ASSERT_FALSE(run.golden.is_null()) << "no f16_fa-on result in " << golden_path;
  // the derived file is the golden's run: same final PPL to the golden's 4 decimals
  ASSERT_NEAR(running.back(), run.golden["ppl"].get<double>(), 5e-5) << derived_path << " vs " << golden_path;
  ASSERT_EQ(run.r.n_chunk, n_chunks);
  ASSERT_EQ((int)run.r.chunk_ppl.size(), n_chunks);
  EXPECT_EQ(run.r.ppl.n_scored, (int64_t)n_chunks * 255);
  const chunk_diff d = check_chunks(run.r.chunk_ppl, running, n_chunks, 0.025, 0.015);
  const double worst = d.worst, worst_running = d.worst_running;
  const int worst_i = d.worst_i, over_1pct = d.over_1pct;
  const double ref = running[n_chunks - 1];
  if (n_chunks == 20) {
    EXPECT_NEAR(run.r.ppl.ppl / ref, 1.0, 0.005)
        << "after " << n_chunks << " chunks: kvq " << run.r.ppl.ppl << " llama.cpp " << ref;
  }
  std::printf(
      "[golden ppl] %s: %d chunks kvq %.4f llama.cpp %.4f (%+.3f %%), worst chunk %.3f %% (chunk %d), %d "
      "chunks past 1 %%, worst running %.3f %%\n",
      kGemmaFile, n_chunks, run.r.ppl.ppl, ref, 100 * (run.r.ppl.ppl / ref - 1), 100 * worst, worst_i, over_1pct,
      100 * worst_running);
}

}  // namespace
}  // namespace kvq
