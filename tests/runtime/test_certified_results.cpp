// perplexity(), generate() and bench() return the report of every certified cache they create
// (perplexity_result::certified, ...; certified.h): one per certified cache, in creation order,
// none for the others. The step counts are derived independently from the model's shape and the
// tokens each call runs through the model: a forward of T tokens adds T * n_layer * n_head steps.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/bench.h"
#include "kvq/certified.h"
#include "kvq/generate.h"
#include "kvq/perplexity.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

const char* kStories = "models/stories260K/stories260K.gguf";
const char* kTinyStories = "data/tinystories-val-794k/tinystories_val.txt";

void expect_consistent(const certified_report& r, uint64_t steps, const model_hparams& hp) {
  EXPECT_EQ(r.stats.steps, steps);
  EXPECT_EQ(r.stats.certified + r.stats.partial + r.stats.exact, steps);
  EXPECT_EQ(r.n_layer, hp.n_layer);
  EXPECT_EQ(r.n_kv_head, hp.n_kv_head);
  EXPECT_DOUBLE_EQ(r.host_bytes_per_token, (double)hp.n_layer * hp.n_kv_head * hp.head_dim * 2 * 2);
}

TEST(CertifiedResults, PerplexityReportsEachCertifiedCacheInCreationOrder) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kTinyStories);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  const std::vector<int32_t> ids = perplexity_tokenize(*tok, read_text_file(tp).substr(0, 4000));
  const model_hparams& hp = m->hparams();
  const int n_ctx = 32, chunks = 2;
  ASSERT_GE((int)ids.size(), n_ctx * chunks);
  perplexity_params p;
  p.n_ctx = n_ctx;
  p.n_chunks = chunks;
  p.n_threads = 1;
  p.cache.type_k = kv_cache_type::q8;
  p.cache.type_v = kv_cache_type::q4;
  p.cache.certify = true;
  p.cache.certify_tol = 1e-2;
  p.compare_type = kv_cache_type::certified;  // a second certified cache, made after the one under test
  const uint64_t steps = (uint64_t)chunks * n_ctx * hp.n_layer * hp.n_head;  // every chunk, all n_ctx tokens
  const perplexity_result r = perplexity(*m, ids, perplexity_bos(*tok), p);
  ASSERT_EQ(r.certified.size(), 2u);
  EXPECT_EQ(r.certified[0].type_k, "q8");
  EXPECT_EQ(r.certified[0].type_v, "q4");
  EXPECT_EQ(r.certified[0].describe, r.kv_describe);
  EXPECT_EQ(r.certified[1].type_k, "certified");
  for (const certified_report& c : r.certified) {
    expect_consistent(c, steps, hp);
    EXPECT_DOUBLE_EQ(c.tol, 1e-2);
    // taken after the last chunk: it holds n_ctx tokens in the host tier
    EXPECT_EQ((double)c.tiers.host_used, n_ctx * c.host_bytes_per_token);
  }

  p.cache = kv_cache_params{};
  p.cache.type_k = p.cache.type_v = kv_cache_type::q4;
  p.compare_type = kv_cache_type::f16;
  EXPECT_TRUE(perplexity(*m, ids, perplexity_bos(*tok), p).certified.empty());
}

TEST(CertifiedResults, GenerateReportsItsCertifiedCache) {
  KVQ_REQUIRE_DATA(mp, kStories);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  const model_hparams& hp = m->hparams();
  generate_params p;
  p.prompt = "Once upon a time";
  p.n_predict = 10;
  p.n_threads = 1;
  p.ignore_eos = true;
  p.sampling.temp = 0;
  p.cache.type_k = p.cache.type_v = kv_cache_type::certified;
  p.cache.certify_measure = true;
  const generate_result r = generate(*m, *tok, p);
  ASSERT_EQ(r.ids.size(), 10u);
  ASSERT_EQ(r.certified.size(), 1u);
  // the prompt, then every generated token but the last goes through the model
  const uint64_t tokens = r.prompt_ids.size() + r.ids.size() - 1;
  expect_consistent(r.certified[0], tokens * hp.n_layer * hp.n_head, hp);
  EXPECT_TRUE(r.certified[0].measure);
  EXPECT_EQ(r.certified[0].stats.violations, 0u);
  EXPECT_EQ((double)r.certified[0].tiers.host_used, tokens * r.certified[0].host_bytes_per_token);

  p.cache = kv_cache_params{};
  p.cache.type_k = p.cache.type_v = kv_cache_type::q8;
  EXPECT_TRUE(generate(*m, *tok, p).certified.empty());
}

TEST(CertifiedResults, BenchReportsOnePerCertifiedFormat) {
  KVQ_REQUIRE_DATA(mp, kStories);
  auto m = model::load(mp);
  const model_hparams& hp = m->hparams();
  bench_params p;
  kv_cache_params cert, q4, q8c;
  cert.type_k = cert.type_v = kv_cache_type::certified;
  q4.type_k = q4.type_v = kv_cache_type::q4;
  q8c.type_k = q8c.type_v = kv_cache_type::q8;
  q8c.certify = true;
  p.formats = {cert, q4, q8c};  // f16 is added as the baseline
  p.depths = {0, 24};
  p.n_decode = 2;
  p.n_prefill = 8;
  p.prefill_repeats = 1;
  p.n_threads = 1;
  const bench_result r = bench(*m, {}, p);
  ASSERT_EQ(r.certified.size(), 2u);  // q4 and the f16 baseline are not certified
  EXPECT_EQ(r.certified[0].type_k, "certified");
  EXPECT_EQ(r.certified[1].type_k, "q8");
  // bench.h's protocol (warm-up, untimed steps) may change; what must hold: whole tokens through
  // every layer and query head, at least the fill plus, at each depth, the prefill and decode steps
  const uint64_t per_token = (uint64_t)hp.n_layer * hp.n_head;
  for (const certified_report& c : r.certified) {
    EXPECT_EQ(c.stats.steps % per_token, 0u) << c.stats.steps;
    EXPECT_GE(c.stats.steps / per_token, 24u + 2 * (8 + 2));
    expect_consistent(c, c.stats.steps, hp);
  }
}

}  // namespace
}  // namespace kvq
