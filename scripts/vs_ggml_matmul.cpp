// Kernel-level comparison at M tokens (docs/perf.md, "Serving beside llama-server"): one-thread
// weight products of kvq's matmul and ggml's mul_mat (llama.cpp's CPU backend: llamafile's
// tinyBLAS for q5_0 / q8_0, its vec_dot tiles for the K-quants) on the same random weights and
// activations, timed in thread CPU time, the two interleaved, the best of 21 rounds of 3 (a shared
// host's load moves both; compare the ratio). Usage: vs_ggml_matmul [M=128]. Build as
// scripts/vs_ggml_matvec.cpp says (same flags, this file).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>
#include <cmath>
#include "core/matmul_kernels.h"
#include "core/weight_types/traits.h"
#include "core/random_blocks.h"
#include "ggml.h"
#include "ggml-cpu.h"
using namespace kvq;
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  ggml_cpu_init();
  thread_pool pool(1);
  const int M = argc > 1 ? atoi(argv[1]) : 128;
  struct { kvq::ggml_type t; ::ggml_type gt; int64_t n_in, n_out; } cases[] = {
    {kvq::ggml_type::q5_0, GGML_TYPE_Q5_0, 896, 4864}, {kvq::ggml_type::q8_0, GGML_TYPE_Q8_0, 896, 896},
    {kvq::ggml_type::q4_k, GGML_TYPE_Q4_K, 4864, 896}, {kvq::ggml_type::q6_k, GGML_TYPE_Q6_K, 4864, 896}};
  for (auto c : cases) {
    const weight_type_traits* tr = find_weight_traits(c.t);
    std::vector<uint8_t> w = test::random_blocks(c.t, c.n_in / tr->blk * c.n_out, 1, -8, -4);
    std::mt19937 rng(1);
    gguf_tensor_info ti{"w", c.t, {c.n_in, c.n_out}, 0, w.size(), w.data()};
    weight_view v = make_weight_view(ti);
    std::normal_distribution<float> g;
    std::vector<float> x((size_t)c.n_in * M), y((size_t)c.n_out * M);
    for (auto& e : x) e = g(rng);
    ggml_init_params ip{(size_t)512 << 20, nullptr, false};
    ggml_context* ctx = ggml_init(ip);
    ggml_tensor* gw = ggml_new_tensor_2d(ctx, c.gt, c.n_in, c.n_out);
    memcpy(gw->data, w.data(), w.size());
    ggml_tensor* gx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.n_in, M);
    memcpy(gx->data, x.data(), x.size() * 4);
    ggml_tensor* gy = ggml_mul_mat(ctx, gw, gx);
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, gy);
    auto run_ggml = [&] { ggml_graph_compute_with_ctx(ctx, gf, 1); };
    auto run_kvq = [&] { matmul(v, x.data(), M, y.data(), pool); };
    std::vector<double> tk, tg;
    for (int round = 0; round < 21; ++round) {
      const int reps = 3;
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
    const float* y2 = (const float*)gy->data;
    for (size_t r = 0; r < y.size(); ++r) { maxd = std::max(maxd, (double)std::fabs(y[r] - y2[r])); maxy = std::max(maxy, (double)std::fabs(y2[r])); }
    const double gmac = (double)c.n_in * c.n_out * M / 1e9;
    std::printf("%-5s %5ldx%-5ld M=%d  kvq %8.1f us (%5.1f GMAC/s)  ggml %8.1f us (%5.1f GMAC/s)  kvq/ggml speed %.2fx  max|dy| %.2g of %.2g\n",
                ggml_type_name(c.t), (long)c.n_in, (long)c.n_out, M, tk[0] * 1e6, gmac / tk[0], tg[0] * 1e6, gmac / tg[0],
                tg[0] / tk[0], maxd, maxy);
    ggml_free(ctx);
  }
}
