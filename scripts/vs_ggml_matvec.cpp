// Kernel-level comparison behind docs/perf.md "Weight products on the real models": one-thread
// matrix-vector products (activation quantization included) of kvq's matmul and of ggml's CPU
// vec_dot (llama.cpp's kernels) on the same random weights, timed in thread CPU time (robust to
// the load of a shared host), the two interleaved, median of 7 rounds of 20. Not built by CMake:
//   L=/path/to/llama.cpp   # cmake -B build -DGGML_NATIVE=ON; cmake --build build --target ggml-cpu
//   (on a CPU with AMX whose VM crashes in ggml's AMX kernels, configure as docs/perf.md says)
//   g++ -O2 -std=c++20 -I include -I src -I tests -I $L/ggml/include scripts/vs_ggml_matvec.cpp \
//       build/libkvq_core.a -L$L/build/bin -lggml-cpu -lggml-base -Wl,-rpath,$L/build/bin -lfmt \
//       -lpthread -o /tmp/vs_ggml && /tmp/vs_ggml
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>
#include "core/matmul_kernels.h"
#include "core/weight_types/traits.h"
#include "core/random_blocks.h"
#include "ggml.h"
#include "ggml-cpu.h"
using namespace kvq;
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main() {
  ggml_cpu_init();
  thread_pool pool(1);
  struct { kvq::ggml_type t; ::ggml_type gt; int64_t n_in, n_out; } cases[] = {
    {kvq::ggml_type::q5_0, GGML_TYPE_Q5_0, 896, 4864}, {kvq::ggml_type::q8_0, GGML_TYPE_Q8_0, 896, 151936 / 8},
    {kvq::ggml_type::q4_k, GGML_TYPE_Q4_K, 4864, 896}, {kvq::ggml_type::q6_k, GGML_TYPE_Q6_K, 4864, 896},
    // The same rows, 1/8 of them: the weights stay in L2 (compute rate rather than L3 bandwidth).
    {kvq::ggml_type::q5_0, GGML_TYPE_Q5_0, 896, 608}, {kvq::ggml_type::q8_0, GGML_TYPE_Q8_0, 896, 608},
    {kvq::ggml_type::q4_k, GGML_TYPE_Q4_K, 4864, 112}, {kvq::ggml_type::q6_k, GGML_TYPE_Q6_K, 4864, 112}};
  for (auto c : cases) {
    const weight_type_traits* tr = find_weight_traits(c.t);
    std::vector<uint8_t> w = test::random_blocks(c.t, c.n_in / tr->blk * c.n_out, 1, -8, -4);
    std::mt19937 rng(1);
    gguf_tensor_info ti{"w", c.t, {c.n_in, c.n_out}, 0, w.size(), w.data()};
    weight_view v = make_weight_view(ti);
    std::normal_distribution<float> g;
    std::vector<float> x(c.n_in), y(c.n_out), y2(c.n_out);
    for (auto& e : x) e = g(rng);
    const ggml_type_traits_cpu* gt = ggml_get_type_traits_cpu(c.gt);
    const size_t xq_bytes = ggml_row_size(gt->vec_dot_type, c.n_in);
    std::vector<uint8_t> xq(xq_bytes);
    const size_t rb = ggml_row_size(c.gt, c.n_in);
    auto run_ggml = [&] {
      ggml_get_type_traits_cpu(gt->vec_dot_type)->from_float(x.data(), xq.data(), c.n_in);
      for (int64_t r = 0; r < c.n_out; ++r) gt->vec_dot((int)c.n_in, &y2[r], 0, w.data() + r * rb, 0, xq.data(), 0, 1);
    };
    auto run_kvq = [&] { matmul(v, x.data(), 1, y.data(), pool); };
    std::vector<double> tk, tg;
    for (int round = 0; round < 7; ++round) {
      const int reps = 20;
      double t0 = cpu_s();
      for (int i = 0; i < reps; ++i) run_kvq();
      tk.push_back((cpu_s() - t0) / reps);
      t0 = cpu_s();
      for (int i = 0; i < reps; ++i) run_ggml();
      tg.push_back((cpu_s() - t0) / reps);
    }
    std::sort(tk.begin(), tk.end());
    std::sort(tg.begin(), tg.end());
    double maxd = 0, maxy = 0;
    for (int64_t r = 0; r < c.n_out; ++r) { maxd = std::max(maxd, (double)std::fabs(y[r] - y2[r])); maxy = std::max(maxy, (double)std::fabs(y2[r])); }
    std::printf("%-5s %5ldx%-6ld %6.1f MB  kvq %7.1f us (%5.1f GB/s)  ggml %7.1f us (%5.1f GB/s)  kvq/ggml speed %.2fx  max|dy| %.2g of max|y| %.2g\n",
                ggml_type_name(c.t), (long)c.n_in, (long)c.n_out, w.size() / 1e6, tk[3] * 1e6, w.size() / tk[3] / 1e9,
                tg[3] * 1e6, w.size() / tg[3] / 1e9, tg[3] / tk[3], maxd, maxy);
  }
}
