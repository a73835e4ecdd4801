// Decode attention over kivi4 pages (include/kvq/cuda.h; docs/cuda.md "KIVI"), on the packed codes.
//
// Grid (work item, kv head) as attn_decode.cu's decode_kernel (same split-KV items, same attn_state
// workspace, folded by its merge_kernel with the exact sink / residual rows); 4 warps per block, a
// warp takes 32-token chunks of the item, one token per lane:
//   scores  lane t: q · k_t with k_t[c] = s_c u_tc + z_c, the per-channel scale and zero of t's
//           group (K is unrotated, so the query is used as given), f32 on the CUDA cores, for the
//           GQA group's <= 8 query heads;
//   P·V     lane c (channels c, c + 32, ..): sum_t p_t (s_tg u_tc + z_tg), V's per-token q4a scale
//           and zero, in V's rotated basis (the merge undoes the rotation).
// Online softmax per warp in log2 units; the warps' states merge in shared memory.
#include <cmath>
#include <string>

#include "cuda/kivi.cuh"

namespace kvq::cuda::detail {

namespace {

constexpr int kWarps = kKiviDecodeThreads / 32;
constexpr int kMaxGroup = 8;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float softcap_log2(float x, float c2) { return c2 > 0.0f ? c2 * tanhf(x / c2) : x; }

template <int HD>
constexpr int smem_bytes() {
  return kMaxGroup * HD * 4 + kWarps * kMaxGroup * HD * 4 + kWarps * kMaxGroup * 8;
}

template <int HD>
__global__ void __launch_bounds__(kKiviDecodeThreads) kivi_decode_kernel(kivi_decode_args a) {
  constexpr int NB = HD / 32;  // 32-element code blocks per row (V: one q4a group each)
  extern __shared__ __align__(16) float ks_smem[];
  float* qf = ks_smem;                                                    // [8][HD] queries (f32)
  float* ow = qf + kMaxGroup * HD;                                        // [warp][8][HD]
  float2* mdw = reinterpret_cast<float2*>(ow + kWarps * kMaxGroup * HD);  // [warp][8]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int work = blockIdx.x; work < a.n_work; work += gridDim.x) {
    const int4 it = a.items[work / a.n_kv_head];
    const int seq = it.x, t0 = it.y, t1 = it.z, h = work % a.n_kv_head;
    const int32_t* pages = a.indices + it.w;
    const int lo = a.seq_lo ? a.seq_lo[seq] : 0;
    for (int i = threadIdx.x; i < a.ng * HD; i += kKiviDecodeThreads) {
      const int hh = i / HD, c = i % HD;
      qf[i] = load_elem(a.q, ((int64_t)seq * a.n_head + (int64_t)h * a.ng + hh) * HD + c, a.q_bf16 != 0);
    }
    __syncthreads();
    float m[kMaxGroup], d[kMaxGroup], o[kMaxGroup][NB];
#pragma unroll
    for (int hh = 0; hh < kMaxGroup; ++hh) {
      m[hh] = -INFINITY;
      d[hh] = 0.0f;
#pragma unroll
      for (int k = 0; k < NB; ++k) o[hh][k] = 0.0f;
    }
    const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
    for (int c0 = t0 + 32 * warp; c0 < t1; c0 += 32 * kWarps) {
      const int t = c0 + lane;
      const bool valid = t < t1 && t >= lo;
      const uint8_t* blk = nullptr;
      int row = 0;
      float sc[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) sc[hh] = 0.0f;
      if (valid) {
        blk = head_base + (int64_t)pages[t >> a.geo.page_shift] * a.geo.page_bytes;
        row = t & (a.geo.page_size - 1);
        const uint8_t* kc = blk + a.geo.k_codes + row * (HD / 2);
        const __half* ksc = reinterpret_cast<const __half*>(blk + a.geo.k_scales) + (row >> 5) * 2 * HD;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const uint4 w = *reinterpret_cast<const uint4*>(kc + 16 * b);
          const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            const uint32_t byte = (ws[i >> 2] >> (8 * (i & 3))) & 0xffu;
            const int c_lo = 32 * b + i, c_hi = c_lo + 16;
            const float klo = fmaf(__half2float(ksc[c_lo]), (float)(byte & 15u), __half2float(ksc[HD + c_lo]));
            const float khi = fmaf(__half2float(ksc[c_hi]), (float)(byte >> 4), __half2float(ksc[HD + c_hi]));
#pragma unroll
            for (int hh = 0; hh < kMaxGroup; ++hh)
              if (hh < a.ng) sc[hh] = fmaf(qf[hh * HD + c_hi], khi, fmaf(qf[hh * HD + c_lo], klo, sc[hh]));
          }
        }
      }
      // online softmax (log2 units) per head over the chunk's 32 tokens
      float p[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) {
        p[hh] = 0.0f;
        if (hh >= a.ng) continue;
        const float s = valid ? softcap_log2(sc[hh] * a.sm_scale_log2, a.softcap_log2) : -INFINITY;
        const float mn = fmaxf(m[hh], warp_max(s));
        if (mn == -INFINITY) continue;  // nothing visible yet
        const float alpha = ex2(m[hh] - mn);
        p[hh] = valid ? ex2(s - mn) : 0.0f;
        d[hh] = d[hh] * alpha + warp_sum(p[hh]);
#pragma unroll
        for (int k = 0; k < NB; ++k) o[hh][k] *= alpha;
        m[hh] = mn;
      }
      // P·V: lane owns channels 32 k + lane (byte 16 k + lane % 16 of a row, low / high nibble)
      unsigned vmask = __ballot_sync(kFull, valid);
      const unsigned long long bl = reinterpret_cast<unsigned long long>(blk);
      while (vmask) {
        const int j = __ffs(vmask) - 1;
        vmask &= vmask - 1;
        const uint8_t* bj = reinterpret_cast<const uint8_t*>(__shfl_sync(kFull, bl, j));
        const int rj = __shfl_sync(kFull, row, j);
        const uint8_t* vc = bj + a.geo.v_codes + rj * (HD / 2) + (lane & 15);
        const __half* vs = reinterpret_cast<const __half*>(bj + a.geo.v_scales) + rj * 2 * NB;
        float pj[kMaxGroup];
#pragma unroll
        for (int hh = 0; hh < kMaxGroup; ++hh) pj[hh] = __shfl_sync(kFull, p[hh], j);
#pragma unroll
        for (int k = 0; k < NB; ++k) {
          const uint32_t byte = vc[16 * k];
          const float u = (float)(lane < 16 ? byte & 15u : byte >> 4);
          const float v = fmaf(__half2float(vs[k]), u, __half2float(vs[NB + k]));
#pragma unroll
          for (int hh = 0; hh < kMaxGroup; ++hh) o[hh][k] = fmaf(pj[hh], v, o[hh][k]);
        }
      }
    }
    // ---- merge the warps' states ----
#pragma unroll
    for (int hh = 0; hh < kMaxGroup; ++hh) {
      if (hh >= a.ng) continue;
#pragma unroll
      for (int k = 0; k < NB; ++k) ow[(warp * kMaxGroup + hh) * HD + 32 * k + lane] = o[hh][k];
      if (lane == 0) mdw[warp * kMaxGroup + hh] = make_float2(m[hh], d[hh]);
    }
    __syncthreads();
    const int64_t wsb = (int64_t)work * a.ng;
    for (int i = threadIdx.x; i < a.ng * HD; i += kKiviDecodeThreads) {
      const int hh = i / HD, c = i % HD;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, mdw[w * kMaxGroup + hh].x);
      float oo = 0.0f, dd = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float2 md = mdw[w * kMaxGroup + hh];
        if (md.x != -INFINITY) {
          const float e = ex2(md.x - M);
          oo += e * ow[(w * kMaxGroup + hh) * HD + c];
          dd += e * md.y;
        }
      }
      a.ws_o[(wsb + hh) * HD + c] = oo;
      if (c == 0) a.ws_md[wsb + hh] = make_float2(M, dd);
    }
    __syncthreads();  // shared memory is reused by the next work item
  }
}

