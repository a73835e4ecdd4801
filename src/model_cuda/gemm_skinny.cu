// Weight products of decode steps on tensor cores (model_kernels.h, gemm_skinny). At 1-16 rows a
// product reads W once and does little else, so the kernel is built around W's bytes in flight:
// each warp streams 16-byte pieces of two (or R x two) weight rows into registers, no shared
// memory on the way, and feeds them to mma.sync m16n8k16 with the rows of x as the 8-column B
// operand. The MMA's k order is permuted so that a thread's 16 contiguous bytes of a W row are its
// A fragment for two k16 steps (the same permutation on x's side: the dot products are unchanged
// up to float summation order). Split-K over the warps of a block, summed in a fixed order.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "kvq/error.h"
#include "model_cuda/model_kernels.h"

namespace kvq::cuda::mk {

using detail::as_stream;
using detail::check_launch;

namespace {

#ifndef KVQ_SKINNY_ROW_TILES  // benchmark builds only: bench/cuda/bench_cuda_gemm.cu's variants
#define KVQ_SKINNY_ROW_TILES 2
#endif
#ifndef KVQ_SKINNY_UNROLL
#define KVQ_SKINNY_UNROLL 4
#endif
constexpr int kRowTiles = KVQ_SKINNY_ROW_TILES;  // 16-row tiles per warp (R)
constexpr int kUnroll = KVQ_SKINNY_UNROLL;  // 32-wide k blocks per batch; two batches in flight (double-buffered registers)
constexpr int kMaxSplit = 8;  // k slices of a row group (warps that share its rows)
constexpr int kMaxWarps = 8;  // warps per block: max(4, split)

struct u4 {
  uint32_t x, y, z, w;
};

// W is read once per product: past L1, no allocation there
__device__ __forceinline__ u4 ld_stream(const void* p) {
  u4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
// x is read by every block: cached
__device__ __forceinline__ u4 ld_cached(const void* p) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  return {v.x, v.y, v.z, v.w};
}

__device__ __forceinline__ void mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int NT>
struct batch {
  u4 a[kUnroll][kRowTiles][2];
  u4 b[kUnroll][NT];
};

// A block holds `groups` row groups of kRowTiles x 16 rows of W, each worked by `split` warps
// (warp w: group w / split, k slice w % split, [slice * k_per_warp, ...) of n_in). Lane (g = lane /
// 4, t = lane % 4) loads, per 32-wide k block at k0, W rows g and g + 8 of each tile and x rows g
// (and 8 + g) at k0 + 8 t, 16 bytes each. k16 step s in {0, 1} uses the words 2s, 2s + 1 of each:
// the MMA's logical columns 2t, 2t + 1, 2t + 8, 2t + 9 are the physical k0 + 8t + 4s + {0, 1, 2, 3},
// a bijection of the block's 32 columns shared by A and B. Batches of kUnroll k blocks: the next
// batch's loads are issued before the current batch's MMAs.
template <int NT>
__global__ void __launch_bounds__(32 * kMaxWarps) gemm_skinny_kernel(const __half* __restrict__ W,
                                                                     const __half* __restrict__ x, float* __restrict__ y,
                                                                     int n, int n_out, int n_in, int split, int groups,
                                                                     int k_per_warp) {
  extern __shared__ float part[];  // [warps][kRowTiles * NT * 4][32] when split > 1
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int group = warp / split, slice = warp % split;
  const int row0 = (blockIdx.x * groups + group) * (16 * kRowTiles);
  const int k_begin = slice * k_per_warp, k_end = min(n_in, k_begin + k_per_warp);

  const __half* wrow[kRowTiles][2];
  bool wok[kRowTiles][2];
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * r + g + 8 * h;
      wok[r][h] = row < n_out;
      wrow[r][h] = W + (int64_t)(wok[r][h] ? row : 0) * n_in + 8 * t;
    }
  const __half* xrow[NT];
  bool xok[NT];
#pragma unroll
  for (int c = 0; c < NT; ++c) {
    xok[c] = 8 * c + g < n;
    xrow[c] = x + (int64_t)(xok[c] ? 8 * c + g : 0) * n_in + 8 * t;
  }

  float acc[kRowTiles][NT][4] = {};
  const u4 zero = {0, 0, 0, 0};
  // k blocks [i, i + nk) of this warp's slice
  auto load = [&](int i, int nk, batch<NT>& bt) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u >= nk) break;
      const int k0 = k_begin + 32 * (i + u);
#pragma unroll
      for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) bt.a[u][r][h] = wok[r][h] ? ld_stream(wrow[r][h] + k0) : zero;
#pragma unroll
      for (int c = 0; c < NT; ++c) bt.b[u][c] = xok[c] ? ld_cached(xrow[c] + k0) : zero;
    }
  };
  auto compute = [&](int nk, const batch<NT>& bt) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u >= nk) break;
