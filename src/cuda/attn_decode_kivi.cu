// Decode attention over kivi4 pages (include/kvq/cuda.h; docs/cuda.md "KIVI"), on the packed codes.
//
// Grid (work item, kv head) as attn_decode.cu's decode_kernel (same split-KV items, same attn_state
// workspace, folded by its merge_kernel with the exact sink / residual rows); 4 warps per block, a
// warp takes 32-token chunks of the item aligned to K's groups of 32 (the first chunk of an item
// may start before it, its tokens masked), so a chunk has one set of channel scales and zeros:
//   scores  k_t[c] = s_c u_tc + z_c gives q · k_t = (q ⊙ s) · u_t + q · z: per chunk the warp forms
//           q ⊙ s and q · z for the GQA group's <= 8 query heads (K is unrotated, so the query is
//           used as given), then lane t takes token t's codes against q ⊙ s, f32 on the CUDA cores;
//   P·V     v_t[c] = s_tg u_tc + z_tg (V's per-token q4a scale and zero of channel group g):
//           sum_t p_t v_t[c] = sum_t (p_t s_tg) u_tc + sum_t p_t z_tg. Lane t writes p_t s_tg and
//           p_t z_tg and its V codes row to shared memory; lane l then owns 2 PB channels of one
//           group (code bytes [PB l, PB l + PB) of a row) and runs over the chunk's 32 tokens.
// A code u in [0, 15] becomes the float 2^23 + u by a byte permute, minus 2^23 (exact; no integer
// conversion). Online softmax per warp in log2 units; the warps' states merge in shared memory.
#include <cmath>
#include <string>

#include "cuda/kivi.cuh"

namespace kvq::cuda::detail {

namespace {

constexpr int kWarps = kKiviDecodeThreads / 32;
constexpr int kMaxGroup = 8;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float softcap_log2(float x, float c2) { return c2 > 0.0f ? c2 * tanhf(x / c2) : x; }

// byte k (a value in [0, 15]) of x as a float, exactly: 0x4B0000xx is 2^23 + xx
__device__ __forceinline__ float code_f(uint32_t x, int k) {
  return __int_as_float((int)__byte_perm(x, 0x4B000000u, 0x7540u | (unsigned)k)) - 8388608.0f;
}

// Shared memory: the block's queries [ngp][HD] f32, then per warp: q ⊙ s [ngp][HD] (the warp's o for
// the merge at the end), the chunk's K and V codes [32][HD / 2 + 16] each (cp.async; rows padded so
// that a lane's 16-byte reads of its own row do not share banks), p s and p z [32][NB][2][ngp], {m,
// d} [ngp]; ngp = the GQA group rounded up to 4 or 8.
__host__ __device__ constexpr int kd_ngp(int ng) { return ng <= 4 ? 4 : 8; }
template <int HD>
__host__ __device__ constexpr int kd_warp_bytes(int ngp) {
  return ngp * HD * 4 + 2 * 32 * (HD / 2 + 16) + 32 * (HD / 32) * 2 * ngp * 4 + ngp * 8;
}
template <int HD>
constexpr int smem_bytes(int ng) {
  return kd_ngp(ng) * HD * 4 + kWarps * kd_warp_bytes<HD>(kd_ngp(ng));
}

// The block's warps' states of work item `work` folded into one attn_state per GQA head (ws_o, ws_md):
// warp w's o of head hh at o_of(w)[hh * stride + c], its {m, d} at md_of(w)[hh]. Both kernels below.
template <int HD, class OOf, class MdOf>
__device__ __forceinline__ void merge_warp_states(const kivi_decode_args& a, int work, int ng, int stride, OOf&& o_of,
                                                  MdOf&& md_of) {
  const int64_t wsb = (int64_t)work * ng;
  for (int i = threadIdx.x; i < ng * HD; i += kKiviDecodeThreads) {
    const int hh = i / HD, c = i % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, md_of(w)[hh].x);
    float oo = 0.0f, dd = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 mdw = md_of(w)[hh];
      if (mdw.x != -INFINITY) {
        const float e = ex2(mdw.x - M);
        oo += e * o_of(w)[hh * stride + c];
        dd += e * mdw.y;
      }
    }
    a.ws_o[(wsb + hh) * HD + c] = oo;
    if (c == 0) a.ws_md[wsb + hh] = make_float2(M, dd);
  }
}

