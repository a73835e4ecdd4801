// Device discovery and memory helpers of the CUDA backend.
#include <string>

#include "cuda/common.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

namespace detail {
void check(cudaError_t e, const char* op) {
  if (e != cudaSuccess) fail(errc::internal, std::string("[cuda] ") + op + ": " + cudaGetErrorString(e));
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

}  // namespace kvq::cuda
