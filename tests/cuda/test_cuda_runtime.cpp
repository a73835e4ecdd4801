// kvq::generate and kvq::perplexity with compute_device::cuda (the library behind
// `kvq generate/perplexity --device cuda`) against the CPU engine on tinylit. Built when the
// runtime is (KVQ_TEST_RUNTIME: it needs the tokenizer); GPU cases skip without a GPU.
#if KVQ_TEST_RUNTIME
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "cuda_test_util.h"
#include "kvq/bench.h"
#include "kvq/bench_cuda.h"
#include "kvq/error.h"
#include "kvq/generate.h"
#include "kvq/perplexity.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

constexpr const char* kTinylit = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf";
constexpr const char* kHeldout = "data/tinylit-hd64-gqa4-heldout/heldout.txt";

generate_params greedy(compute_device d) {
  generate_params p;
  p.prompt = "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals";
  p.n_predict = 64;
  p.ignore_eos = true;
  p.sampling.temp = 0.0f;
  p.device = d;
  return p;
}

TEST(CudaRuntime, CudaWithoutGpuIsNotSupported) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is visible";
  KVQ_REQUIRE_DATA(mp, kTinylit);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  try {
    generate(*m, *tok, greedy(compute_device::cuda));
    FAIL() << "generate on cuda without a GPU";
  } catch (const error& e) { EXPECT_EQ(e.code(), errc::unsupported) << e.what(); }
}

TEST(CudaRuntime, GenerateGreedyMatchesCpu) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  const generate_result cpu = generate(*m, *tok, greedy(compute_device::cpu));
  const generate_result gpu = generate(*m, *tok, greedy(compute_device::cuda));
  std::printf("[ generate cuda ] %s; decode %.0f tok/s (cpu %.0f), prefill %.0f tok/s (cpu %.0f)\n",
              gpu.kv_describe.c_str(), gpu.decode_tokens_per_s, cpu.decode_tokens_per_s, gpu.prefill_tokens_per_s,
              cpu.prefill_tokens_per_s);
  EXPECT_EQ(gpu.prompt_ids, cpu.prompt_ids);
  EXPECT_EQ(gpu.ids, cpu.ids);
  EXPECT_EQ(gpu.text, cpu.text);
  EXPECT_EQ(gpu.ids.size(), 64u);
}

// PPL of 4 chunks of 256 tokens (508 scored): f16 within 1e-3 relative of the CPU engine (logits
// differ by f16 rounding, test_cuda_model.cpp); q4 within 2 % (codes flip on that rounding), and
// the KL base-file path: the GPU f16 run against the CPU f16 run's file.
TEST(CudaRuntime, PerplexityMatchesCpu) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  KVQ_REQUIRE_DATA(tp, kHeldout);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto ids = perplexity_tokenize(*tok, read_text_file(tp));
  const std::string base = testing::TempDir() + "/kvq_cuda_kl_base.bin";
  for (kv_cache_type t : {kv_cache_type::f16, kv_cache_type::q4}) {
    perplexity_params p;
    p.n_ctx = 256;
    p.n_chunks = 4;
    p.cache.type_k = p.cache.type_v = t;
    p.cache.k_channel_scale = false;
    if (t == kv_cache_type::f16) p.kl_base_out = base;
    const perplexity_result cpu = perplexity(*m, ids, perplexity_bos(*tok), p);
    p.device = compute_device::cuda;
    p.kl_base_out.clear();
    if (t == kv_cache_type::f16) p.kl_base_in = base;
    const perplexity_result gpu = perplexity(*m, ids, perplexity_bos(*tok), p);
    const double rel = std::fabs(gpu.ppl.ppl / cpu.ppl.ppl - 1);
    std::printf("[ perplexity %s ] cpu %.5f, cuda %.5f (rel %.2e), %lld scored; %s\n", kv_cache_type_name(t),
                cpu.ppl.ppl, gpu.ppl.ppl, rel, (long long)gpu.ppl.n_scored, gpu.kv_describe.c_str());
    EXPECT_EQ(gpu.ppl.n_scored, cpu.ppl.n_scored);
    EXPECT_LE(rel, t == kv_cache_type::f16 ? 1e-3 : 2e-2);
    if (t == kv_cache_type::f16) {
      ASSERT_TRUE(gpu.has_kld);
      std::printf("[ perplexity f16 ] KL(cpu || cuda) mean %.3e, max %.3e, same top-1 %.2f %%\n", gpu.kld.mean,
                  gpu.kld.max, gpu.kld.same_top1_pct);
      EXPECT_LE(gpu.kld.mean, 1e-5);
      EXPECT_GE(gpu.kld.same_top1_pct, 98.0);
    }
  }
  std::remove(base.c_str());
  perplexity_params bad;
  bad.n_ctx = 256;
  bad.device = compute_device::cuda;
  bad.compare_type = kv_cache_type::q8;
  try {
    perplexity_check(*m, bad);
    ADD_FAILURE() << "--compare accepted with --device cuda";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("--compare with --device cuda is not supported"), std::string::npos);
  }
}

