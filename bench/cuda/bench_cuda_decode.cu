// Decode-attention benchmark of the CUDA backend (issue 5): one layer, head_dim 128, 32 query / 8 kv
// heads, batch x context grid; q4 fused vs the own f16 paged kernel vs dequantize-then-attend, the
// fused append of one token per sequence, bytes moved and GB/s against a measured device-to-device
// copy. Timing: CUDA graphs of n_copies independent caches (so small cases are not served from
// L2), events around replays, median of `reps` replays (docs/perf.md, "CUDA").
//   bench_cuda_decode [--batch 1,8,32] [--ctx 4096,32768,131072] [--reps 20] [--json out.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/cuda.h"
#include "kvq/f16.h"

using namespace kvq;
using namespace kvq::cuda;

namespace {

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  while (*s) {
    v.push_back(std::atoi(s));
    const char* c = std::strchr(s, ',');
    if (!c) break;
    s = c + 1;
  }
  return v;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time (ms) of one fn(copy) call, from graph replays over all copies.
template <class Fn>
float time_graph(Fn&& fn, int n_copies, int reps, cudaStream_t s, float* spread = nullptr) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  for (int c = 0; c < n_copies; ++c) fn(c, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / n_copies);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  if (spread) {
    std::sort(t.begin(), t.end());
    *spread = (t[t.size() * 9 / 10] - t[t.size() / 10]) / t[t.size() / 2];
  }
  return median(t);
}

__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {  // four 16-byte loads in flight per thread
    const uint4 x0 = a[i], x1 = a[i + stride], x2 = a[i + 2 * stride], x3 = a[i + 3 * stride];
    b[i] = x0;
    b[i + stride] = x1;
    b[i + 2 * stride] = x2;
    b[i + 3 * stride] = x3;
  }
  for (; i < n; i += stride) b[i] = a[i];
}

// Device-to-device copy bandwidth (bytes read + written per second) of a 4 GiB buffer: the best of
// a vectorised copy kernel and cudaMemcpyAsync (the roofline the kernels are held against).
double copy_bandwidth(cudaStream_t s, double* memcpy_bw) {
  const size_t n = size_t{4} << 30;
  void *a, *b;
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&b, n));
  CK(cudaMemset(a, 1, n));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float ms_k = 1e30f;
  for (int per_sm : {2, 4, 8, 16})  // best launch shape of the copy kernel
    ms_k = std::min(ms_k, time_graph([&](int, cudaStream_t st) {
                      copy_kernel<<<sms * per_sm, 256, 0, st>>>((const uint4*)a, (uint4*)b, n / 16);
                    }, 1, 10, s));
  const float ms_m = time_graph([&](int, cudaStream_t st) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st)); }, 1, 10, s);
  CK(cudaFree(a));
  CK(cudaFree(b));
  *memcpy_bw = 2.0 * n / (ms_m * 1e-3);
  return std::max(2.0 * n / (ms_k * 1e-3), *memcpy_bw);
}