template <int HD>
__global__ void __launch_bounds__(kKiviDecodeThreads, 4) kivi_decode_kernel(kivi_decode_args a) {
  constexpr int NB = HD / 32, RB = HD / 2;  // 32-element code blocks (V: one q4a group each), bytes per row
  constexpr int RS = RB + 16;               // shared row stride
  constexpr int PB = HD == 256 ? 4 : 2;     // P·V: code bytes per lane (2 PB channels of one group)
  constexpr int PV_LANES = RB / PB;         // 16 / 24 / 32 / 32 lanes hold channels
  extern __shared__ __align__(16) float ks_smem[];
  const int ng = a.ng, ngp = kd_ngp(ng);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* qf = ks_smem;  // [ngp][HD]
  auto warp_area = [&](int w) { return reinterpret_cast<uint8_t*>(qf + ngp * HD) + w * kd_warp_bytes<HD>(ngp); };
  uint8_t* wa = warp_area(warp);
  float* qs = reinterpret_cast<float*>(wa);              // [ngp][HD]
  uint8_t* krow = wa + ngp * HD * 4;                     // [32][RS]
  uint8_t* vrow = krow + 32 * RS;                        // [32][RS]
  float* wz = reinterpret_cast<float*>(vrow + 32 * RS);  // [32][NB][2][ngp]
  auto md_of = [&](int w) { return reinterpret_cast<float2*>(warp_area(w) + kd_warp_bytes<HD>(ngp) - ngp * 8); };
  float2* md = md_of(warp);  // [ngp]
  // P·V: this lane's bytes [PB lane, ..) of a row: channels c0 + e and c0 + 16 + e (e < PB) of group pg
  const int pbyte = PB * lane, pg = pbyte / 16, pc0 = 32 * pg + pbyte % 16;
  const bool pv_lane = lane < PV_LANES;
  for (int work = blockIdx.x; work < a.n_work; work += gridDim.x) {
    const int4 it = a.items[work / a.n_kv_head];
    const int seq = it.x, t0 = it.y, t1 = it.z, h = work % a.n_kv_head;
    const int32_t* pages = a.indices + it.w;
    const int lo = a.seq_lo ? a.seq_lo[seq] : 0;
    for (int i = threadIdx.x; i < ng * HD; i += kKiviDecodeThreads) {
      const int hh = i / HD, c = i % HD;
      qf[i] = load_elem(a.q, ((int64_t)seq * a.n_head + (int64_t)h * ng + hh) * HD + c, a.q_bf16 != 0);
    }
    __syncthreads();
    float m[kMaxGroup], d[kMaxGroup], zc[kMaxGroup], o[kMaxGroup][2 * PB];
#pragma unroll
    for (int hh = 0; hh < kMaxGroup; ++hh) {
      m[hh] = -INFINITY;
      d[hh] = 0.0f;
      zc[hh] = 0.0f;
#pragma unroll
      for (int e = 0; e < 2 * PB; ++e) o[hh][e] = 0.0f;
    }
    const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
    for (int c0 = (t0 & ~31) + 32 * warp; c0 < t1; c0 += 32 * kWarps) {
      const uint8_t* blk = head_base + (int64_t)pages[c0 >> a.geo.page_shift] * a.geo.page_bytes;
      const int row0 = c0 & (a.geo.page_size - 1);  // a multiple of 32: one K group
      const int t = c0 + lane, row = row0 + lane;
      const bool valid = t >= t0 && t < t1 && t >= lo;
      // this lane's token: K and V codes into shared memory (zeros for a masked token), V's scales and
      // zeros into registers (loads first, used below)
      {
        const uint8_t* kc = blk + a.geo.k_codes + row * RB;
        const uint8_t* vc = blk + a.geo.v_codes + row * RB;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          cp_async<16>(krow + lane * RS + 16 * b, kc + 16 * b, valid);
          cp_async<16>(vrow + lane * RS + 16 * b, vc + 16 * b, valid);
        }
        cp_async_commit();
      }
      float vs[NB], vz[NB];
      if (valid) {
        const __half* vsc = reinterpret_cast<const __half*>(blk + a.geo.v_scales) + row * 2 * NB;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          vs[b] = __half2float(vsc[b]);
          vz[b] = __half2float(vsc[NB + b]);
        }
      }
      // q ⊙ s and q · z of the chunk's K group (lane: channels lane + 32 i)
      const __half* ksc = reinterpret_cast<const __half*>(blk + a.geo.k_scales) + (row0 >> 5) * 2 * HD;
      float bz[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) bz[hh] = 0.0f;
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        const int c = lane + 32 * i;
        const float sk = __half2float(ksc[c]), zk = __half2float(ksc[HD + c]);
#pragma unroll
        for (int hh = 0; hh < kMaxGroup; ++hh)
          if (hh < ng) {
            const float q = qf[hh * HD + c];
            qs[hh * HD + c] = q * sk;
            bz[hh] = fmaf(q, zk, bz[hh]);
          }
      }
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh)
        if (hh < ng) bz[hh] = warp_sum(bz[hh]);
      cp_async_wait<0>();
      __syncwarp();
      float sc[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) sc[hh] = 0.0f;
      if (valid) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const uint4 kw = reinterpret_cast<const uint4*>(krow + lane * RS)[b];
          const uint32_t ws[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
          for (int wi = 0; wi < 4; ++wi) {
            // bytes 4 wi .. 4 wi + 3 of block b: channels cl + k (low nibbles) and cl + 16 + k (high)
            const uint32_t lo4 = ws[wi] & 0x0F0F0F0Fu, hi4 = (ws[wi] >> 4) & 0x0F0F0F0Fu;
            const int cl = 32 * b + 4 * wi;
            float ul[4], uh[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              ul[k] = code_f(lo4, k);
              uh[k] = code_f(hi4, k);
            }
#pragma unroll
            for (int hh = 0; hh < kMaxGroup; ++hh)
              if (hh < ng) {
                const float4 ql = *reinterpret_cast<const float4*>(qs + hh * HD + cl);
                const float4 qh = *reinterpret_cast<const float4*>(qs + hh * HD + cl + 16);
                float x = sc[hh];
                x = fmaf(ql.x, ul[0], x);
                x = fmaf(ql.y, ul[1], x);
                x = fmaf(ql.z, ul[2], x);
                x = fmaf(ql.w, ul[3], x);
                x = fmaf(qh.x, uh[0], x);
                x = fmaf(qh.y, uh[1], x);
                x = fmaf(qh.z, uh[2], x);
                sc[hh] = fmaf(qh.w, uh[3], x);
              }
          }
        }
      }
      // online softmax (log2 units) per head over the chunk's 32 tokens
      float p[kMaxGroup];
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) {
        p[hh] = 0.0f;
        if (hh >= ng) continue;
        const float s = valid ? softcap_log2((sc[hh] + bz[hh]) * a.sm_scale_log2, a.softcap_log2) : -INFINITY;
        const float mn = fmaxf(m[hh], warp_max(s));
        if (mn == -INFINITY) continue;  // nothing visible yet
        const float alpha = ex2(m[hh] - mn);
        p[hh] = valid ? ex2(s - mn) : 0.0f;
        d[hh] = d[hh] * alpha + warp_sum(p[hh]);
        zc[hh] *= alpha;
#pragma unroll
        for (int e = 0; e < 2 * PB; ++e) o[hh][e] *= alpha;
        m[hh] = mn;
      }
      // p s, p z of this token per V group (zeros for a masked token)
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        float* w = wz + (lane * NB + b) * 2 * ngp;
        const float sb = valid ? vs[b] : 0.0f, zb = valid ? vz[b] : 0.0f;