// The KIVI cache (-ctk kivi4 -ctv q4a --kv-sink 4, the CPU's recommended 4-bit cache) through the
// perplexity runtime, as `kvq perplexity --device cuda` runs it: 4 chunks of 256 tokens, both engines
// against the CPU f16 run's KL base file. PPL within 2 % of the CPU engine with the same cache (the q4
// bound above: codes flip on the GPU's f16 rounding) and the GPU's KLD against f16 within 1.5x of the
// CPU's plus 1e-3 (it quantizes the same way; a wrong code path would show as a far larger KLD).
TEST(CudaRuntime, PerplexityKiviMatchesCpu) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  KVQ_REQUIRE_DATA(tp, kHeldout);
  auto m = model::load(mp);
  auto tok = tokenizer::from_gguf(m->gguf());
  const auto ids = perplexity_tokenize(*tok, read_text_file(tp));
  const std::string base = testing::TempDir() + "/kvq_cuda_kivi_kl_base.bin";
  perplexity_params p;
  p.n_ctx = 256;
  p.n_chunks = 4;
  p.cache.type_k = p.cache.type_v = kv_cache_type::f16;
  p.kl_base_out = base;
  perplexity(*m, ids, perplexity_bos(*tok), p);
  p.kl_base_out.clear();
  p.kl_base_in = base;
  p.cache.type_k = kv_cache_type::kivi4;
  p.cache.type_v = kv_cache_type::q4a;
  p.cache.sink = 4;
  const perplexity_result cpu = perplexity(*m, ids, perplexity_bos(*tok), p);
  p.device = compute_device::cuda;
  const perplexity_result gpu = perplexity(*m, ids, perplexity_bos(*tok), p);
  std::remove(base.c_str());
  const double rel = std::fabs(gpu.ppl.ppl / cpu.ppl.ppl - 1);
  std::printf("[ perplexity kivi4/q4a sink 4 ] cpu %.5f (KLD vs f16 %.3e), cuda %.5f (KLD %.3e), rel %.2e; %s\n",
              cpu.ppl.ppl, cpu.kld.mean, gpu.ppl.ppl, gpu.kld.mean, rel, gpu.kv_describe.c_str());
  ASSERT_TRUE(cpu.has_kld && gpu.has_kld);
  EXPECT_EQ(gpu.ppl.n_scored, cpu.ppl.n_scored);
  EXPECT_LE(rel, 2e-2);
  EXPECT_LE(gpu.kld.mean, 1.5 * cpu.kld.mean + 1e-3);
  EXPECT_NE(gpu.kv_describe.find("kivi4"), std::string::npos) << gpu.kv_describe;
}

// qwen2 on the GPU (q/k/v biases, NEOX RoPE, base 1e6, GQA 7, tied output) on the published
// Qwen2.5-0.5B shape with random weights (make_synthetic_model, 4 of its 24 layers): logits of a
// 48-token prefill and 16 decode steps against the CPU engine, f16 cache. f16 weights: the GPU
// differs by its f16 activations only; q4_0 weights: the CPU engine also quantizes its activations
// to q8_0 blocks (matmul.h), which the GPU's f16 products do not.
TEST(CudaRuntime, Qwen2ShapeMatchesCpu) {
  KVQ_REQUIRE_GPU();
  for (auto [wt, max_rel] : {std::pair{ggml_type::f16, 2e-3}, std::pair{ggml_type::q4_0, 3e-2}}) {
    auto m = make_synthetic_model(find_model_shape("qwen2.5-0.5b"), wt, 4, 19);
    const int V = m->hparams().n_vocab, n = 64, n_prefill = 48;
    ASSERT_TRUE(m->hparams().qkv_bias);
    std::mt19937 rng(5);
    std::vector<int32_t> ids(n);
    for (auto& t : ids) t = (int32_t)(rng() % V);
    kv_cache_params o;
    o.type_k = o.type_v = kv_cache_type::f16;
    const kv_cache_params cp = m->cache_params(128, o);
    auto cache = make_kv_cache(cp);
    thread_pool pool(0);
    cuda::model_runner r(*m, cp, n_prefill);
    std::vector<float> cpu((size_t)n * V), gpu((size_t)n * V);
    m->forward(std::span<const int32_t>(ids.data(), n_prefill), 0, 0, *cache, pool, cpu.data(), true);
    const std::vector<uint8_t> all(n_prefill, 1);
    r.forward(std::span<const int32_t>(ids.data(), n_prefill), 0, all, gpu.data());
    for (int t = n_prefill; t < n; ++t) {
      m->forward(std::span<const int32_t>(&ids[t], 1), t, 0, *cache, pool, &cpu[(size_t)t * V], false);
      r.forward(std::span<const int32_t>(&ids[t], 1), t, {}, &gpu[(size_t)t * V]);
    }
    double ss = 0, sr = 0, mx = 0;
    int same = 0;
    for (int t = 0; t < n; ++t) {
      const float* a = &gpu[(size_t)t * V];
      const float* b = &cpu[(size_t)t * V];
      double mean = 0;
      for (int i = 0; i < V; ++i) mean += b[i];
      mean /= V;
      for (int i = 0; i < V; ++i) {
        ss += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        sr += (b[i] - mean) * (b[i] - mean);
        mx = std::max(mx, std::fabs((double)a[i] - b[i]));
      }
      same += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
    }
    const double rel = std::sqrt(ss / sr);
    std::printf(
        "[ qwen2.5-0.5b shape, 4 layers, %s weights ] rel rms %.3e, max |dlogit| %.3e, argmax same %d/%d; "
        "GPU weights %.1f MB\n",
        ggml_type_name(wt), rel, mx, same, n, r.weight_bytes() / 1e6);
    EXPECT_LE(rel, max_rel);
    EXPECT_GE(same, n - 2);
  }
}

