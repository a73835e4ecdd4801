// One server step of the real model on CPU (issue 16): what kvq's continuous-batching scheduler
// (src/server/scheduler.h) runs per step, timed per KV format side by side in one binary.
//
// BM_decode_step/FMT/S: one model::forward over a batch of S decode tokens, one from each of S
// sequences, on the server's cache layout (paged, 64-token pages, the CLI's auto exact windows and
// K channel scale: kv_auto_windows, default channel_calib). Every sequence holds a 128-token
// prompt when the timed steps start; a sequence decodes 64 steps (contexts 128..191, the
// bench_serving.py workload) and then every sequence is cleared and prefilled again untimed.
// BM_cache_step/FMT/S/P: the KV cache's share of that step alone, on the model's shapes (Qwen2.5-0.5B:
// 24 layers, 14 query / 2 kv heads, head_dim 64; no weights): per layer, every sequence's append of
// one token (random K / V) and one attend_batch of the S queries; contexts P..P+63 for prompts of
// P = 128 (as above: every position below the default channel_calib of 256, so the compressed
// caches still attend their exact f32 staging rows) and P = 1024 (the compressed store).
// BM_prompt/FMT/CHUNK: a lone 128-token prompt prefilled in steps of CHUNK tokens (the scheduler's
// --batch-tokens piece without decoding sequences), time per whole prompt.
// FMT: 0 f16, 1 q8, 2 q4. Median of repetitions, interleaved so that a noisy host falls on every
// format alike:
//   KVQ_BENCH_MODEL=models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf KVQ_BENCH_THREADS=2 \
//   ./bench_serving_step --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
//     --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/thread_pool.h"