#pragma unroll
        for (int q4 = 0; q4 < kMaxGroup / 4; ++q4)
          if (4 * q4 < ngp) {
            reinterpret_cast<float4*>(w)[q4] =
                make_float4(p[4 * q4] * sb, p[4 * q4 + 1] * sb, p[4 * q4 + 2] * sb, p[4 * q4 + 3] * sb);
            reinterpret_cast<float4*>(w + ngp)[q4] =
                make_float4(p[4 * q4] * zb, p[4 * q4 + 1] * zb, p[4 * q4 + 2] * zb, p[4 * q4 + 3] * zb);
          }
      }
      __syncwarp();
      if (pv_lane) {
#pragma unroll 4
        for (int j = 0; j < 32; ++j) {
          uint32_t cw;
          if constexpr (PB == 2)
            cw = *reinterpret_cast<const uint16_t*>(vrow + j * RS + pbyte);
          else
            cw = *reinterpret_cast<const uint32_t*>(vrow + j * RS + pbyte);
          const uint32_t lo4 = cw & 0x0F0F0F0Fu, hi4 = (cw >> 4) & 0x0F0F0F0Fu;
          const float* w = wz + (j * NB + pg) * 2 * ngp;
          float ws[kMaxGroup], zs[kMaxGroup];
#pragma unroll
          for (int q4 = 0; q4 < kMaxGroup / 4; ++q4)
            if (4 * q4 < ngp) {
              const float4 x = reinterpret_cast<const float4*>(w)[q4], y = reinterpret_cast<const float4*>(w + ngp)[q4];
              ws[4 * q4] = x.x, ws[4 * q4 + 1] = x.y, ws[4 * q4 + 2] = x.z, ws[4 * q4 + 3] = x.w;
              zs[4 * q4] = y.x, zs[4 * q4 + 1] = y.y, zs[4 * q4 + 2] = y.z, zs[4 * q4 + 3] = y.w;
            } else {
              ws[4 * q4] = ws[4 * q4 + 1] = ws[4 * q4 + 2] = ws[4 * q4 + 3] = 0.0f;
              zs[4 * q4] = zs[4 * q4 + 1] = zs[4 * q4 + 2] = zs[4 * q4 + 3] = 0.0f;
            }
#pragma unroll
          for (int e = 0; e < PB; ++e) {
            const float ul = code_f(lo4, e), uh = code_f(hi4, e);
#pragma unroll
            for (int hh = 0; hh < kMaxGroup; ++hh)
              if (hh < ng) {
                o[hh][e] = fmaf(ws[hh], ul, o[hh][e]);
                o[hh][PB + e] = fmaf(ws[hh], uh, o[hh][PB + e]);
              }
          }
#pragma unroll
          for (int hh = 0; hh < kMaxGroup; ++hh)
            if (hh < ng) zc[hh] += zs[hh];
        }
      }
      __syncwarp();  // krow, vrow, wz and qs are rewritten by the next chunk
    }
    // ---- merge the warps' states (each warp's o into its q ⊙ s area) ----
    if (pv_lane) {
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh)
        if (hh < ng) {
#pragma unroll
          for (int e = 0; e < PB; ++e) {
            qs[hh * HD + pc0 + e] = o[hh][e] + zc[hh];
            qs[hh * HD + pc0 + 16 + e] = o[hh][PB + e] + zc[hh];
          }
        }
    }
