// Kernels of the GPU model path (model_kernels.h). Simple one-block-per-row kernels: at decode they
// move a few KB per layer, far below the weight traffic of the products.
#include <algorithm>
#include <climits>

#include "cuda/common.cuh"
#include "kvq/error.h"
#include "model_cuda/model_kernels.h"

namespace kvq::cuda::mk {

using detail::as_stream;
using detail::check_launch;
using detail::launch_pdl;
using detail::pdl_enter;

namespace {

constexpr int kNormThreads = 256;

__global__ void embed_kernel(const int32_t* tokens, const __half* emb, int E, float* x) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int t = blockIdx.x;
  const __half* row = emb + (int64_t)tokens[t] * E;
  for (int i = threadIdx.x; i < E; i += blockDim.x) x[(int64_t)t * E + i] = __half2float(row[i]);
}

__global__ void add_rmsnorm_kernel(float* x, const float* add, const float* w, const int32_t* rows, int E, float eps,
                                   __half* h) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int r = blockIdx.x;
  const int64_t i0 = (int64_t)(rows ? rows[r] : r) * E;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < E; i += kNormThreads) {
    float v = x[i0 + i];
    if (add) {
      v += add[i0 + i];
      x[i0 + i] = v;
    }
    ss = fmaf(v, v, ss);
  }
  __shared__ float part[kNormThreads / 32];
  ss = detail::warp_sum(ss);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  float tot = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormThreads / 32; ++j) tot += part[j];
  const float scale = 1.0f / sqrtf(tot / (float)E + eps);
  for (int i = threadIdx.x; i < E; i += kNormThreads) h[(int64_t)r * E + i] = __float2half_rn(x[i0 + i] * scale * w[i]);
}

// grid (n, n_head + 2 * n_kv_head), block hd threads: one head of one token.
__global__ void qkv_rope_kernel(const float* qkv, const float* bias, const float* inv_freq, int n_rot, bool neox,
                                const int32_t* pos, int n_head, int n_kv_head, int hd, __half* q, __half* k,
                                __half* v, float* k32, float* v32) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int t = blockIdx.x, s = blockIdx.y, d = threadIdx.x;
  const int width = (n_head + 2 * n_kv_head) * hd;
  const int off = s * hd;  // Q heads, then K heads, then V heads
  const float* row = qkv + (int64_t)t * width + off;
  auto val = [&](int i) { return bias ? row[i] + bias[off + i] : row[i]; };
  float out = val(d);
  if (s < n_head + n_kv_head && d < n_rot) {
    const int half = n_rot / 2;
    const int i = neox ? (d < half ? d : d - half) : d / 2;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float theta = (float)pos[t] * inv_freq[i];
    const float c = cosf(theta), sn = sinf(theta);
    const float x0 = val(a), x1 = val(b);
    out = d == a ? x0 * c - x1 * sn : x0 * sn + x1 * c;
  }
  const __half o = __float2half_rn(out);
  if (s < n_head) {
    q[((int64_t)t * n_head + s) * hd + d] = o;
  } else if (s < n_head + n_kv_head) {
    const int64_t i = ((int64_t)t * n_kv_head + (s - n_head)) * hd + d;
    k[i] = o;
    if (k32) k32[i] = out;
  } else {
    const int64_t i = ((int64_t)t * n_kv_head + (s - n_head - n_kv_head)) * hd + d;
    v[i] = o;
    if (v32) v32[i] = out;
  }
}

// grid n, block 256: the rows of tokens at positions below n_stage into the staging rows.
__global__ void stage_rows_kernel(const float* k, const float* v, const int32_t* seq, const int32_t* pos, int n_stage,
                                  int dkv, float* sk, float* sv) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int t = blockIdx.x, p = pos[t];
  if (p >= n_stage) return;
  const int64_t dst = ((int64_t)seq[t] * n_stage + p) * dkv, src = (int64_t)t * dkv;
  for (int i = threadIdx.x; i < dkv; i += blockDim.x) {
    sk[dst + i] = k[src + i];
    sv[dst + i] = v[src + i];
  }
}