namespace {

constexpr int kPrompt = 128, kGenerate = 64, kCtx = 512, kPage = 64;
const int kThreads = getenv("KVQ_BENCH_THREADS") ? atoi(getenv("KVQ_BENCH_THREADS")) : 2;
const char* const kTypes[] = {"f16", "q8", "q4"};

kvq::thread_pool& pool() {
  static kvq::thread_pool p(kThreads);
  return p;
}

kvq::model* get_model() {
  static std::unique_ptr<kvq::model> m = [] {
    const char* path = getenv("KVQ_BENCH_MODEL");
    try {
      return kvq::model::load(path ? path : "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    } catch (const std::exception&) {
      return std::unique_ptr<kvq::model>();
    }
  }();
  return m.get();
}

// The server's cache for n_seq sequences of format `type` (scheduler.cpp / tools/cli.h).
std::unique_ptr<kvq::kv_cache> make_cache(kvq::model& m, const std::string& type, int n_seq) {
  kvq::kv_cache_params o;
  o.type_k = o.type_v = kvq::parse_kv_cache_type(type);
  const kvq::kv_windows w = kvq::kv_auto_windows(o);
  o.sink = w.sink;
  o.exact_recent = w.exact_recent;
  kvq::kv_cache_params p = m.cache_params(kCtx, o, n_seq);
  p.page_size = kPage;
  return kvq::make_kv_cache(p);
}

int32_t token(int seq, int pos, int n_vocab) {  // pseudo-random ids, distinct per sequence
  uint64_t z = 0x9e3779b97f4a7c15ull * (uint64_t)(seq * 4096 + pos + 1);
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
  return (int32_t)((z ^ (z >> 29)) % (uint64_t)n_vocab);
}

void BM_decode_step(benchmark::State& state) {
  kvq::model* m = get_model();
  if (!m) return state.SkipWithError("set KVQ_BENCH_MODEL to a GGUF model (Qwen2.5-Coder-0.5B)");
  const std::string type = kTypes[state.range(0)];
  const int n_seq = (int)state.range(1), n_vocab = m->hparams().n_vocab;
  auto cache = make_cache(*m, type, n_seq);
  std::vector<float> logits((size_t)n_seq * n_vocab);
  std::vector<int32_t> toks(n_seq), pos(n_seq), seq(n_seq), prompt(kPrompt);
  std::vector<uint8_t> out(n_seq, 1);
  int step = kGenerate;  // steps done since the last prefill
  for (auto _ : state) {
    if (step == kGenerate) {
      state.PauseTiming();
      for (int s = 0; s < n_seq; ++s) {
        cache->clear(s);
        for (int t = 0; t < kPrompt; ++t) prompt[t] = token(s, t, n_vocab);
        m->forward(prompt, 0, s, *cache, pool(), logits.data(), false);
      }
      step = 0;
      state.ResumeTiming();
    }
    for (int s = 0; s < n_seq; ++s) {
      toks[s] = token(s, kPrompt + step, n_vocab);
      pos[s] = kPrompt + step;
      seq[s] = s;
    }
    m->forward(kvq::model_batch{toks, pos, seq, out}, *cache, pool(), logits.data());
    benchmark::DoNotOptimize(logits.data());
    ++step;
  }
  state.counters["tok_per_s"] = benchmark::Counter((double)n_seq, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(type + " x" + std::to_string(n_seq));
}

void BM_cache_step(benchmark::State& state) {
  constexpr int n_layer = 24, n_head = 14, n_kv_head = 2, hd = 64;
  const std::string type = kTypes[state.range(0)];
  const int n_seq = (int)state.range(1), n_prompt = (int)state.range(2);
  kvq::kv_cache_params o;
  o.type_k = o.type_v = kvq::parse_kv_cache_type(type);
  const kvq::kv_windows w = kvq::kv_auto_windows(o);
  o.sink = w.sink;
  o.exact_recent = w.exact_recent;
  o.n_layer = n_layer;
  o.n_kv_head = n_kv_head;
  o.head_dim = hd;
  o.n_ctx = std::max(kCtx, n_prompt + kGenerate);
  o.n_seq = n_seq;
  o.page_size = kPage;
  auto cache = kvq::make_kv_cache(o);
  const size_t row = (size_t)n_kv_head * hd, qrow = (size_t)n_head * hd;
  std::vector<float> k((size_t)n_prompt * row), v(k.size()), q((size_t)n_seq * qrow), out(q.size());
  uint64_t z = 88172645463325252ull;
  auto rnd = [&] {  // xorshift, uniform in [-1, 1) plus a K bias on channel 7 (Qwen-like)
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    return (float)((double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
  };
  auto fill = [&](int n) {
    for (size_t i = 0; i < (size_t)n * row; ++i) k[i] = rnd() + (i % hd == 7 ? 20.0f : 0.0f), v[i] = rnd();
  };
  for (auto& x : q) x = rnd();
  std::vector<kvq::attend_seq> seqs(n_seq);
  int step = kGenerate;
  for (auto _ : state) {
    if (step == kGenerate) {
      state.PauseTiming();
      for (int s = 0; s < n_seq; ++s) {
        cache->clear(s);
        for (int il = 0; il < n_layer; ++il) {
          fill(n_prompt);
          cache->append(il, s, n_prompt, k.data(), v.data());
        }
      }
      step = 0;
      state.ResumeTiming();
    }
    for (int il = 0; il < n_layer; ++il) {
      fill(n_seq);
      for (int s = 0; s < n_seq; ++s) {
        cache->append(il, s, 1, &k[(size_t)s * row], &v[(size_t)s * row]);
        seqs[s] = kvq::attend_seq{s, n_prompt + step, 1, &q[(size_t)s * qrow], &out[(size_t)s * qrow]};
      }
      cache->attend_batch(il, seqs.data(), n_seq, n_head, 0.125f, pool());
    }
    benchmark::DoNotOptimize(out.data());
    ++step;
  }
  state.SetLabel(type + " x" + std::to_string(n_seq) + " from " + std::to_string(n_prompt));
}

void BM_prompt(benchmark::State& state) {
  kvq::model* m = get_model();
  if (!m) return state.SkipWithError("set KVQ_BENCH_MODEL to a GGUF model (Qwen2.5-Coder-0.5B)");
  const std::string type = kTypes[state.range(0)];
  const int chunk = (int)state.range(1), n_vocab = m->hparams().n_vocab;
  auto cache = make_cache(*m, type, 1);
  std::vector<float> logits(n_vocab);
  std::vector<int32_t> prompt(kPrompt);
  for (int t = 0; t < kPrompt; ++t) prompt[t] = token(0, t, n_vocab);
  for (auto _ : state) {
    cache->clear(0);
    for (int p = 0; p < kPrompt; p += chunk) {
      const int n = std::min(chunk, kPrompt - p);
      m->forward(std::span<const int32_t>(prompt.data() + p, n), p, 0, *cache, pool(), logits.data(), false);
    }
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["tok_per_s"] = benchmark::Counter((double)kPrompt, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(type + " in " + std::to_string(chunk) + "-token steps");
}

BENCHMARK(BM_decode_step)->ArgsProduct({{0, 1, 2}, {1, 4, 16}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_cache_step)->ArgsProduct({{0, 1, 2}, {1, 4, 16}, {kPrompt, 1024}})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_prompt)->ArgsProduct({{0, 1, 2}, {32, 128}})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