// ---- tiles of a prompt chunk's queries (kivi_tiles_args) ----
constexpr int kTileKeys = 32;
template <int HD>
__host__ __device__ constexpr int tiles_stride() {
  return HD + 4;  // floats per shared row: 16-byte aligned, rows in different banks
}
template <int HD>
constexpr int tiles_smem_bytes() {
  return (64 + 2 * kTileKeys) * tiles_stride<HD>() * 4;
}

// 128 threads: row r = tid / 2 (entry r / ng of the tile, GQA head r % ng), half = tid % 2 takes keys
// [16 half, 16 half + 16) of a tile for the scores and channels [half HD / 2, ..) for P·V.
template <int HD>
__global__ void __launch_bounds__(kKiviDecodeThreads) kivi_tiles_kernel(kivi_tiles_args a) {
  constexpr int ST = tiles_stride<HD>(), NB = HD / 32, HH = HD / 2;
  extern __shared__ __align__(16) float ts_smem[];
  float* qs = ts_smem;              // [64][ST]
  float* ks = qs + 64 * ST;         // [32][ST]
  float* vs = ks + kTileKeys * ST;  // [32][ST]
  const int tid = threadIdx.x, r = tid >> 1, half = tid & 1, h = blockIdx.y;
  const int b0 = blockIdx.x * a.qt, rows = min(a.qt, a.batch - b0) * a.ng;
  const int b = b0 + r / a.ng, hh = r % a.ng;
  const bool active = r < rows;
  const int my_len = active ? a.len[b] : 0;
  const int tile_len = a.len[min(a.batch, b0 + a.qt) - 1];  // the tile's longest (lengths non-decreasing)
  for (int i = tid; i < rows * HD; i += kKiviDecodeThreads) {
    const int rr = i / HD, c = i % HD;
    qs[rr * ST + c] =
        load_elem(a.q, ((int64_t)(b0 + rr / a.ng) * a.n_head + (int64_t)h * a.ng + rr % a.ng) * HD + c, a.q_bf16 != 0);
  }
  float m = -INFINITY, d = 0.0f, o[HH];
#pragma unroll
  for (int c = 0; c < HH; ++c) o[c] = 0.0f;
  const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
  for (int kb = 0; kb < tile_len; kb += kTileKeys) {
    __syncthreads();  // the previous tile's K / V are consumed (and the queries stored)
    const uint8_t* blk = head_base + (int64_t)a.pages[kb >> a.geo.page_shift] * a.geo.page_bytes;
    const int row0 = kb & (a.geo.page_size - 1);
    const __half* ksc = reinterpret_cast<const __half*>(blk + a.geo.k_scales) + (row0 >> 5) * 2 * HD;
    for (int i = tid; i < kTileKeys * HH; i += kKiviDecodeThreads) {
      const int j = i / HH, byte = i % HH;
      const int c_lo = 32 * (byte / 16) + byte % 16, c_hi = c_lo + 16;
      float klo = 0.0f, khi = 0.0f, vlo = 0.0f, vhi = 0.0f;
      if (kb + j < tile_len) {
        const int row = row0 + j;
        const uint32_t kc = blk[a.geo.k_codes + row * HH + byte], vc = blk[a.geo.v_codes + row * HH + byte];
        klo = fmaf(__half2float(ksc[c_lo]), (float)(kc & 15u), __half2float(ksc[HD + c_lo]));
        khi = fmaf(__half2float(ksc[c_hi]), (float)(kc >> 4), __half2float(ksc[HD + c_hi]));
        const __half* vsc = reinterpret_cast<const __half*>(blk + a.geo.v_scales) + row * 2 * NB;
        const int g = byte / 16;  // c_lo and c_hi lie in V group g
        const float s = __half2float(vsc[g]), z = __half2float(vsc[NB + g]);
        vlo = fmaf(s, (float)(vc & 15u), z);
        vhi = fmaf(s, (float)(vc >> 4), z);
      }
      ks[j * ST + c_lo] = klo;
      ks[j * ST + c_hi] = khi;
      vs[j * ST + c_lo] = vlo;
      vs[j * ST + c_hi] = vhi;
    }
    __syncthreads();
    // scores of this row against keys [16 half, 16 half + 16) of the tile
    float sc[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) sc[jj] = 0.0f;
    if (active) {
      const float* qr = qs + r * ST;
      const float* kr = ks + (16 * half) * ST;
#pragma unroll 4
      for (int c = 0; c < HD; c += 4) {
        const float4 qv = *reinterpret_cast<const float4*>(qr + c);
#pragma unroll
        for (int jj = 0; jj < 16; ++jj) {
          const float4 kv = *reinterpret_cast<const float4*>(kr + jj * ST + c);
          sc[jj] = fmaf(qv.w, kv.w, fmaf(qv.z, kv.z, fmaf(qv.y, kv.y, fmaf(qv.x, kv.x, sc[jj]))));
        }
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const bool vis = kb + 16 * half + jj < my_len;
      sc[jj] = vis ? softcap_log2(sc[jj] * a.sm_scale_log2, a.softcap_log2) : -INFINITY;
      mx = fmaxf(mx, sc[jj]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    const float mn = fmaxf(m, mx);
    const bool none = mn == -INFINITY;  // nothing visible to this row yet (the same for the pair)
    const float alpha = none ? 1.0f : ex2(m - mn);
    float sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      sc[jj] = sc[jj] == -INFINITY ? 0.0f : ex2(sc[jj] - mn);
      sum += sc[jj];
    }
    sum += __shfl_xor_sync(kFull, sum, 1);  // (every lane: no early exit around the shuffles)
    d = d * alpha + sum;
    if (!none) m = mn;
#pragma unroll
    for (int c = 0; c < HH; ++c) o[c] *= alpha;
    // P·V over the 32 keys for channels [half HH, half HH + HH)
    const float* vbase = vs + half * HH;
#pragma unroll 2
    for (int jj = 0; jj < 16; ++jj) {
      const float mine = sc[jj], other = __shfl_xor_sync(kFull, sc[jj], 1);
      const float* v_mine = vbase + (16 * half + jj) * ST;
      const float* v_other = vbase + (16 * (1 - half) + jj) * ST;
#pragma unroll
      for (int c = 0; c < HH; c += 4) {
        const float4 x = *reinterpret_cast<const float4*>(v_mine + c);
        const float4 y = *reinterpret_cast<const float4*>(v_other + c);
        o[c] = fmaf(other, y.x, fmaf(mine, x.x, o[c]));
        o[c + 1] = fmaf(other, y.y, fmaf(mine, x.y, o[c + 1]));
        o[c + 2] = fmaf(other, y.z, fmaf(mine, x.z, o[c + 2]));
        o[c + 3] = fmaf(other, y.w, fmaf(mine, x.w, o[c + 3]));
      }
    }
  }
  if (!active || my_len == 0) return;
  const int64_t ws = ((int64_t)a.item_ptr[b] * a.n_kv_head + h) * a.ng + hh;
#pragma unroll
  for (int c = 0; c < HH; ++c) a.ws_o[ws * HD + half * HH + c] = o[c];
  if (half == 0) a.ws_md[ws] = make_float2(m, d);
}

template <class Fn>
void by_hd(int hd, Fn&& fn) {
  switch (hd) {
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 96: fn(std::integral_constant<int, 96>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    case 256: fn(std::integral_constant<int, 256>{}); break;
    default:
      fail(errc::internal, "[cuda attn_decode] kivi4 head_dim " + std::to_string(hd) + " slipped past validation");
  }
}

}  // namespace

int kivi_decode_blocks_per_sm(int hd) {
  int occ = 0;
  by_hd(hd, [&](auto hc) {
    constexpr int HD = decltype(hc)::value;
    check(cudaFuncSetAttribute(kivi_decode_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<HD>()),
          "cudaFuncSetAttribute(kivi decode)");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kivi_decode_kernel<HD>, kKiviDecodeThreads,
                                                        smem_bytes<HD>()),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  return occ;
}

bool kivi_tiles_supported(int hd) { return hd == 64 || hd == 96 || hd == 128; }

void kivi_tiles_launch(int hd, const kivi_tiles_args& a, cudaStream_t st) {
  by_hd(hd, [&](auto hc) {
    constexpr int HD = decltype(hc)::value;
    if constexpr (HD <= 128) {
      check(cudaFuncSetAttribute(kivi_tiles_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 tiles_smem_bytes<HD>()),
            "cudaFuncSetAttribute(kivi tiles)");
      const dim3 grid((unsigned)((a.batch + a.qt - 1) / a.qt), (unsigned)a.n_kv_head);
      kivi_tiles_kernel<HD><<<grid, kKiviDecodeThreads, tiles_smem_bytes<HD>(), st>>>(a);
    } else {
      fail(errc::internal, "[cuda attn_decode] kivi tiles: head_dim " + std::to_string(HD) + " slipped past the plan");
    }
  });
  check_launch("attn_decode (kivi_tiles_kernel)");
}

void kivi_decode_launch(int hd, const kivi_decode_args& a, int grid, cudaStream_t st) {
  by_hd(hd, [&](auto hc) {
    constexpr int HD = decltype(hc)::value;
    kivi_decode_kernel<HD><<<(unsigned)grid, kKiviDecodeThreads, smem_bytes<HD>(), st>>>(a);
  });
  check_launch("attn_decode (kivi_decode_kernel)");
}

}  // namespace kvq::cuda::detail