#pragma unroll
    for (int hh = 0; hh < kMaxGroup; ++hh)
      if (hh < ng && lane == 0) md[hh] = make_float2(m[hh], d[hh]);
    __syncthreads();
    merge_warp_states<HD>(a, work, ng, HD, [&](int w) { return reinterpret_cast<const float*>(warp_area(w)); }, md_of);
    __syncthreads();  // shared memory is reused by the next work item
  }
}

// ---- the same on the tensor cores (head_dim <= 128) ----
//
// Per warp and 32-token chunk (one K group), as FlashAttention-2's decode step with the codes as the
// matrix operands (mma m16n8k16, f16 x f16 -> f32; rows 0..7 of A are the GQA group's heads, rows
// 8..15 the f16 residual of the same values, so that hi + lo carries ~22 bits; C rows g and g + 8
// are summed at the end):
//   scores  A = (q ⊙ s) 2^e (hi, lo) over channels, B = the codes u (exact in f16), C + (q · z) in
//           f32. e: a power of two from max|q| max|s| that keeps q ⊙ s 2^e below 2^15. The k slots of
//           an MMA are channels 32 b + 16 hf + 4 t + {0, 1} (2t, 2t+1) and + {2, 3} (8 + 2t, 9 + 2t):
//           lane (g, t)'s B is one 32-bit word of token g's code row (bytes 4t..4t+3 of block b, low
//           nibbles for hf 0, high for hf 1).
//   P·V     A = p (hi, lo) straight from the scores' C fragments, B = s_tb u_tc in f16 (one rounding,
//           no offset: V's zero enters separately), plus one tile whose B column b holds z_tb, so
//           that C gives sum_t p_t z_tb per V group b, added to the group's channels at the end.
//           Output tile (b, x, nib) holds channels 32 b + 16 nib + 8 x + n: B (k = tokens 2t, 2t+1,
//           8+2t, 9+2t; n = g) is byte 16 b + 8 x + g of those four code rows.
template <int HD>
__host__ __device__ constexpr int km_qs_stride() {
  return HD + 16;  // floats: rows 64 bytes apart in the banks (lane (g, t) reads row g)
}
template <int HD>
__host__ __device__ constexpr int km_warp_bytes() {
  return kMaxGroup * km_qs_stride<HD>() * 4 + 2 * 32 * (HD / 2 + 16) + 2 * (HD / 32) * 32 * 2 + kMaxGroup * 4 +
         kMaxGroup * 8;
}
template <int HD>
constexpr int km_smem_bytes() {
  return kMaxGroup * HD * 4 + kWarps * km_warp_bytes<HD>();
}