#pragma unroll
      for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
        for (int c = 0; c < NT; ++c) {
          const u4 &a0 = bt.a[u][r][0], &a1 = bt.a[u][r][1], &b = bt.b[u][c];
          mma16816(acc[r][c], a0.x, a1.x, a0.y, a1.y, b.x, b.y);  // s = 0
          mma16816(acc[r][c], a0.z, a1.z, a0.w, a1.w, b.z, b.w);  // s = 1
        }
    }
  };
  const int n_blocks = k_end > k_begin ? (k_end - k_begin) / 32 : 0;
  batch<NT> b0, b1;
  if (n_blocks > 0) load(0, min(kUnroll, n_blocks), b0);
  for (int i = 0; i < n_blocks;) {
    if (i + kUnroll < n_blocks) load(i + kUnroll, min(kUnroll, n_blocks - i - kUnroll), b1);
    compute(min(kUnroll, n_blocks - i), b0);
    i += kUnroll;
    if (i >= n_blocks) break;
    if (i + kUnroll < n_blocks) load(i + kUnroll, min(kUnroll, n_blocks - i - kUnroll), b0);
    compute(min(kUnroll, n_blocks - i), b1);
    i += kUnroll;
  }

  // C fragment: acc[r][c][i] is row 16 r + g + 8 (i / 2), column 8 c + 2 t + (i % 2)
  constexpr int kVals = kRowTiles * NT * 4;
  if (split == 1) {
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
      for (int c = 0; c < NT; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = row0 + 16 * r + g + 8 * (i / 2), col = 8 * c + 2 * t + (i % 2);
          if (row < n_out && col < n) y[(int64_t)col * n_out + row] = acc[r][c][i];
        }
    return;
  }
  // the slices' partial sums, added in slice order (the same bits for any n)
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[((size_t)warp * kVals + (r * NT + c) * 4 + i) * 32 + lane] = acc[r][c][i];
  __syncthreads();
  for (int e = threadIdx.x; e < groups * kVals * 32; e += blockDim.x) {
    const int gr = e / (kVals * 32), j = (e / 32) % kVals, l = e % 32;
    const float* p = part + ((size_t)gr * split * kVals + j) * 32 + l;
    float s = p[0];
    for (int w = 1; w < split; ++w) s += p[(size_t)w * kVals * 32];
    const int r = j / (NT * 4), c = (j / 4) % NT, i = j % 4;
    const int row = (blockIdx.x * groups + gr) * (16 * kRowTiles) + 16 * r + l / 4 + 8 * (i / 2),
              col = 8 * c + 2 * (l % 4) + (i % 2);
    if (row < n_out && col < n) y[(int64_t)col * n_out + row] = s;
  }
}

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 132;
    return std::max(1, v);
  }();
  return n;
}

}  // namespace

void gemm_skinny(const uint16_t* w, int64_t n_out, int64_t n_in, const uint16_t* x, int n, float* y, void* stream) {
  if (!gemm_skinny_supported(n, n_out, n_in, w, x))
    fail(errc::internal, "[cuda model] gemm_skinny: unsupported product (rows " + std::to_string(n) + ", n_out " +
                             std::to_string(n_out) + ", n_in " + std::to_string(n_in) + ")");
  // k slices per row group: enough warps for ~8 per SM, each slice at least 8 k blocks of 32, a power
  // of two; a function of the shape and the GPU only (never of n), so that a row's bits do not depend
  // on how many rows the product has
  const int64_t row_groups = (n_out + 16 * kRowTiles - 1) / (16 * kRowTiles), k_blocks = n_in / 32;
  const int64_t want = std::min<int64_t>({(int64_t)kMaxSplit, std::max<int64_t>(1, k_blocks / 8),
                                          std::max<int64_t>(1, (8 * (int64_t)sm_count() + row_groups - 1) / row_groups)});
  int split = 1;
  while (split * 2 <= want) split *= 2;
  const int k_per_warp = (int)(((k_blocks + split - 1) / split) * 32);
  const int groups = split >= 4 ? 1 : 4 / split, warps = split * groups;
  const int blocks = (int)((row_groups + groups - 1) / groups);
  const auto* W = reinterpret_cast<const __half*>(w);
  const auto* X = reinterpret_cast<const __half*>(x);
  const size_t smem = split > 1 ? (size_t)warps * kRowTiles * (n <= 8 ? 1 : 2) * 4 * 32 * sizeof(float) : 0;
  if (n <= 8)
    gemm_skinny_kernel<1><<<blocks, 32 * warps, smem, as_stream(stream)>>>(W, X, y, n, (int)n_out, (int)n_in, split,
                                                                          groups, k_per_warp);
  else
    gemm_skinny_kernel<2><<<blocks, 32 * warps, smem, as_stream(stream)>>>(W, X, y, n, (int)n_out, (int)n_in, split,
                                                                          groups, k_per_warp);
  check_launch("gemm_skinny");
}

}  // namespace kvq::cuda::mk
