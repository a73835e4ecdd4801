// The model runner's weight products at decode shapes (issue 19: the step's part that is not
// attention), side by side in one process: y [n][n_out] f32 = x [n][n_in] f16 . W^T, W [n_out][n_in]
// f16, as model_runner's gemm() calls it (cublasGemmEx, CUBLAS_GEMM_DEFAULT, f32 compute), beside
// every algorithm cuBLASLt's heuristic offers for the same product (up to --algos, timed one by one),
// kvq's own mk::gemm_skinny (what the runner uses for up to 16 rows), and a device-to-device copy of the same bytes as the bandwidth reference. Weights rotate over
// copies whose total exceeds --rotate-mib so that no product finds its W in the L2.
//
//   bench_cuda_gemm [--shape llama3.1-8b|qwen2.5-1.5b|qwen2.5-0.5b] [--rows 1,16] [--reps 30] [--algos 16]
//
// Prints per (product, rows): bytes of W, median microseconds and GB/s of W read for the default call,
// cuBLASLt's first heuristic choice and its fastest, and the copy rate. Exits 0 with a message when no
// GPU is present.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model_cuda/model_kernels.h"

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_cuda_gemm: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void ckb(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench_cuda_gemm: %s: cuBLAS status %d\n", what, (int)s);
    std::exit(1);
  }
}

struct product {
  const char* name;
  int n_out, n_in;
};

std::vector<product> shape_products(const std::string& s) {
  if (s == "llama3.1-8b")
    return {{"wqkv", 6144, 4096}, {"wo", 4096, 4096}, {"wgate_up", 28672, 4096}, {"wdown", 4096, 14336}, {"output", 128256, 4096}};
  if (s == "qwen2.5-1.5b")
    return {{"wqkv", 2048, 1536}, {"wo", 1536, 1536}, {"wgate_up", 17920, 1536}, {"wdown", 1536, 8960}, {"output", 151936, 1536}};
  if (s == "qwen2.5-0.5b")
    return {{"wqkv", 1152, 896}, {"wo", 896, 896}, {"wgate_up", 9728, 896}, {"wdown", 896, 4864}, {"output", 151936, 896}};
  std::fprintf(stderr, "bench_cuda_gemm: --shape '%s' is not llama3.1-8b, qwen2.5-1.5b or qwen2.5-0.5b\n", s.c_str());
  std::exit(2);
}

