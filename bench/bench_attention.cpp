// Decode attention for one layer on CPU (issue: the compressed KV cache). head_dim 128, 32 query
// heads over 8 KV heads, 2 threads, context n_ctx in {1K, 4K, 16K, 64K}: f32, f16, q8, q4
// (hadamard) fused, kivi2 fused, and q4 dequantize-then-attend; f16 and q4 also paged (pages of 64
// tokens, kv_cache_params::page_size: the same outputs, views spanning pages gathered per thread).
// Counter bytes_per_second: bytes of the cache read per second (bytes_used() of the layer); the
// copy_roofline benchmarks of the same binary give the memory roofline (bytes copied per second with 2 threads, and bytes read).
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

#include "kvq/attention.h"
#include "kvq/cpu.h"
#include "kvq/f16.h"
#include "kvq/kv_cache.h"
#include "kvq/quant.h"
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
fixture& get(const std::string& type, const std::string& impl, int n_ctx, int page = 0) {
  static std::map<std::string, std::unique_ptr<fixture>> all;
  const std::string key = type + "/" + impl + "/" + std::to_string(n_ctx) + "/" + std::to_string(page);
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
  p.page_size = page;
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

void attend(benchmark::State& state, const std::string& type, const std::string& impl, int page = 0) {
  const int n_ctx = (int)state.range(0);
  fixture& f = get(type, impl, n_ctx, page);
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
void BM_attend_f16_paged64(benchmark::State& s) { attend(s, "f16", "fused", 64); }
void BM_attend_q4_fused_paged64(benchmark::State& s) { attend(s, "q4", "fused", 64); }

#define CTX_ARGS Arg(1 << 10)->Arg(1 << 12)->Arg(1 << 14)->Arg(1 << 16)->Unit(benchmark::kMicrosecond)->UseRealTime()
BENCHMARK(BM_attend_f32)->CTX_ARGS;
BENCHMARK(BM_attend_f16)->CTX_ARGS;
BENCHMARK(BM_attend_q8_fused)->CTX_ARGS;
BENCHMARK(BM_attend_q4_fused)->CTX_ARGS;
BENCHMARK(BM_attend_f16_paged64)->CTX_ARGS;
BENCHMARK(BM_attend_q4_fused_paged64)->CTX_ARGS;
BENCHMARK(BM_attend_kivi2_fused)->CTX_ARGS;
BENCHMARK(BM_attend_q4_dequantize_then_attend)->CTX_ARGS;

// The attention tier by head_dim (issue 15 item 6): the kernel alone, attn_quant (the best tier:
// the SIMD engine now takes head dims that are multiples of 16) against attn_quant_ref (the scalar
// tier those head dims ran before) on one kv head, 4096 keys, a decode query for each of its GQA 7
// query heads (Qwen2.5's 14 / 2), one thread. Args: head_dim, format (0 q4, 1 q8, 2 f16, 3 kivi4/q4a),
// tier (1 best, 0 scalar). Default groups (32, or head_dim when 32 does not divide it).
struct kernel_case {
  std::vector<uint8_t> kc, vc;
  std::vector<uint16_t> ks, vs;
  std::vector<float> q;
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  std::vector<float> qs, o;
  kvq::kv_quant_view kv;
  kvq::attn_query_view qv;
};
kernel_case make_kernel_case(int hd, int fmt) {
  using namespace kvq;
  constexpr int n = 4096, ng = 7;
  const kv_format fk[] = {kv_format::q4, kv_format::q8, kv_format::f16, kv_format::kivi4};
  const kv_format fv[] = {kv_format::q4, kv_format::q8, kv_format::f16, kv_format::q4a};
  const int group = hd % 32 == 0 ? 32 : hd;
  kernel_case c;
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x((size_t)n * hd);
  auto side = [&](kv_format f, std::vector<uint8_t>& codes, std::vector<uint16_t>& sc, kv_quant_side& s) {
    for (auto& e : x) e = nd(rng);
    const auto& t = kv_traits(f);
    s.format = f;
    if (t.layout == kv_layout::dense) {
      codes.resize((size_t)n * hd * 2);
      for (size_t i = 0; i < x.size(); ++i) reinterpret_cast<uint16_t*>(codes.data())[i] = f32_to_f16(x[i]);
      s.code_stride = hd * 2;
    } else if (t.layout == kv_layout::per_token) {
      const size_t row = kv_code_bytes(f, hd), nsc = kv_row_scale_count(f, hd, group);
      codes.resize(n * row);
      sc.resize(n * nsc);
      for (int j = 0; j < n; ++j) quantize_row_ref(f, &x[(size_t)j * hd], hd, group, &codes[j * row], &sc[j * nsc]);
      s.code_stride = (int64_t)row;
      s.scale_stride = (int64_t)nsc;
      s.group = group;
    } else {  // KIVI K: per channel over 32 tokens
      const size_t row = kv_code_bytes(f, hd);
      codes.resize(n * row);
      sc.resize((size_t)n / 32 * 2 * hd);
      for (int j = 0; j < n; j += 32)
        quantize_channel_group_ref(f, &x[(size_t)j * hd], 32, hd, &codes[j * row], &sc[(size_t)j / 32 * 2 * hd]);
      s.code_stride = (int64_t)row;
      s.scale_stride = 2 * hd;
      s.group = 32;
    }
    s.codes = codes.data();
    s.scales = sc.empty() ? nullptr : sc.data();
  };
  side(fk[fmt], c.kc, c.ks, c.kv.k);
  side(fv[fmt], c.vc, c.vs, c.kv.v);
  c.kv.n_pos = n;
  c.kv.head_dim = hd;
  c.q.resize((size_t)ng * hd);
  for (auto& e : c.q) e = nd(rng);
  c.qv.q = c.q.data();
  c.qv.n_tokens = 1;
  c.qv.n_group = ng;
  c.qv.head_dim = hd;
  c.qv.pos0 = n - 1;
  c.qv.spec.scale = 1.0f / std::sqrt((float)hd);
  if (kv_traits(fk[fmt]).layout == kv_layout::per_token) {  // the query the cache builds: per head
    c.qs.resize(ng);
    c.q8.resize(c.q.size());
    c.q16.resize(c.q.size());
    for (int g = 0; g < ng; ++g)
      c.qs[g] = kv_traits(fk[fmt]).bits == 8 ? quantize_q16_ref(&c.q[(size_t)g * hd], hd, &c.q16[(size_t)g * hd])
                                             : quantize_q8_ref(&c.q[(size_t)g * hd], hd, &c.q8[(size_t)g * hd]);
    if (kv_traits(fk[fmt]).bits == 8) c.qv.q16 = c.q16.data();
    else c.qv.q8 = c.q8.data();
    c.qv.q8_scale = c.qs.data();
  }
  c.o.resize((size_t)ng * hd);
  return c;
}
void BM_kernel_head_dim(benchmark::State& state) {
  const int hd = (int)state.range(0), fmt = (int)state.range(1);
  const bool best = state.range(2) != 0;
  kernel_case c = make_kernel_case(hd, fmt);
  std::vector<kvq::attn_state> st(7);
  for (auto _ : state) {
    for (int g = 0; g < 7; ++g) st[g] = kvq::attn_state::empty(&c.o[(size_t)g * hd], hd);
    if (c.kv.k.format == kvq::kv_format::f16) {
      kvq::kv_dense_view d;
      d.k = c.kc.data();
      d.v = c.vc.data();
      d.type_k = d.type_v = kvq::kv_elem::f16;
      d.row_stride = hd;
      d.n_pos = c.kv.n_pos;
      d.head_dim = hd;
      best ? kvq::attn_dense(d, c.qv, st.data()) : kvq::attn_dense_ref(d, c.qv, st.data());
    } else {
      best ? kvq::attn_quant(c.kv, c.qv, st.data()) : kvq::attn_quant_ref(c.kv, c.qv, st.data());
    }
    benchmark::DoNotOptimize(c.o.data());
  }
  const char* names[] = {"q4", "q8", "f16", "kivi4/q4a"};
  state.SetLabel(std::string(names[fmt]) + " hd " + std::to_string(hd) + " " +
                 (best ? kvq::isa_name(kvq::attn_quant_tier(c.kv)) : "scalar"));
}
BENCHMARK(BM_kernel_head_dim)
    ->ArgsProduct({{80, 112, 128}, {0, 1, 2, 3}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

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
