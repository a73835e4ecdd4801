// Continuous batching on the GPU (scheduler_params::device = cuda: prompt pieces through
// cuda::model_runner::forward, each step's decode tokens through one model_runner::decode) on
// tinylit: a greedy request returns the same tokens and logits bits alone as among 15 others, for
// f16 and q4 caches; the device's greedy ids equal the host's; cancelled requests give their pages
// back; --kv-budget sizes the runner's pool and admission waits for its pages; f16 replies equal
// the CPU scheduler's. Skipped without a GPU (and in builds without CUDA).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "kvq/cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "server/api.h"
#include "server/scheduler.h"
#include "support/data_dir.h"
#include "support/scheduler_jobs.h"

namespace kvq::server_detail {
namespace {

constexpr const char* kTinylit = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf";

#define KVQ_REQUIRE_GPU()        \
  if (!::kvq::cuda::available()) \
  GTEST_SKIP() << "no GPU visible (or kvq built without KVQ_BUILD_CUDA): " << ::kvq::cuda::device_name()

using test::wait_done;

// 16 prompts of different lengths; the last one spans several prefill chunks of 16 tokens (its text
// repeated until it holds more than min_last tokens).
std::vector<seq_request> requests16(const tokenizer& tok, int max_tokens, size_t min_last = 0) {
  std::vector<std::string> p = {"Once upon a time",
                                "The little dog",
                                "She looked at the sky and",
                                "Tom had a red ball.",
                                "One day, a girl named Lily",
                                "The sun was",
                                "In the forest there lived",
                                "Mom said",
                                "The cat and the bird were friends.",
                                "He ran to the",
                                "It was a cold winter day",
                                "Ben wanted to",
                                "The big tree",
                                "They played in the park",
                                "A small boat",
                                ""};
  p.back() =
      "Once upon a time, in a small town near the sea, there lived a boy who loved to build boats. Every "
      "morning he went down to the water and watched the fishermen. One day he decided that";
  const std::string long_text = p.back();
  while (tok.encode(p.back(), tok.add_bos_default(), true).size() <= min_last) p.back() += " " + long_text;
  std::vector<seq_request> reqs;
  for (const auto& s : p) {
    seq_request r;
    r.prompt = tok.encode(s, tok.add_bos_default(), true);
    r.max_tokens = max_tokens;
    r.sampling.temp = 0;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

scheduler_params gpu_params(const char* type) {
  scheduler_params sp;
  sp.device = compute_device::cuda;
  sp.n_ctx = 128;
  sp.n_parallel = 16;
  sp.n_batch = 16;
  sp.n_batch_tokens = 32;
  sp.cache.type_k = sp.cache.type_v = parse_kv_cache_type(type);
  return sp;
}

// Alone, then all 16 at once, then half of them joining while the first half decodes: the same ids
// and the same bits of every sampled logits row (record_logits). The GPU cuts prompts in whole
// n_batch chunks at fixed offsets (step_engine::split_free is false), so a prompt's forward calls
// are the same alone and together; each decode token runs in a decode() of 1 to 16 sequences.
// Then the same requests without record_logits take the device's greedy ids: the same ids.
// n_batch 16 (chunks below the tiled kernel's 64), 32, 64 (the tiled kernel); n_ctx 128, or 4 chunks.
// With q4 every position stays below the K channel scale's window (channel_calib 256 >= n_ctx):
// staged rows and staged_attention only.
// kivi4: K per-channel and V kivi4 (unrotated) in 32-token pages; its mixed steps run as decode()
// then forward(), its prompt chunks of >= 16 tokens in query tiles.
void check_batch_invariance(const char* type, int n_batch = 16) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(path, kTinylit);
  auto m = model::load(path);
  auto tok = tokenizer::from_gguf(m->gguf());
  scheduler_params sp = gpu_params(type);
  sp.n_batch = n_batch;
  sp.n_ctx = std::max(128, 4 * n_batch);
  sp.record_logits = true;
  const std::vector<seq_request> reqs = requests16(*tok, 8, 2 * (size_t)n_batch);
  ASSERT_GT(reqs.back().prompt.size(), 2u * sp.n_batch);
  std::vector<seq_update> alone;
  {
    scheduler s(*m, *tok, sp);
    for (const auto& r : reqs) alone.push_back(wait_done(*s.submit(r)));
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<std::shared_ptr<seq_job>> jobs;
      for (size_t i = 0; i < reqs.size(); ++i) {
        if (pass == 1 && i == reqs.size() / 2) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        jobs.push_back(s.submit(reqs[i]));
      }
      size_t same_rows = 0, rows = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        const seq_update u = wait_done(*jobs[i]);
        EXPECT_EQ(u.finish_reason, "length");
        EXPECT_EQ(u.ids, alone[i].ids) << type << " pass " << pass << " request " << i;
        EXPECT_EQ(u.logits_hash, alone[i].logits_hash) << type << " pass " << pass << " request " << i;
        for (size_t k = 0; k < std::min(u.logits_hash.size(), alone[i].logits_hash.size()); ++k)
          same_rows += u.logits_hash[k] == alone[i].logits_hash[k];
        rows += alone[i].logits_hash.size();
      }
      std::printf("[ gpu server %s -b %d pass %d ] %zu of %zu logits rows bit-identical to the request alone\n", type,
                  n_batch, pass, same_rows, rows);
    }
    const scheduler_metrics mt = s.metrics();
    EXPECT_EQ(mt.active, 0);
    EXPECT_EQ(mt.finished, 48u);
    EXPECT_EQ(mt.kv_bytes_used, 0u);
    EXPECT_EQ(mt.pages_in_use, 0);
    EXPECT_EQ(mt.page_size, std::string(type) == "kivi4" ? 32 : 16);
    EXPECT_FALSE(mt.prefix_reuse);
    EXPECT_GT(mt.batch_tokens, mt.steps * 4);  // the batched passes really were batched
  }
  // greedy ids from the device (no logits rows copied back for the decode tokens)
  sp.record_logits = false;
  sp.cuda_graphs = true;
  scheduler s(*m, *tok, sp);
  std::vector<std::shared_ptr<seq_job>> jobs;
  for (const auto& r : reqs) jobs.push_back(s.submit(r));
  for (size_t i = 0; i < reqs.size(); ++i)
    EXPECT_EQ(wait_done(*jobs[i]).ids, alone[i].ids) << type << " device argmax, CUDA graphs, request " << i;
}

TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchF16) { check_batch_invariance("f16"); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchQ4) { check_batch_invariance("q4"); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchF16Chunk32) { check_batch_invariance("f16", 32); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchQ4Chunk32) { check_batch_invariance("q4", 32); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchF16Chunk64) { check_batch_invariance("f16", 64); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchQ4Chunk64) { check_batch_invariance("q4", 64); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchKivi4) { check_batch_invariance("kivi4"); }
TEST(SchedulerCuda, GreedyTokensDoNotDependOnTheBatchKivi4Chunk32) { check_batch_invariance("kivi4", 32); }

