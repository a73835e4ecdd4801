// matmul micro-benchmarks: decode matvec (n_tokens = 1) reports weight bytes/s (the roofline is
// memory bandwidth for weights that do not fit in cache); prefill reports GFLOP/s, with OpenBLAS
// sgemm on the same (f32) weights as a yardstick when OpenBLAS is installed (KVQ_HAVE_OPENBLAS).
//   bench_matmul --benchmark_filter=matvec
#include <benchmark/benchmark.h>
#if KVQ_HAVE_OPENBLAS
#include <cblas.h>
#endif

#include <random>
#include <vector>

#include "core/matmul_kernels.h"
#include "kvq/f16.h"
#include "kvq/matmul.h"

namespace kvq {
namespace {

struct fixture {
  std::vector<uint8_t> bytes;
  weight_view w;
  std::vector<float> x, y;
};

fixture make(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_tokens) {
  fixture f;
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  const int64_t n = n_in * n_out;
  const int64_t bb = ggml_block_bytes(type), be = ggml_block_elems(type);
  f.bytes.resize(n / be * bb);
  if (type == ggml_type::f32) {
    auto* p = reinterpret_cast<float*>(f.bytes.data());
    for (int64_t i = 0; i < n; ++i) p[i] = g(rng);
  } else if (type == ggml_type::f16 || type == ggml_type::bf16) {
    auto* p = reinterpret_cast<uint16_t*>(f.bytes.data());
    for (int64_t i = 0; i < n; ++i) p[i] = type == ggml_type::f16 ? f32_to_f16(g(rng)) : f32_to_bf16(g(rng));
  } else {
    for (size_t i = 0; i < f.bytes.size(); ++i) f.bytes[i] = (uint8_t)rng();
    for (int64_t b = 0; b < n / 32; ++b) {
      const uint16_t d = f32_to_f16(0.01f);
      std::memcpy(&f.bytes[b * bb], &d, 2);
    }
  }
  gguf_tensor_info t{"bench", type, {n_in, n_out}, 0, f.bytes.size(), f.bytes.data()};
  f.w = make_weight_view(t);
  f.x.resize(n_in * n_tokens);
  for (auto& v : f.x) v = g(rng);
  f.y.resize(n_out * n_tokens);
  return f;
}

// args: n_in, n_out, n_tokens, threads, tier (0 scalar, 1 avx2)
void run(benchmark::State& st, ggml_type type) {
  const int64_t n_in = st.range(0), n_out = st.range(1), n_tok = st.range(2);
  const isa tier = st.range(4) ? isa::avx2 : isa::scalar;
  if (tier > best_isa()) {
    st.SkipWithError("tier not available");
    return;
  }
  thread_pool pool((int)st.range(3));
  fixture f = make(type, n_in, n_out, n_tok);
  for (auto _ : st) {
    detail::matmul_with_isa(tier, f.w, f.x.data(), n_tok, f.y.data(), pool);
    benchmark::DoNotOptimize(f.y.data());
  }
  const double bytes = (double)f.bytes.size(), flops = 2.0 * n_in * n_out * n_tok;
  st.counters["weight_GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void matvec_args(benchmark::internal::Benchmark* b) {
  for (auto [n_in, n_out] : {std::pair{64, 64}, {512, 512}, {512, 1408}, {1408, 512}, {4096, 4096}})
    for (int th : {1, 2}) b->Args({n_in, n_out, 1, th, 1});
  b->Args({512, 1408, 1, 1, 0});
  b->ArgNames({"n_in", "n_out", "tok", "thr", "avx2"})->UseRealTime();
}
void prefill_args(benchmark::internal::Benchmark* b) {
  for (int tok : {16, 128}) for (int th : {1, 2}) b->Args({512, 1408, tok, th, 1});
  b->ArgNames({"n_in", "n_out", "tok", "thr", "avx2"})->UseRealTime();
}

void matvec_f32(benchmark::State& s) { run(s, ggml_type::f32); }
void matvec_f16(benchmark::State& s) { run(s, ggml_type::f16); }
void matvec_bf16(benchmark::State& s) { run(s, ggml_type::bf16); }
void matvec_q8_0(benchmark::State& s) { run(s, ggml_type::q8_0); }
void matvec_q4_0(benchmark::State& s) { run(s, ggml_type::q4_0); }
BENCHMARK(matvec_f32)->Apply(matvec_args);
BENCHMARK(matvec_f16)->Apply(matvec_args);
BENCHMARK(matvec_bf16)->Apply(matvec_args);
BENCHMARK(matvec_q8_0)->Apply(matvec_args);
BENCHMARK(matvec_q4_0)->Apply(matvec_args);
void prefill_f32(benchmark::State& s) { run(s, ggml_type::f32); }
void prefill_f16(benchmark::State& s) { run(s, ggml_type::f16); }
void prefill_q8_0(benchmark::State& s) { run(s, ggml_type::q8_0); }
void prefill_q4_0(benchmark::State& s) { run(s, ggml_type::q4_0); }
BENCHMARK(prefill_f32)->Apply(prefill_args);
BENCHMARK(prefill_f16)->Apply(prefill_args);
BENCHMARK(prefill_q8_0)->Apply(prefill_args);
BENCHMARK(prefill_q4_0)->Apply(prefill_args);

#if KVQ_HAVE_OPENBLAS
// Yardstick: OpenBLAS sgemm y[tok, n_out] = x[tok, n_in] * W[n_out, n_in]^T on f32 weights
// (threads as OpenBLAS is configured: OPENBLAS_NUM_THREADS).
void prefill_openblas_sgemm(benchmark::State& st) {
  const int64_t n_in = st.range(0), n_out = st.range(1), n_tok = st.range(2);
  fixture f = make(ggml_type::f32, n_in, n_out, n_tok);
  for (auto _ : st) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n_tok, (int)n_out, (int)n_in, 1.0f,
                f.x.data(), (int)n_in, reinterpret_cast<const float*>(f.bytes.data()), (int)n_in, 0.0f,
                f.y.data(), (int)n_out);
    benchmark::DoNotOptimize(f.y.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(2e-9 * n_in * n_out * n_tok, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(prefill_openblas_sgemm)->Args({512, 1408, 16})->Args({512, 1408, 128})->Args({512, 1408, 1})->UseRealTime();
#endif

}  // namespace
}  // namespace kvq

BENCHMARK_MAIN();
