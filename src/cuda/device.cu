// Device discovery and memory helpers of the CUDA backend.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

namespace detail {
void check(cudaError_t e, const char* op) {
  if (e != cudaSuccess) fail(errc::internal, std::string("[cuda] ") + op + ": " + cudaGetErrorString(e));
}
bool pdl_on() {
  static const bool on = [] {
    const char* e = std::getenv("KVQ_CUDA_PDL");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
int64_t split_tokens_env() {
  static const int64_t v = [] {
    const char* e = std::getenv("KVQ_CUDA_DECODE_SPLIT");
    return e ? std::max<int64_t>(0, std::atoll(e)) : (int64_t)0;
  }();
  return v;
}
}  // namespace detail

using detail::check;

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

std::string device_name() {
  if (!available()) return "none (no CUDA device visible)";
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  int drv = 0;
  cudaDriverGetVersion(&drv);
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 20) + " MiB, driver API " +
         std::to_string(drv / 1000) + "." + std::to_string(drv % 1000 / 10) + ")";
}

void require() {
  if (!available())
    fail_unsupported("[cuda] no GPU visible (cudaGetDeviceCount failed or returned 0): the CUDA backend cannot run");
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
  return p;
}
void device_free(void* p) {
  if (p) check(cudaFree(p), "cudaFree");
}
void copy_to_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
void device_fill(void* dst, uint8_t byte, size_t bytes) { check(cudaMemset(dst, byte, bytes), "cudaMemset"); }
void synchronize() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
void memory_info(size_t* free_bytes, size_t* total_bytes) {
  check(cudaMemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
}

double copy_bandwidth(size_t bytes, int repeats) {
  if (bytes < (1u << 20) || repeats < 1)
    fail_input("[cuda copy_bandwidth] bytes " + std::to_string(bytes) + " must be >= 1 MiB and repeats " +
               std::to_string(repeats) + " >= 1");
  require();
  void *a = nullptr, *b = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  auto release = [&] {
    cudaFree(a);
    cudaFree(b);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
  };
  std::vector<float> ms;
  try {
    check(cudaMalloc(&a, bytes), "cudaMalloc");
    check(cudaMalloc(&b, bytes), "cudaMalloc");
    check(cudaMemset(a, 0x3c, bytes), "cudaMemset");  // not zeros (METHOD: never time on zeros)
    check(cudaEventCreate(&e0), "cudaEventCreate");
    check(cudaEventCreate(&e1), "cudaEventCreate");
    check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    for (int r = 0; r < repeats; ++r) {
      check(cudaEventRecord(e0), "cudaEventRecord");
      check(cudaMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
      check(cudaEventRecord(e1), "cudaEventRecord");
      check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
      ms.push_back(t);
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  std::sort(ms.begin(), ms.end());
  return 2.0 * (double)bytes / (ms[ms.size() / 2] * 1e-3);
}

}  // namespace kvq::cuda