// A cancelled request gives its pages back: four requests decoding (pages in use), cancelled
// while they run: no active sequence, no page in use, zero KV bytes in use.
TEST(SchedulerCuda, CancelFreesPages) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(path, kTinylit);
  auto m = model::load(path);
  auto tok = tokenizer::from_gguf(m->gguf());
  scheduler_params sp = gpu_params("q4");
  sp.n_ctx = 1024;
  sp.n_parallel = 4;
  scheduler s(*m, *tok, sp);
  std::vector<seq_request> reqs = requests16(*tok, -1);
  std::vector<std::shared_ptr<seq_job>> jobs;
  for (int i = 0; i < 4; ++i) jobs.push_back(s.submit(reqs[i]));
  for (auto& j : jobs)
    for (seq_update u; !u.done && u.n_generated < 2;) u = j->poll(std::chrono::milliseconds(1000));
  const scheduler_metrics busy = s.metrics();
  EXPECT_EQ(busy.active, 4);
  EXPECT_GE(busy.pages_in_use, 4);
  EXPECT_GT(busy.kv_bytes_used, 0u);
  for (auto& j : jobs) j->cancel();
  for (auto& j : jobs) EXPECT_EQ(wait_done(*j).finish_reason, "cancelled");
  const scheduler_metrics mt = s.metrics();
  EXPECT_EQ(mt.active, 0);
  EXPECT_EQ(mt.cancelled, 4u);
  EXPECT_EQ(mt.pages_in_use, 0);
  EXPECT_EQ(mt.kv_bytes_used, 0u);
}