// median of reps timings (us) of fn(i) for i = 0, 1, ... (each rep one call, timed with events)
template <class F>
double median_us(int reps, cudaStream_t st, F fn) {
  cudaEvent_t a, b;
  ck(cudaEventCreate(&a), "cudaEventCreate");
  ck(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    ck(cudaEventRecord(a, st), "cudaEventRecord");
    fn(i);
    ck(cudaEventRecord(b, st), "cudaEventRecord");
    ck(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "llama3.1-8b", rows_s = "1,16";
  int reps = 30, n_algos = 16;
  size_t rotate_mib = 512;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_cuda_gemm: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shape") shape = next();
    else if (a == "--rows") rows_s = next();
    else if (a == "--reps") reps = std::atoi(next().c_str());
    else if (a == "--algos") n_algos = std::atoi(next().c_str());
    else if (a == "--rotate-mib") rotate_mib = (size_t)std::atoll(next().c_str());
    else {
      std::fprintf(stderr, "usage: bench_cuda_gemm [--shape S] [--rows 1,16] [--reps N] [--algos N] [--rotate-mib M]\n");
      return 2;
    }
  }
  if (reps < 1 || n_algos < 1) {
    std::fprintf(stderr, "bench_cuda_gemm: --reps and --algos must be >= 1\n");
    return 2;
  }
  std::vector<int> rows;
  for (size_t p = 0; p < rows_s.size();) {
    const size_t q = rows_s.find(',', p);
    const int r = std::atoi(rows_s.substr(p, q - p).c_str());
    if (r < 1) {
      std::fprintf(stderr, "bench_cuda_gemm: --rows '%s' must list integers >= 1\n", rows_s.c_str());
      return 2;
    }
    rows.push_back(r);
    if (q == std::string::npos) break;
    p = q + 1;
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("bench_cuda_gemm: no CUDA device; nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t st;
  ck(cudaStreamCreate(&st), "cudaStreamCreate");
  cublasHandle_t blas;
  ckb(cublasCreate(&blas), "cublasCreate");
  ckb(cublasSetStream(blas, st), "cublasSetStream");
  const size_t ws_bytes = size_t(32) << 20;  // as the runner's cuBLAS workspace
  void* ws = nullptr;
  ck(cudaMalloc(&ws, ws_bytes), "cudaMalloc");
  ckb(cublasSetWorkspace(blas, ws, ws_bytes), "cublasSetWorkspace");
  cublasLtHandle_t lt;
  ckb(cublasLtCreate(&lt), "cublasLtCreate");

  std::printf("%s, %d SMs; shape %s; median of %d reps; W rotated over >= %zu MiB\n", prop.name, prop.multiProcessorCount,
              shape.c_str(), reps, rotate_mib);
  std::printf("| product | rows | W MB | gemmEx us (GB/s) | Lt heuristic #0 us | Lt fastest us (GB/s) [index of %d] | gemm_skinny us (GB/s) | copy us (GB/s) |\n",
              n_algos);
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const product& pr : shape_products(shape)) {
    const size_t w_bytes = (size_t)pr.n_out * pr.n_in * 2;
    const int n_copies = (int)std::max<size_t>(2, (rotate_mib << 20) / w_bytes + 1);
    std::vector<void*> w(n_copies);
    for (auto& p : w) {
      ck(cudaMalloc(&p, w_bytes), "cudaMalloc W");
      ck(cudaMemset(p, 0x1c, w_bytes), "cudaMemset");  // f16 0x1c1c: a small finite value
    }
    void* cpy = nullptr;
    ck(cudaMalloc(&cpy, w_bytes), "cudaMalloc copy");
    const int max_rows = *std::max_element(rows.begin(), rows.end());
    void *x = nullptr, *y = nullptr;
    ck(cudaMalloc(&x, (size_t)max_rows * pr.n_in * 2), "cudaMalloc x");
    ck(cudaMemset(x, 0x1c, (size_t)max_rows * pr.n_in * 2), "cudaMemset");
    ck(cudaMalloc(&y, (size_t)max_rows * pr.n_out * 4), "cudaMalloc y");
    const double copy_us = median_us(reps, st, [&](int i) {
      ck(cudaMemcpyAsync(cpy, w[i % n_copies], w_bytes, cudaMemcpyDeviceToDevice, st), "cudaMemcpyAsync");
    });
    for (int n : rows) {
      const float alpha = 1.0f, beta = 0.0f;
      const double ex_us = median_us(reps, st, [&](int i) {
        ckb(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, pr.n_out, n, pr.n_in, &alpha, w[i % n_copies], CUDA_R_16F, pr.n_in,
                         x, CUDA_R_16F, pr.n_in, &beta, y, CUDA_R_32F, pr.n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      });
      // cuBLASLt: D [n_out x n] (column-major) = op(A) B, A = W stored n_in x n_out column-major (op T)
      cublasLtMatmulDesc_t desc;
      ckb(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
      const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
      ckb(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)), "desc TRANSA");
      ckb(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)), "desc TRANSB");
      cublasLtMatrixLayout_t la, lb, lc;
      ckb(cublasLtMatrixLayoutCreate(&la, CUDA_R_16F, pr.n_in, pr.n_out, pr.n_in), "layout A");
      ckb(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16F, pr.n_in, n, pr.n_in), "layout B");
      ckb(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, pr.n_out, n, pr.n_out), "layout C");
      cublasLtMatmulPreference_t pref;
      ckb(cublasLtMatmulPreferenceCreate(&pref), "pref");
      ckb(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)),
          "pref workspace");
      std::vector<cublasLtMatmulHeuristicResult_t> res(n_algos);
      int got = 0;
      ckb(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, n_algos, res.data(), &got), "heuristic");
      double first_us = -1, best_us = -1;
      int best_i = -1;
      for (int k = 0; k < got; ++k) {
        if (res[k].state != CUBLAS_STATUS_SUCCESS) continue;
        const double us = median_us(reps, st, [&](int i) {
          ckb(cublasLtMatmul(lt, desc, &alpha, w[i % n_copies], la, x, lb, &beta, y, lc, y, lc, &res[k].algo, ws, ws_bytes, st),
              "cublasLtMatmul");
        });
        if (k == 0) first_us = us;
        if (best_i < 0 || us < best_us) best_us = us, best_i = k;
      }
      double sk_us = -1;
      if (kvq::cuda::mk::gemm_skinny_supported(n, pr.n_out, pr.n_in, w[0], x))
        sk_us = median_us(reps, st, [&](int i) {
          kvq::cuda::mk::gemm_skinny(static_cast<const uint16_t*>(w[i % n_copies]), pr.n_out, pr.n_in,
                                     static_cast<const uint16_t*>(x), n, static_cast<float*>(y), st);
        });
      std::printf("| %s %dx%d | %d | %.1f | %.1f (%.0f) | %.1f | %.1f (%.0f) [%d of %d] | %.1f (%.0f) | %.1f (%.0f) |\n",
                  pr.name, pr.n_out, pr.n_in, n, w_bytes / 1e6, ex_us, w_bytes / ex_us / 1e3, first_us, best_us,
                  w_bytes / best_us / 1e3, best_i, got, sk_us, sk_us > 0 ? w_bytes / sk_us / 1e3 : 0.0, copy_us,
                  2.0 * w_bytes / copy_us / 1e3);
      std::fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(desc);
    }
    for (void* p : w) cudaFree(p);
    cudaFree(cpy);
    cudaFree(x);
    cudaFree(y);
  }
  std::printf("(copy GB/s counts the bytes read and written; the products' GB/s the bytes of W read)\n");
  cublasLtDestroy(lt);
  cublasDestroy(blas);
  cudaFree(ws);
  cudaStreamDestroy(st);
  return 0;
}