struct result {
  int batch, ctx;
  double t_q4, t_f16, t_deq, t_app, spread_q4, spread_f16;
  double b_q4, b_f16, b_deq;
  double check_q4_vs_deq, check_f16;
  int items_q4, items_f16;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches = {1, 8, 32}, ctxs = {4096, 32768, 131072};
  int reps = 20;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--batch") && i + 1 < argc) batches = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--ctx") && i + 1 < argc) ctxs = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  if (!available()) {
    std::printf("no CUDA device: %s\n", device_name().c_str());
    return 0;
  }
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  std::printf("device: %s; CUDA runtime %d.%d\n", device_name().c_str(), rt / 1000, rt % 1000 / 10);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double memcpy_bw = 0;
  const double copy_bw = copy_bandwidth(s, &memcpy_bw);
  std::printf("device-to-device copy: %.0f GB/s (read + write; copy kernel, cudaMemcpyAsync %.0f GB/s)\n", copy_bw / 1e9,
              memcpy_bw / 1e9);

  const int hd = 128, nkv = 8, nh = 32, ps = 16;
  paged_kv_format f4;
  f4.format = kv_format::q4;
  f4.head_dim = hd;
  f4.n_kv_head = nkv;
  f4.page_size = ps;
  f4.rotation = rotation_kind::hadamard;
  paged_kv_format f16n = f4, f16h = f4;
  f16n.format = f16h.format = kv_format::f16;
  f16n.rotation = rotation_kind::none;
  const paged_kv_geometry g4 = paged_kv_geometry_of(f4), g16 = paged_kv_geometry_of(f16n);
  std::mt19937 rng(7);
  std::vector<result> results;

  for (int B : batches)
    for (int L : ctxs) {
      const int64_t ppseq = (L + ps - 1) / ps, ppc = ppseq * B;  // pages per sequence / per copy
      const double f16_bytes = (double)ppc * g16.page_bytes;
      const int n_copies = (int)std::clamp<double>(std::ceil(768e6 / f16_bytes), 1, 64);
      const int64_t n_pages = ppc * n_copies;
      std::printf("\n== batch %d, context %d: %d cache copies, q4 pool %.2f GB, f16 pool %.2f GB\n", B, L, n_copies,
                  n_pages * g4.page_bytes / 1e9, n_pages * g16.page_bytes / 1e9);
      uint8_t *pool4, *pool16;
      CK(cudaMalloc(&pool4, n_pages * g4.page_bytes));
      CK(cudaMalloc(&pool16, n_pages * g16.page_bytes));
      // page tables: copy c uses pages [c * ppc, (c + 1) * ppc), sequence-major
      std::vector<int32_t> indptr(B + 1), last(B, L - (int)(ppseq - 1) * ps), idx(n_pages);
      for (int b = 0; b <= B; ++b) indptr[b] = (int32_t)(b * ppseq);
      for (int64_t i = 0; i < n_pages; ++i) idx[i] = (int32_t)i;
      int32_t *d_indptr, *d_idx, *d_last;
      CK(cudaMalloc(&d_indptr, indptr.size() * 4));
      CK(cudaMalloc(&d_idx, idx.size() * 4));
      CK(cudaMalloc(&d_last, last.size() * 4));
      CK(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_last, last.data(), last.size() * 4, cudaMemcpyHostToDevice));
      auto view = [&](const paged_kv_format& f, uint8_t* pool, int c) {
        paged_kv_view v;
        v.format = f;
        v.pool = pool;
        v.n_pages = n_pages;
        v.indptr = d_indptr;
        v.indices = d_idx + (int64_t)c * ppc;
        v.last_page_len = d_last;
        v.batch = B;
        return v;
      };
      // fill copy 0 through the append kernel with random K/V (a 64K-token block, repeated)
      const int64_t ntok = (int64_t)B * L, blk = std::min<int64_t>(ntok, 65536);
      std::vector<uint16_t> hk(blk * nkv * hd), hv(blk * nkv * hd);
      std::normal_distribution<float> nd(0.f, 1.f);
      for (size_t i = 0; i < hk.size(); ++i) {
        hk[i] = f32_to_f16(nd(rng) * (i % hd == 3 ? 8.f : 1.f));
        hv[i] = f32_to_f16(nd(rng) * 0.5f);
      }
      uint16_t *dk, *dv;
      int64_t* dslots;
      CK(cudaMalloc(&dk, hk.size() * 2));
      CK(cudaMalloc(&dv, hv.size() * 2));
      CK(cudaMalloc(&dslots, blk * 8));
      CK(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
      std::vector<int64_t> slots(blk);
      for (int64_t t0 = 0; t0 < ntok; t0 += blk) {
        const int64_t n = std::min(blk, ntok - t0);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t tok = t0 + i, b = tok / L, j = tok % L;
          slots[i] = (int64_t)idx[b * ppseq + j / ps] * ps + j % ps;
        }
        CK(cudaMemcpy(dslots, slots.data(), n * 8, cudaMemcpyHostToDevice));
        append_paged(view(f4, pool4, 0), dk, dv, kv_elem::f16, dslots, (int)n, s);
      }
      dequantize_paged(view(f4, pool4, 0), view(f16h, pool16, 0), (int)ppc, s);
      CK(cudaStreamSynchronize(s));
      for (int c = 1; c < n_copies; ++c) {
        CK(cudaMemcpy(pool4 + c * ppc * g4.page_bytes, pool4, ppc * g4.page_bytes, cudaMemcpyDeviceToDevice));
        CK(cudaMemcpy(pool16 + c * ppc * g16.page_bytes, pool16, ppc * g16.page_bytes, cudaMemcpyDeviceToDevice));
      }
      // queries, outputs
      std::vector<uint16_t> hq((size_t)B * nh * hd);
      for (auto& x : hq) x = f32_to_f16(nd(rng));
      uint16_t* dq;
      float *out_a, *out_b;
      CK(cudaMalloc(&dq, hq.size() * 2));
      CK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&out_a, hq.size() * 4));
      CK(cudaMalloc(&out_b, hq.size() * 4));
      decode_params dp;
      dp.n_head = nh;
      dp.spec.scale = 1.0f / std::sqrt((float)hd);
      decode_plan p4(f4, dp, indptr.data(), last.data(), B), p16(f16n, dp, indptr.data(), last.data(), B),
          p16h(f16h, dp, indptr.data(), last.data(), B);
      // check: fused q4 vs dequantize-then-attend on the same codes (differ by the f16 rounding of V/K)
      p4.run(view(f4, pool4, 0), dq, out_a, nullptr, s);
      dequantize_paged(view(f4, pool4, 0), view(f16h, pool16, 0), (int)ppc, s);
      p16h.run(view(f16h, pool16, 0), dq, out_b, nullptr, s);
      CK(cudaStreamSynchronize(s));
      std::vector<float> ra(hq.size()), rb(hq.size());
      CK(cudaMemcpy(ra.data(), out_a, ra.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(rb.data(), out_b, rb.size() * 4, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (size_t i = 0; i < ra.size(); ++i) {
        num += (double)(ra[i] - rb[i]) * (ra[i] - rb[i]);
        den += (double)rb[i] * rb[i];
      }
      result r{};
      r.batch = B;
      r.ctx = L;
      r.check_q4_vs_deq = std::sqrt(num / den);
      r.items_q4 = p4.n_items();
      r.items_f16 = p16.n_items();
      float sp4 = 0, sp16 = 0;
      r.t_q4 = time_graph([&](int c, cudaStream_t st) { p4.run(view(f4, pool4, c), dq, out_a, nullptr, st); }, n_copies, reps, s, &sp4);
      r.t_f16 = time_graph([&](int c, cudaStream_t st) { p16.run(view(f16n, pool16, c), dq, out_b, nullptr, st); }, n_copies, reps, s, &sp16);
      r.t_deq = time_graph(
          [&](int c, cudaStream_t st) {
            dequantize_paged(view(f4, pool4, c), view(f16h, pool16, c), (int)ppc, st);
            p16h.run(view(f16h, pool16, c), dq, out_b, nullptr, st);
          },
          n_copies, reps, s);
      // append: one new token per sequence (K and V), overwriting each sequence's last slot
      std::vector<int64_t> aslots((size_t)B * n_copies);
      for (int c = 0; c < n_copies; ++c)
        for (int b = 0; b < B; ++b)
          aslots[(size_t)c * B + b] = (int64_t)idx[(int64_t)c * ppc + b * ppseq + (L - 1) / ps] * ps + (L - 1) % ps;
      int64_t* daslots;
      CK(cudaMalloc(&daslots, aslots.size() * 8));
      CK(cudaMemcpy(daslots, aslots.data(), aslots.size() * 8, cudaMemcpyHostToDevice));
      r.t_app = time_graph([&](int c, cudaStream_t st) { append_paged(view(f4, pool4, c), dk, dv, kv_elem::f16, daslots + (int64_t)c * B, B, st); },
                           n_copies, reps, s);
      r.spread_q4 = sp4;
      r.spread_f16 = sp16;
      const double tok = (double)B * L * nkv;
      r.b_q4 = tok * 2 * (g4.code_bytes + 2 * g4.n_scales);
      r.b_f16 = tok * 2 * g16.code_bytes;
      r.b_deq = r.b_q4 + 2 * r.b_f16;  // read q4, write f16, read f16
      std::printf("q4 fused %.1f us (%d items), f16 %.1f us (%d items), dequant+attend %.1f us, append %.2f us; "
                  "q4 vs dequant rel diff %.2e; spread q4 %.1f%% f16 %.1f%%\n",
                  r.t_q4 * 1e3, r.items_q4, r.t_f16 * 1e3, r.items_f16, r.t_deq * 1e3, r.t_app * 1e3, r.check_q4_vs_deq,
                  100 * sp4, 100 * sp16);
      results.push_back(r);
      CK(cudaFree(pool4));
      CK(cudaFree(pool16));
      CK(cudaFree(d_indptr));
      CK(cudaFree(d_idx));
      CK(cudaFree(d_last));
      CK(cudaFree(dk));
      CK(cudaFree(dv));
      CK(cudaFree(dslots));
      CK(cudaFree(daslots));
      CK(cudaFree(dq));
      CK(cudaFree(out_a));
      CK(cudaFree(out_b));
    }

  std::printf("\nDecode attention, one layer, head_dim 128, 32 q / 8 kv heads, page 16; copy roofline %.0f GB/s\n",
              copy_bw / 1e9);
  std::printf("| batch | ctx | q4 fused us | GB/s | %% copy | f16 own us | GB/s | %% copy | dequant+attend us | f16/q4 | deq/q4 | append us | append/q4 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : results)
    std::printf("| %d | %dK | %.1f | %.0f | %.0f%% | %.1f | %.0f | %.0f%% | %.1f | %.2fx | %.1fx | %.2f | %.1f%% |\n", r.batch,
                r.ctx / 1024, r.t_q4 * 1e3, r.b_q4 / (r.t_q4 * 1e-3) / 1e9, 100 * r.b_q4 / (r.t_q4 * 1e-3) / copy_bw,
                r.t_f16 * 1e3, r.b_f16 / (r.t_f16 * 1e-3) / 1e9, 100 * r.b_f16 / (r.t_f16 * 1e-3) / copy_bw, r.t_deq * 1e3,
                r.t_f16 / r.t_q4, r.t_deq / r.t_q4, r.t_app * 1e3, 100 * r.t_app / r.t_q4);
  if (json) {
    FILE* fp = std::fopen(json, "w");
    if (fp) {
      std::fprintf(fp, "{\"device\": \"%s\", \"driver\": %d, \"runtime\": %d, \"copy_gbps\": %.1f, \"results\": [\n",
                   device_name().c_str(), drv, rt, copy_bw / 1e9);
      for (size_t i = 0; i < results.size(); ++i) {
        const auto& r = results[i];
        std::fprintf(fp,
                     "  {\"batch\": %d, \"ctx\": %d, \"q4_us\": %.3f, \"f16_us\": %.3f, \"deq_us\": %.3f, \"append_us\": %.3f, "
                     "\"q4_bytes\": %.0f, \"f16_bytes\": %.0f, \"check\": %.3e}%s\n",
                     r.batch, r.ctx, r.t_q4 * 1e3, r.t_f16 * 1e3, r.t_deq * 1e3, r.t_app * 1e3, r.b_q4, r.b_f16,
                     r.check_q4_vs_deq, i + 1 < results.size() ? "," : "");
      }
      std::fprintf(fp, "]}\n");
      std::fclose(fp);
    }
  }
  return 0;
}