// --kv-budget sizes the runner's pool: what the 3 slots keep outside it (q8: the K channel scale's
// staged rows and statistics, the exact sink rows) is paid first, then 8 pages of 16 tokens hold
// one sequence at n_ctx 128, so three requests of up to 40 positions (3 pages each) run two at a
// time at most and return what they return alone. The runner's device bytes (kv_bytes) are then
// within the budget. A budget below one sequence at n_ctx is refused at start-up (one below the
// outside bytes: the next test).
TEST(SchedulerCuda, KvBudgetSizesTheRunnersPool) {
  KVQ_REQUIRE_DATA(path, kTinylit);
  auto m = model::load(path);
  auto tok = tokenizer::from_gguf(m->gguf());
  scheduler_params sp = gpu_params("q8");
  sp.n_parallel = 3;
  kv_cache_params cp = m->cache_params(sp.n_ctx, sp.cache, sp.n_parallel);
  const size_t page_bytes = cuda::runner_page_bytes(m->hparams(), cp);
  const size_t outside = cuda::runner_fixed_kv_bytes(m->hparams(), cp, sp.gpu_step_rows());
  // staged K, V f32 rows of 128 positions (n_ctx < the default 256) + mu, lambda; the sink's K, V f16
  const model_hparams& hp = m->hparams();
  const size_t rows = (size_t)hp.n_layer * 3 * hp.n_kv_head * hp.head_dim;
  EXPECT_EQ(outside, rows * (2 * 128 + 2) * 4 + rows * 2 * cp.sink * 2);
  // (a budget of the outside bytes alone: KvBudgetBelowTheOutsideBytesIsRefused)
  KVQ_REQUIRE_GPU();
  sp.kv_budget_bytes = outside + 7 * page_bytes + page_bytes / 2;
  try {
    scheduler bad(*m, *tok, sp);
    ADD_FAILURE() << "no error for a budget of 7.5 pages beside the outside bytes";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 7 pages of 16 tokens (" + std::to_string(page_bytes) +
                                         " bytes each), fewer than the 8 one sequence at -c 128 needs"),
              std::string::npos)
        << e.what();
  }
  sp.kv_budget_bytes = outside + 8 * page_bytes;
  scheduler s(*m, *tok, sp);
  EXPECT_EQ(s.metrics().pages_total, 8);
  EXPECT_EQ(s.metrics().kv_bytes, sp.kv_budget_bytes);
  EXPECT_EQ(s.metrics().kv_budget_bytes, 8 * page_bytes);
  std::vector<seq_request> reqs = requests16(*tok, 30);
  reqs.resize(3);
  for (const auto& r : reqs) ASSERT_LE(r.prompt.size() + 30, 48u);
  ASSERT_EQ(reqs.size(), 3u);
  const test::alone_together r = test::run_alone_then_together(s, reqs, std::chrono::milliseconds(1));
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(r.together[i].ids, r.alone[i].ids) << "request " << i;
  EXPECT_LE(r.max_active, 2);
  EXPECT_LE(r.max_pages, 8);
  EXPECT_EQ(s.metrics().pages_in_use, 0);
}

// A --kv-budget that the slots' outside bytes would eat (q8: 3 slots' staged rows, statistics and
// sink rows; KIVI: their exact sink and residual rows) is an error at start-up that names both
// figures, on any machine: the budget is checked before the runner (and the GPU) is touched.
TEST(SchedulerCuda, KvBudgetBelowTheOutsideBytesIsRefused) {
  KVQ_REQUIRE_DATA(path, kTinylit);
  auto m = model::load(path);
  auto tok = tokenizer::from_gguf(m->gguf());
  for (const auto& [k, v] :
       {std::pair{kv_cache_type::q8, kv_cache_type::q8}, {kv_cache_type::kivi4, kv_cache_type::q4a}}) {
    scheduler_params sp = gpu_params("f16");
    sp.cache.type_k = k;
    sp.cache.type_v = v;
    sp.n_parallel = 3;
    kv_cache_params cp = m->cache_params(sp.n_ctx, sp.cache, sp.n_parallel);
    const size_t outside = cuda::runner_fixed_kv_bytes(m->hparams(), cp, sp.gpu_step_rows());
    EXPECT_GT(outside, 0u);
    sp.kv_budget_bytes = outside;
    try {
      scheduler bad(*m, *tok, sp);
      ADD_FAILURE() << "no error for a budget of " << outside << " bytes";
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find("slots keep outside the GPU page pool"), std::string::npos) << e.what();
    }
  }
}

// The GPU server against the CPU server (same requests, 16 at once, 8 greedy tokens each). f16:
// the same ids (the runner's f16 logits are within rel 1e-3 of the CPU engine's, and tinylit's
// greedy 64 tokens are identical: CudaModel.GreedyF16MatchesCpu). q4: the GPU-vs-CPU logits bound
// (rel 6e-2) allows argmax flips, so its agreement is printed, not asserted.
TEST(SchedulerCuda, MatchesCpuScheduler) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(path, kTinylit);
  auto m = model::load(path);
  auto tok = tokenizer::from_gguf(m->gguf());
  const std::vector<seq_request> reqs = requests16(*tok, 8);
  for (const char* type : {"f16", "q4"}) {
    std::vector<std::vector<int32_t>> ids[2];
    for (int dev = 0; dev < 2; ++dev) {
      scheduler_params sp = gpu_params(type);
      if (dev == 0) sp.device = compute_device::cpu, sp.n_threads = 4;
      scheduler s(*m, *tok, sp);
      std::vector<std::shared_ptr<seq_job>> jobs;
      for (const auto& r : reqs) jobs.push_back(s.submit(r));
      for (auto& j : jobs) ids[dev].push_back(wait_done(*j).ids);
    }
    int same_req = 0, same_tok = 0, toks = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      same_req += ids[0][i] == ids[1][i];
      for (size_t k = 0; k < ids[0][i].size() && k < ids[1][i].size(); ++k) {
        if (ids[0][i][k] != ids[1][i][k]) break;
        ++same_tok;
      }
      toks += (int)ids[0][i].size();
      if (std::string(type) == "f16") { EXPECT_EQ(ids[1][i], ids[0][i]) << "request " << i; }
    }
    std::printf("[ gpu vs cpu server %s ] %d of 16 replies identical, %d of %d tokens before the first difference\n",
                type, same_req, same_tok, toks);
  }
}

}  // namespace
}  // namespace kvq::server_detail