// kvq bench --device cuda's protocol on a small model of a published architecture (random weights):
// every row's bytes, bound and ratios follow from its fields, and the capacity rows hold as many
// sequences as fit in the memory left free for them.
TEST(CudaRuntime, BenchCudaRowsAreConsistent) {
  KVQ_REQUIRE_GPU();
  const model_shape shape{"tiny-qwen2", "qwen2", 2, 256, 4, 2, 64, 512, 1000, 32768, 1e6f, false};
  const model_hparams hp = shape_hparams(shape);
  bench_cuda_params p;
  for (kv_cache_type t : {kv_cache_type::f16, kv_cache_type::q4}) {
    kv_cache_params c;
    c.type_k = c.type_v = t;
    c.k_channel_scale = false;
    p.formats.push_back(c);
  }
  p.batches = {1, 3};
  p.depths = {0, 100};
  p.n_decode = 3;
  p.capacity_ctx = 65536;
  p.graphs = true;
  size_t free_b = 0, total_b = 0;
  cuda::memory_info(&free_b, &total_b);
  p.reserve_bytes = free_b - (size_t(512) << 20);  // about 512 MiB for the capacity rows' caches
  const bench_cuda_result r = bench_cuda(hp, nullptr, p);
  ASSERT_EQ(r.rows.size(), 2u * 2 * 2 + 2);
  EXPECT_GT(r.copy_bandwidth, 1e10);
  const size_t weights = (size_t)(2 * (256 * 512 + 256 * 256 + 2 * 512 * 256 + 512 * 256) + 1000 * 256) * 2 +
                         (size_t)(256 + 2 * (2 * 256 + 512)) * 4;  // f16 matrices but the table; f32 norms, biases
  for (const bench_cuda_row& w : r.rows) {
    const size_t page = w.type == "f16" ? (size_t)2 * 2 * 16 * 64 * 2 * 2 : 0;  // layers x heads x 16 x hd x K,V x 2 B
    EXPECT_EQ(w.weight_bytes_read, weights) << w.type;
    if (page) {
      EXPECT_EQ(w.kv_bytes_read, (size_t)w.batch * ((w.depth + 16) / 16) * page);
    }
    EXPECT_NEAR(w.bound_ms, (w.weight_bytes_read + w.kv_bytes_read) / r.copy_bandwidth * 1e3, 1e-9);
    EXPECT_NEAR(w.x_bound, w.step_ms_median / w.bound_ms, 1e-9);
    EXPECT_LE(w.step_ms_min, w.step_ms_median);
    EXPECT_LE(w.step_ms_median, w.step_ms_max);
    EXPECT_GT(w.graph_ms_median, 0.0);
    EXPECT_NEAR(w.graph_x_bound, w.graph_ms_median / w.bound_ms, 1e-9);
    EXPECT_NEAR(w.tokens_per_s, w.batch / (w.step_ms_median * 1e-3), 1e-6 * w.tokens_per_s);
    if (w.type == "f16") {
      EXPECT_DOUBLE_EQ(w.speedup_vs_f16, 1.0);
    }
    if (w.capacity) {
      // the pages of batch sequences of capacity_ctx (+ the timed steps) fit in ~512 MiB, one more would not
      const size_t per_seq = w.kv_bytes_allocated / w.batch;  // the pool: batch sequences of n_ctx positions
      EXPECT_GE(w.batch, 1);
      EXPECT_LE((size_t)w.batch * per_seq, size_t(600) << 20) << w.type;
      EXPECT_GT((size_t)(w.batch + 1) * per_seq, size_t(400) << 20) << w.type;
      std::printf("[ bench capacity %s ] %d sequences of 65536 in ~512 MiB\n", w.type.c_str(), w.batch);
    }
  }
}

}  // namespace
}  // namespace kvq
#endif  // KVQ_TEST_RUNTIME