template <int HD>
__global__ void __launch_bounds__(kKiviDecodeThreads, 3) kivi_decode_mma_kernel(kivi_decode_args a) {
  static_assert(HD <= 128, "head_dim 256 takes kivi_decode_kernel");
  constexpr int NB = HD / 32, RB = HD / 2, RS = RB + 16, QS = km_qs_stride<HD>();
  constexpr int NT = 4 * NB;  // P·V output tiles of 8 channels
  constexpr uint32_t k1024 = 0x64006400u;  // half2 (1024, 1024)
  extern __shared__ __align__(16) float km_smem[];
  const int ng = a.ng;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float* qf = km_smem;  // [8][HD] queries, rows >= ng zero
  auto warp_area = [&](int w) { return reinterpret_cast<uint8_t*>(qf + kMaxGroup * HD) + w * km_warp_bytes<HD>(); };
  uint8_t* wa = warp_area(warp);
  float* qs = reinterpret_cast<float*>(wa);                  // [8][QS] (q ⊙ s) 2^e; o for the merge
  uint8_t* krow = wa + kMaxGroup * QS * 4;                   // [32][RS]
  uint8_t* vrow = krow + 32 * RS;                            // [32][RS]
  uint16_t* vsb = reinterpret_cast<uint16_t*>(vrow + 32 * RS);  // [NB][32] V scales
  uint16_t* vzb = vsb + NB * 32;                             // [NB][32] V zeros
  float* bzs = reinterpret_cast<float*>(vzb + NB * 32);      // [8] q · z
  auto md_of = [&](int w) { return reinterpret_cast<float2*>(warp_area(w) + km_warp_bytes<HD>() - kMaxGroup * 8); };
  for (int i = lane; i < kMaxGroup * QS; i += 32) qs[i] = 0.0f;  // rows >= ng stay zero
  for (int work = blockIdx.x; work < a.n_work; work += gridDim.x) {
    const int4 it = a.items[work / a.n_kv_head];
    const int seq = it.x, t0 = it.y, t1 = it.z, h = work % a.n_kv_head;
    const int32_t* pages = a.indices + it.w;
    const int tlo = max(t0, a.seq_lo ? a.seq_lo[seq] : 0);
    for (int i = threadIdx.x; i < kMaxGroup * HD; i += kKiviDecodeThreads) {
      const int hh = i / HD, c = i % HD;
      qf[i] = hh < ng ? load_elem(a.q, ((int64_t)seq * a.n_head + (int64_t)h * ng + hh) * HD + c, a.q_bf16 != 0) : 0.0f;
    }
    __syncthreads();
    float qmax = 0.0f;
    for (int i = lane; i < ng * HD; i += 32) qmax = fmaxf(qmax, fabsf(qf[i]));
    qmax = warp_max(qmax);
    float m = -INFINITY, d = 0.0f;  // head g (lane's row)
    float o[NT][4], zo[4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    zo[0] = zo[1] = zo[2] = zo[3] = 0.0f;
    const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
    for (int c0 = (t0 & ~31) + 32 * warp; c0 < t1; c0 += 32 * kWarps) {
      const uint8_t* blk = head_base + (int64_t)pages[c0 >> a.geo.page_shift] * a.geo.page_bytes;
      const int row0 = c0 & (a.geo.page_size - 1);  // a multiple of 32: one K group
      {  // token lane: codes (zeros when masked), V's scales and zeros
        const bool valid = c0 + lane >= tlo && c0 + lane < t1;
        const int row = row0 + lane;
        const uint8_t* kc = blk + a.geo.k_codes + row * RB;
        const uint8_t* vc = blk + a.geo.v_codes + row * RB;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          cp_async<16>(krow + lane * RS + 16 * b, kc + 16 * b, valid);
          cp_async<16>(vrow + lane * RS + 16 * b, vc + 16 * b, valid);
        }
        cp_async_commit();
        const uint16_t* vsc = reinterpret_cast<const uint16_t*>(blk + a.geo.v_scales) + row * 2 * NB;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          vsb[b * 32 + lane] = valid ? vsc[b] : (uint16_t)0;
          vzb[b * 32 + lane] = valid ? vsc[NB + b] : (uint16_t)0;
        }
      }
      // (q ⊙ s) 2^e and q · z of the chunk's K group (lane: channels lane + 32 i)
      const __half* ksc = reinterpret_cast<const __half*>(blk + a.geo.k_scales) + (row0 >> 5) * 2 * HD;
      float sk[NB], zk[NB], smax = 0.0f;
#pragma unroll
      for (int i = 0; i < NB; ++i) {
        sk[i] = __half2float(ksc[lane + 32 * i]);
        zk[i] = __half2float(ksc[HD + lane + 32 * i]);
        smax = fmaxf(smax, fabsf(sk[i]));
      }
      const float bound = qmax * warp_max(smax);
      int ex = 0;
      (void)frexpf(bound, &ex);  // bound < 2^ex
      const float qscale = bound > 0.0f ? ldexpf(1.0f, 15 - ex) : 1.0f, qunscale = 1.0f / qscale;  // powers of two
#pragma unroll
      for (int hh = 0; hh < kMaxGroup; ++hh) {
        if (hh >= ng) break;
        float bz = 0.0f;
#pragma unroll
        for (int i = 0; i < NB; ++i) {
          const float q = qf[hh * HD + lane + 32 * i];
          qs[hh * QS + lane + 32 * i] = q * sk[i] * qscale;
          bz = fmaf(q, zk[i], bz);
        }
        bz = warp_sum(bz);
        if (lane == 0) bzs[hh] = bz;
      }
      cp_async_wait<0>();
      __syncwarp();
      // scores: S[g][8 nt + 2t + e] = (c[nt][e] + c[nt][2 + e]) / qscale + q · z
      float c[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float4 qv = *reinterpret_cast<const float4*>(qs + g * QS + 32 * b + 16 * hf + 4 * t);
          const __half2 h01 = __floats2half2_rn(qv.x, qv.y), h23 = __floats2half2_rn(qv.z, qv.w);
          const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
          const uint32_t a0 = *reinterpret_cast<const uint32_t*>(&h01), a2 = *reinterpret_cast<const uint32_t*>(&h23);
          const uint32_t a1 = pack_half2(qv.x - f01.x, qv.y - f01.y), a3 = pack_half2(qv.z - f23.x, qv.w - f23.y);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(krow + (8 * nt + g) * RS + 16 * b + 4 * t);
            const uint32_t x4 = hf ? (w >> 4) & 0x0F0F0F0Fu : w & 0x0F0F0F0Fu;
            const uint32_t b0 = hsub2_u32(__byte_perm(x4, 0x64646464u, 0x4140u), k1024);
            const uint32_t b1 = hsub2_u32(__byte_perm(x4, 0x64646464u, 0x4342u), k1024);
            mma_f16(c[nt], a0, a1, a2, a3, b0, b1);
          }
        }
      // online softmax of head g over the chunk (the quad t = 0..3 holds its 32 tokens)
      const float bzg = g < ng ? bzs[g] : 0.0f;
      float p[4][2], mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = c0 + 8 * nt + 2 * t + e;
          const float sv = (c[nt][e] + c[nt][2 + e]) * qunscale + bzg;
          p[nt][e] = tok >= tlo && tok < t1 ? softcap_log2(sv * a.sm_scale_log2, a.softcap_log2) : -INFINITY;
          mx = fmaxf(mx, p[nt][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
      const float mn = fmaxf(m, mx);
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          p[nt][e] = mn == -INFINITY || p[nt][e] == -INFINITY ? 0.0f : ex2(p[nt][e] - mn);
          sum += p[nt][e];
        }
      sum += __shfl_xor_sync(kFull, sum, 1);
      sum += __shfl_xor_sync(kFull, sum, 2);
      if (mn != -INFINITY) {
        const float alpha = ex2(m - mn);
        d = d * alpha + sum;
        m = mn;
#pragma unroll
        for (int n = 0; n < NT; ++n) o[n][0] *= alpha, o[n][1] *= alpha, o[n][2] *= alpha, o[n][3] *= alpha;
        zo[0] *= alpha, zo[1] *= alpha, zo[2] *= alpha, zo[3] *= alpha;
      }
      // P·V over the chunk's two k steps of 16 tokens
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const __half2 h01 = __floats2half2_rn(p[2 * ks][0], p[2 * ks][1]);
        const __half2 h23 = __floats2half2_rn(p[2 * ks + 1][0], p[2 * ks + 1][1]);
        const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
        const uint32_t a0 = *reinterpret_cast<const uint32_t*>(&h01), a2 = *reinterpret_cast<const uint32_t*>(&h23);
        const uint32_t a1 = pack_half2(p[2 * ks][0] - f01.x, p[2 * ks][1] - f01.y);
        const uint32_t a3 = pack_half2(p[2 * ks + 1][0] - f23.x, p[2 * ks + 1][1] - f23.y);
        const int j0 = 16 * ks + 2 * t, j2 = j0 + 8;  // tokens j0, j0 + 1 (b0) and j2, j2 + 1 (b1)
        // V zeros: column b of the tile, rows j
        {
          const uint32_t z0 = g < NB ? *reinterpret_cast<const uint32_t*>(vzb + g * 32 + j0) : 0u;
          const uint32_t z1 = g < NB ? *reinterpret_cast<const uint32_t*>(vzb + g * 32 + j2) : 0u;
          mma_f16(zo, a0, a1, a2, a3, z0, z1);
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          const uint32_t s01 = *reinterpret_cast<const uint32_t*>(vsb + b * 32 + j0);
          const uint32_t s23 = *reinterpret_cast<const uint32_t*>(vsb + b * 32 + j2);
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int col = 16 * b + 8 * x + g;
            const uint32_t r0 = vrow[j0 * RS + col], r1 = vrow[(j0 + 1) * RS + col];
            const uint32_t r2 = vrow[j2 * RS + col], r3 = vrow[(j2 + 1) * RS + col];
            const uint32_t w = __byte_perm(__byte_perm(r0, r1, 0x0040u), __byte_perm(r2, r3, 0x0040u), 0x5410u);
#pragma unroll
            for (int nib = 0; nib < 2; ++nib) {
              const uint32_t x4 = nib ? (w >> 4) & 0x0F0F0F0Fu : w & 0x0F0F0F0Fu;
              const uint32_t u01 = hsub2_u32(__byte_perm(x4, 0x64646464u, 0x4140u), k1024);
              const uint32_t u23 = hsub2_u32(__byte_perm(x4, 0x64646464u, 0x4342u), k1024);
              mma_f16(o[4 * b + 2 * nib + x], a0, a1, a2, a3, hmul2_u32(u01, s01), hmul2_u32(u23, s23));
            }
          }
        }
      }
      __syncwarp();  // krow, vrow, the scales and qs are rewritten by the next chunk
    }
    // ---- this warp's state: o (rows g and g + 8 summed, V's zeros added per group) into qs ----
    float zg[NB];  // sum_t p_t z_tb of head g: held by lane (g, b / 2), entry b % 2 (+ its lo row)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const float z01 = (b & 1) ? zo[1] + zo[3] : zo[0] + zo[2];
      zg[b] = __shfl_sync(kFull, z01, (lane & ~3) | (b >> 1));
    }
    if (g < ng) {
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int nib = 0; nib < 2; ++nib)
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const float* ot = o[4 * b + 2 * nib + x];
            const int ch = 32 * b + 16 * nib + 8 * x + 2 * t;
            qs[g * QS + ch] = ot[0] + ot[2] + zg[b];
            qs[g * QS + ch + 1] = ot[1] + ot[3] + zg[b];
          }
      if (t == 0) md_of(warp)[g] = make_float2(m, d);
    }
    __syncthreads();
    merge_warp_states<HD>(a, work, ng, QS, [&](int w) { return reinterpret_cast<const float*>(warp_area(w)); }, md_of);
    __syncthreads();  // shared memory is reused by the next work item
    // (qs rows < ng are rewritten by every chunk; rows >= ng were never written)
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

