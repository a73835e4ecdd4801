// Decode attention for one layer on CPU (issue: the compressed KV cache). head_dim 128, 32 query
// heads over 8 KV heads, 2 threads, context n_ctx in {1K, 4K, 16K, 64K}: f32, f16, q8, q4
// (hadamard) fused, kivi2 fused, and q4 dequantize-then-attend. Counter bytes_per_second: bytes of
// the cache read per second (bytes_used() of the layer); the copy_roofline benchmarks of the same
// binary give the memory roofline (bytes copied per second with 2 threads, and bytes read).
//   ./bench_attention --benchmark_counters_tabular=true   (KVQ_BENCH_THREADS=N: N threads instead of 2)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/thread_pool.h"

namespace {

constexpr int kHeadDim = 128, kHeads = 32, kKvHeads = 8;
const int kThreads = getenv("KVQ_BENCH_THREADS") ? atoi(getenv("KVQ_BENCH_THREADS")) : 2;

kvq::thread_pool& pool() {
  static kvq::thread_pool p(kThreads);
  return p;
}

struct fixture {
  std::unique_ptr<kvq::kv_cache> cache;
  std::vector<float> q, out;
};

// One cache per (type, impl, n_ctx), filled once with random K/V (appended in chunks of 4096).
fixture& get(const std::string& type, const std::string& impl, int n_ctx) {
  static std::map<std::string, std::unique_ptr<fixture>> all;
  const std::string key = type + "/" + impl + "/" + std::to_string(n_ctx);
  auto& f = all[key];
  if (f) return *f;
  if (all.size() > 1)  // keep at most the current cache alive (64K f32 is 512 MiB)
    for (auto& [k, v] : all)
      if (k != key) v.reset();
  f = std::make_unique<fixture>();
  kvq::kv_cache_params p;
  p.n_layer = 1;
  p.n_kv_head = kKvHeads;
  p.head_dim = kHeadDim;
  p.n_ctx = n_ctx;
  p.type_k = p.type_v = kvq::parse_kv_cache_type(type);
  p.attn = kvq::parse_attn_path(impl);
  f->cache = kvq::make_kv_cache(p);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int chunk = 4096;
  std::vector<float> k((size_t)chunk * kKvHeads * kHeadDim), v(k.size());
  for (int at = 0; at < n_ctx; at += chunk) {
    const int n = std::min(chunk, n_ctx - at);
    for (size_t i = 0; i < (size_t)n * kKvHeads * kHeadDim; ++i) {
      k[i] = nd(rng) + (i % kHeadDim == 7 ? 4.0f : 0.0f);
      v[i] = nd(rng);
    }
    f->cache->append(0, 0, n, k.data(), v.data());
  }
  f->q.resize((size_t)kHeads * kHeadDim);
  for (auto& x : f->q) x = nd(rng);
  f->out.resize(f->q.size());
  return *f;
}

void attend(benchmark::State& state, const std::string& type, const std::string& impl) {
  const int n_ctx = (int)state.range(0);
  fixture& f = get(type, impl, n_ctx);
  const float scale = 1.0f / std::sqrt((float)kHeadDim);
  for (auto _ : state) {
    f.cache->attend(0, 0, n_ctx - 1, 1, kHeads, f.q.data(), scale, f.out.data(), pool());
    benchmark::DoNotOptimize(f.out.data());
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter((double)f.cache->bytes_used(), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1024);
  state.counters["cache_MiB"] = (double)f.cache->bytes_used() / (1 << 20);
  state.SetLabel(f.cache->describe());
}

void BM_attend_f32(benchmark::State& s) { attend(s, "f32", "fused"); }
void BM_attend_f16(benchmark::State& s) { attend(s, "f16", "fused"); }
void BM_attend_q8_fused(benchmark::State& s) { attend(s, "q8", "fused"); }
void BM_attend_q4_fused(benchmark::State& s) { attend(s, "q4", "fused"); }
void BM_attend_kivi2_fused(benchmark::State& s) { attend(s, "kivi2", "fused"); }
void BM_attend_q4_dequantize_then_attend(benchmark::State& s) { attend(s, "q4", "dequant"); }

#define CTX_ARGS Arg(1 << 10)->Arg(1 << 12)->Arg(1 << 14)->Arg(1 << 16)->Unit(benchmark::kMicrosecond)->UseRealTime()
BENCHMARK(BM_attend_f32)->CTX_ARGS;
BENCHMARK(BM_attend_f16)->CTX_ARGS;
BENCHMARK(BM_attend_q8_fused)->CTX_ARGS;
BENCHMARK(BM_attend_q4_fused)->CTX_ARGS;
BENCHMARK(BM_attend_kivi2_fused)->CTX_ARGS;
BENCHMARK(BM_attend_q4_dequantize_then_attend)->CTX_ARGS;

// Memory roofline with the same pool: memcpy of a buffer split over the threads (bytes copied per
// second), and a streaming read (bytes read per second).
constexpr size_t kPiece = size_t{1} << 20;  // bytes per piece handed to a thread
void BM_copy_roofline(benchmark::State& state) {
  const size_t n = (size_t)state.range(0) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  for (auto _ : state) {
    // 1 MiB pieces through an atomic counter (run_on_all's contract: a late worker skips a call)
    std::atomic<size_t> next{0};
    pool().run_on_all([&](int, int) {
      for (size_t o = next.fetch_add(kPiece); o < n; o = next.fetch_add(kPiece))
        std::memcpy(b.data() + o, a.data() + o, std::min(kPiece, n - o));
    });
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter((double)n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}
void BM_read_roofline(benchmark::State& state) {
  const size_t n = (size_t)state.range(0) << 20;
  std::vector<uint64_t> a(n / 8, 3);
  uint64_t sums[64] = {};
  for (auto _ : state) {
    std::atomic<size_t> next{0};
    pool().run_on_all([&](int t, int) {
      uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (size_t o = next.fetch_add(kPiece / 8); o < a.size(); o = next.fetch_add(kPiece / 8)) {
        const size_t per = std::min(kPiece / 8, a.size() - o);
        const uint64_t* p = a.data() + o;
        for (size_t i = 0; i + 4 <= per; i += 4) {
          s0 += p[i];
          s1 += p[i + 1];
          s2 += p[i + 2];
          s3 += p[i + 3];
        }
      }
      sums[t] = s0 + s1 + s2 + s3;
    });
    benchmark::DoNotOptimize(sums);
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter((double)n, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}
BENCHMARK(BM_copy_roofline)->Arg(256)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_read_roofline)->Arg(256)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