constexpr int kStagedThreads = 128;
constexpr int kStagedTileFloats = 8192;  // one tile of K or V rows in shared memory (32 KB)
constexpr int kStagedRowsPerWarp = 4;    // score rows a warp computes at once (independent reductions)

// tile[0, rows * hd) = the rows [0, rows) of src (row r at src + r * dkv), float4 by all threads.
__device__ __forceinline__ void load_staged_rows(float* tile, const float* src, int rows, int hd, int64_t dkv) {
  const int v4 = hd / 4;  // head_dim is a multiple of 16, dkv too (16-byte aligned rows)
  for (int i = threadIdx.x; i < rows * v4; i += kStagedThreads) {
    const int r = i / v4, c4 = i - r * v4;
    reinterpret_cast<float4*>(tile)[i] = *reinterpret_cast<const float4*>(src + r * dkv + 4 * c4);
  }
}

// grid (n, n_head), block kStagedThreads: query head hh of token t (position p < n_stage) over the
// staging rows [0, p] of its sequence, in f32 (scores, softmax, P.V), as attn_dense. The rows pass
// through shared memory in tiles of tile_rows (all their loads in flight at once; reading them
// row by row from global memory left each block waiting on one load per row); every score and
// every output takes the same operations in the same order as reading them directly (a score: lane
// l's fmaf chain over channels l, l + 32, ..., then warp_sum; an output channel: one fmaf chain over
// j = 0 .. p), so the result does not depend on the tiling.
__global__ void staged_attention_kernel(const __half* q, const float* sk, const float* sv, const int32_t* seq,
                                        const int32_t* pos, int n_stage, int n_head, int n_kv_head, int hd,
                                        int tile_rows, float scale, __half* out) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  extern __shared__ float4 sm4[];  // [tile_rows][hd] K or V rows, [hd] query, [32] reductions, [n_stage] scores
  const int t = blockIdx.x, hh = blockIdx.y, p = pos[t];
  if (p >= n_stage) return;
  float* tile = reinterpret_cast<float*>(sm4);
  float* qf = tile + tile_rows * hd;
  float* red = qf + hd;
  float* sc = red + 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = kStagedThreads / 32;
  const int kvh = hh / (n_head / n_kv_head), len = p + 1;
  const int64_t dkv = (int64_t)n_kv_head * hd;
  const int64_t row0 = (int64_t)seq[t] * n_stage * dkv + (int64_t)kvh * hd;
  for (int c = threadIdx.x; c < hd; c += kStagedThreads)
    qf[c] = __half2float(q[((int64_t)t * n_head + hh) * hd + c]);
  for (int j0 = 0; j0 < len; j0 += tile_rows) {
    const int rows = min(tile_rows, len - j0);
    if (j0 > 0) __syncthreads();  // the previous tile's scores are done
    load_staged_rows(tile, sk + row0 + j0 * dkv, rows, hd, dkv);
    __syncthreads();
    // warp w: rows w, w + nw, ... of the tile, kStagedRowsPerWarp at a time
    for (int jb = warp; jb < rows; jb += nw * kStagedRowsPerWarp) {
      float dot[kStagedRowsPerWarp];
#pragma unroll
      for (int u = 0; u < kStagedRowsPerWarp; ++u) {
        const float* kr = tile + min(jb + u * nw, rows - 1) * hd;  // (a row past the tile: computed, not kept)
        dot[u] = 0.0f;
        for (int c = lane; c < hd; c += 32) dot[u] = fmaf(qf[c], kr[c], dot[u]);
      }
#pragma unroll
      for (int u = 0; u < kStagedRowsPerWarp; ++u) dot[u] = detail::warp_sum(dot[u]);
      if (lane == 0) {
#pragma unroll
        for (int u = 0; u < kStagedRowsPerWarp; ++u)
          if (jb + u * nw < rows) sc[j0 + jb + u * nw] = dot[u] * scale;
      }
    }
  }
  __syncthreads();
  float m = -INFINITY;
  for (int j = threadIdx.x; j < len; j += kStagedThreads) m = fmaxf(m, sc[j]);
  m = detail::warp_max(m);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < nw; ++w) m = fmaxf(m, red[w]);
  float d = 0.0f;
  for (int j = threadIdx.x; j < len; j += kStagedThreads) {
    const float e = expf(sc[j] - m);
    sc[j] = e;
    d += e;
  }
  d = detail::warp_sum(d);
  __syncthreads();  // everyone has read red[] as maxima
  if (lane == 0) red[warp] = d;
  __syncthreads();
  d = 0.0f;
  for (int w = 0; w < nw; ++w) d += red[w];
  const float inv = 1.0f / d;
  // P.V: thread c owns output channels c and c + kStagedThreads (head_dim <= 2 * kStagedThreads)
  const int c0 = threadIdx.x, c1 = threadIdx.x + kStagedThreads;
  float o0 = 0.0f, o1 = 0.0f;
  for (int j0 = 0; j0 < len; j0 += tile_rows) {
    const int rows = min(tile_rows, len - j0);
    __syncthreads();  // the tile's previous rows (K, or the last V tile) are read
    load_staged_rows(tile, sv + row0 + j0 * dkv, rows, hd, dkv);
    __syncthreads();
    if (c0 < hd)
      for (int j = 0; j < rows; ++j) o0 = fmaf(sc[j0 + j], tile[j * hd + c0], o0);
    if (c1 < hd)
      for (int j = 0; j < rows; ++j) o1 = fmaf(sc[j0 + j], tile[j * hd + c1], o1);
  }
  if (c0 < hd) out[((int64_t)t * n_head + hh) * hd + c0] = __float2half_rn(o0 * inv);
  if (c1 < hd) out[((int64_t)t * n_head + hh) * hd + c1] = __float2half_rn(o1 * inv);
}