int kivi_decode_blocks_per_sm(int hd, int ng) {
  int occ = 0;
  by_hd(hd, [&](auto hc) {
    constexpr int HD = decltype(hc)::value;
    if constexpr (HD <= 128) {
      check(cudaFuncSetAttribute(kivi_decode_mma_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 km_smem_bytes<HD>()),
            "cudaFuncSetAttribute(kivi decode)");
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kivi_decode_mma_kernel<HD>, kKiviDecodeThreads,
                                                          km_smem_bytes<HD>()),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    } else {
      check(cudaFuncSetAttribute(kivi_decode_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_bytes<HD>(kMaxGroup)),
            "cudaFuncSetAttribute(kivi decode)");
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kivi_decode_kernel<HD>, kKiviDecodeThreads,
                                                          smem_bytes<HD>(ng)),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    }
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
    if constexpr (HD <= 128)
      kivi_decode_mma_kernel<HD><<<(unsigned)grid, kKiviDecodeThreads, km_smem_bytes<HD>(), st>>>(a);
    else
      kivi_decode_kernel<HD><<<(unsigned)grid, kKiviDecodeThreads, smem_bytes<HD>(a.ng), st>>>(a);
  });
  check_launch("attn_decode (kivi_decode_kernel)");
}

}  // namespace kvq::cuda::detail