__global__ void swiglu_kernel(const float* gu, int F, __half* act) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int t = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= F) return;
  const float g = gu[(int64_t)t * 2 * F + i], u = gu[(int64_t)t * 2 * F + F + i];
  act[(int64_t)t * F + i] = __float2half_rn(g / (1.0f + expf(-g)) * u);
}

constexpr int kArgmaxThreads = 512;

// one block per row: (value, index) max with the smaller index on ties; a non-finite value marks the row
__global__ void argmax_kernel(const float* logits, int V, int32_t* out) {
  pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  const int r = blockIdx.x;
  const float* row = logits + (int64_t)r * V;
  float best = -INFINITY;
  int idx = INT_MAX;
  bool bad = false;
  for (int i = threadIdx.x; i < V; i += kArgmaxThreads) {
    const float v = row[i];
    bad |= !isfinite(v);
    if (v > best || (v == best && i < idx)) {
      best = v;
      idx = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  }
  bad = __any_sync(0xffffffffu, bad);
  __shared__ float sb[kArgmaxThreads / 32];
  __shared__ int si[kArgmaxThreads / 32];
  __shared__ int sbad[kArgmaxThreads / 32];
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sb[w] = best;
    si[w] = idx;
    sbad[w] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool any_bad = false;
    for (int j = 0; j < kArgmaxThreads / 32; ++j) {
      any_bad |= sbad[j] != 0;
      if (sb[j] > best || (sb[j] == best && si[j] < idx)) {
        best = sb[j];
        idx = si[j];
      }
    }
    out[r] = any_bad ? -1 : idx;
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// uniform in [0, 1) from 24 bits of the hash of (seed, i)
__device__ __forceinline__ float unit_of(uint64_t seed, int64_t i) {
  return (float)(splitmix64(seed * 0x2545f4914f6cdd1dull + (uint64_t)i) >> 40) * 0x1.0p-24f;
}

__global__ void fill_f16_kernel(__half* x, int64_t n, float a, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = __float2half_rn((2.0f * unit_of(seed, i) - 1.0f) * a);
}
__global__ void fill_f32_kernel(float* x, int64_t n, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    x[i] = lo + (hi - lo) * unit_of(seed, i);
}

}  // namespace

void argmax_rows(const float* logits, int n, int V, int32_t* out, void* stream) {
  if (n == 0) return;
  launch_pdl(argmax_kernel, n, kArgmaxThreads, 0, as_stream(stream), logits, V, out);
  check_launch("model argmax");
}

void fill_uniform_f16(uint16_t* x, int64_t n, float a, uint64_t seed, void* stream) {
  if (n == 0) return;
  const int blocks = (int)std::min<int64_t>((n + 255) / 256, 132 * 64);
  fill_f16_kernel<<<blocks, 256, 0, as_stream(stream)>>>(reinterpret_cast<__half*>(x), n, a, seed);
  check_launch("model fill_uniform_f16");
}

void fill_uniform_f32(float* x, int64_t n, float lo, float hi, uint64_t seed, void* stream) {
  if (n == 0) return;
  const int blocks = (int)std::min<int64_t>((n + 255) / 256, 132 * 64);
  fill_f32_kernel<<<blocks, 256, 0, as_stream(stream)>>>(x, n, lo, hi, seed);
  check_launch("model fill_uniform_f32");
}

void embed(const int32_t* tokens, const uint16_t* emb, int n, int E, float* x, void* stream) {
  launch_pdl(embed_kernel, n, 256, 0, as_stream(stream), tokens, reinterpret_cast<const __half*>(emb), E, x);
  check_launch("model embed");
}

void add_rmsnorm(float* x, const float* add, const float* w, const int32_t* rows, int n_rows, int E, float eps,
                 uint16_t* h, void* stream) {
  if (n_rows == 0) return;
  launch_pdl(add_rmsnorm_kernel, n_rows, kNormThreads, 0, as_stream(stream), x, add, w, rows, E, eps,
             reinterpret_cast<__half*>(h));
  check_launch("model add_rmsnorm");
}

void qkv_rope(const float* qkv, const float* bias, const float* inv_freq, int n_rot, bool neox, const int32_t* pos,
              int n, int n_head, int n_kv_head, int hd, uint16_t* q, uint16_t* k, uint16_t* v, void* stream,
              float* k32, float* v32) {
  launch_pdl(qkv_rope_kernel, dim3(n, n_head + 2 * n_kv_head), hd, 0, as_stream(stream), qkv, bias, inv_freq, n_rot, neox,
             pos, n_head, n_kv_head, hd, reinterpret_cast<__half*>(q), reinterpret_cast<__half*>(k),
             reinterpret_cast<__half*>(v), k32, v32);
  check_launch("model qkv_rope");
}

void stage_rows(const float* k, const float* v, const int32_t* seq, const int32_t* pos, int n, int n_stage, int dkv,
                float* stage_k, float* stage_v, void* stream) {
  if (n == 0) return;
  launch_pdl(stage_rows_kernel, n, 256, 0, as_stream(stream), k, v, seq, pos, n_stage, dkv, stage_k, stage_v);
  check_launch("model stage_rows");
}

void staged_attention(const uint16_t* q, const float* stage_k, const float* stage_v, const int32_t* seq,
                      const int32_t* pos, int n, int n_stage, int n_head, int n_kv_head, int hd, float scale,
                      uint16_t* out, void* stream) {
  if (n == 0) return;
  KVQ_ASSERT(hd % 16 == 0 && hd <= 2 * kStagedThreads);  // (paged_kv_geometry: 64, 80, 96, 128, 256)
  const int tile_rows = std::min(kStagedTileFloats / hd, n_stage);
  const size_t smem = (size_t)(tile_rows * hd + hd + 32 + n_stage) * sizeof(float);  // tile, query, reductions, scores
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(staged_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem);
    detail::check(e, "model staged_attention (shared memory)");
  }
  launch_pdl(staged_attention_kernel, dim3(n, n_head), kStagedThreads, smem, as_stream(stream),
             reinterpret_cast<const __half*>(q), stage_k, stage_v, seq, pos, n_stage, n_head, n_kv_head, hd, tile_rows,
             scale, reinterpret_cast<__half*>(out));
  check_launch("model staged_attention");
}

void swiglu(const float* gu, int n, int F, uint16_t* act, void* stream) {
  launch_pdl(swiglu_kernel, dim3((F + 255) / 256, n), 256, 0, as_stream(stream), gu, F, reinterpret_cast<__half*>(act));
  check_launch("model swiglu");
}

}  // namespace kvq::cuda::mk
