// Flash-decoding over the paged cache, computed on the packed codes (docs/cuda.md, "Decode kernel").
//
// Grid (work item, kv head); 4 warps per block. A work item is a token range of one sequence
// (split-KV); its 16-token chunks go round-robin to the warps, each with its own cp.async
// pipeline and its own online-softmax state for the GQA group (<= 8 query heads, one MMA N tile).
// q4 up to head_dim 128 takes the warp's chunks two per pipeline stage and softmax step.
//   scores  S[head][tok] = mma.m16n8k32 s8: rotated Q quantized per K scale group (rows = heads;
//           q4: int8, q8: int16 as two int8 MMAs, 254 hi + lo) x K codes (q4 nibbles unpacked by
//           two LOPs: the code layout already matches the B fragment), per-block int32 dots read
//           back as floats through a 1.5 * 2^23 bias, times the f16 K scale and the query scale;
//   P·V     O^T[channel][head] = mma.m16n8k16 f16: V codes -> exact f16 (u - 8) via byte permute +
//           the 1024 + u exponent trick (A operand), times P' = p * V scale in f16 (B operand).
// The warps' states merge in shared memory into one attn_state per (item, query head) in the
// workspace; merge_kernel folds the items and the exact f16 window, normalises and undoes the V
// rotation. The f16 instance (own baseline) uses the same skeleton with ldmatrix + f16 MMA.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kivi.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

using namespace detail;

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 16;     // tokens per pipeline stage of one warp
constexpr int kMaxGroup = 8;   // query heads per kv head (the MMA N tile)
constexpr int kBias = 0x4B400000;          // float 1.5 * 2^23 as int: bias of the int32 accumulators
constexpr float kBiasF = 12582912.0f;
constexpr unsigned kFull = 0xffffffffu;

struct decode_args {
  const uint8_t* pool;
  dev_geom geo;
  const int32_t* indptr;
  const int32_t* indices;
  const int4* items;  // [n_items] {seq, tok_begin, tok_end, indptr[seq]}
  const void* q;      // [batch][n_head][HD]
  float* ws_o;        // [n_items][n_kv_head][ng][HD]
  float2* ws_md;      // [n_items][n_kv_head][ng] {m (log2 units), d}
  int n_work;         // n_items * n_kv_head; the grid loops over them (persistent blocks)
  int q_bf16;
  int n_head, n_kv_head, ng;
  float sm_scale_log2;  // scale * log2(e)
  float softcap_log2;   // attn_spec::softcap * log2(e); 0 = none
  const int* seq_lo;    // [batch] first visible token (attn_spec::key_range of the query), or nullptr
  int rot_block;
  float rot_scale;
  const float* k_lambda;    // K channel scale [rows][n_kv_head][HD] (q becomes q * lambda), or nullptr
  const int32_t* stat_row;  // [batch] row of k_lambda
};

// attn_spec::softcap in the kernels' log2 units: c log2(e) tanh(x / (c log2(e))) for x = scaled
// score * log2(e) is c tanh(score / c) * log2(e).
__device__ __forceinline__ float softcap_log2(float x, float c2) { return c2 > 0.0f ? c2 * tanhf(x / c2) : x; }

template <dfmt F, int HD>
struct cfg {
  using S = shape<F, HD>;
  static constexpr int SR = S::CB % 16 == 0 ? S::CB + 16 : S::CB;  // smem row stride (padding: no bank conflicts)
  static constexpr int PS = S::CB % 16 == 0 ? 16 : 8;               // cp.async piece
  static constexpr int PPR = S::CB / PS;
  static constexpr int SCALE_BYTES = kChunk * S::NS * 2;  // one side, one chunk
  static constexpr int SUB = 2 * kChunk * SR + 2 * SCALE_BYTES;  // one 16-token chunk in shared memory
  // 16-token chunks per pipeline stage and online-softmax step. q4 up to head_dim 128 takes two: one
  // wait, one row max and one rescale per 32 tokens, and the two chunks' scores and P·V in one
  // basic block (docs/perf.md, "q4 in 32-token steps"); q8 / f16 (and q4 at 256) one.
#ifndef KVQ_CUDA_Q4_SUB
#define KVQ_CUDA_Q4_SUB 2
#endif
  static constexpr int NSUB = (F == dfmt::q4 && HD <= 128) ? KVQ_CUDA_Q4_SUB : 1;
  static constexpr int STAGE = NSUB * SUB;
  // f16: up to 4 stages in ~110 KB (2 blocks per SM); q8/q4: 4 stages (measured best, docs/perf.md);
  // q4 in 32-token steps: 2 (one step, two chunks, ahead per warp; measured faster than 3, docs/perf.md)
  static constexpr int STAGES_FIT = 110 * 1024 / (kWarps * STAGE);
#ifndef KVQ_CUDA_Q_STAGES
#define KVQ_CUDA_Q_STAGES 4
#endif
#ifndef KVQ_CUDA_Q4_STAGES
#define KVQ_CUDA_Q4_STAGES 2
#endif
  static constexpr int STAGES = F == dfmt::f16 ? (STAGES_FIT < 2   ? 2
                                                  : STAGES_FIT > 4 ? 4
                                                                   : STAGES_FIT)
                                : NSUB > 1     ? KVQ_CUDA_Q4_STAGES
                                               : KVQ_CUDA_Q_STAGES;
  static constexpr int PIPE = kWarps * STAGES * STAGE;
  static constexpr int EPI = kWarps * kMaxGroup * HD * 4 + kWarps * kMaxGroup * 8;
  static constexpr int REGION0 = (PIPE > EPI ? PIPE : EPI + 15) / 16 * 16;
  static constexpr int QF = kMaxGroup * HD * 4;  // rotated f32 queries
  static constexpr int QQ = kMaxGroup * HD * 2;  // int8 (q4), int16 as int8 hi + lo planes (q8), or f16 queries
  static constexpr int NQS = S::NS > 0 ? S::NS : 1;  // query scales per head: one per K scale group
  static constexpr int SMEM = REGION0 + QF + QQ + kMaxGroup * NQS * 4 + kMaxGroup * S::NB * 4;
  static constexpr int MT = F == dfmt::f16 ? HD / 16 : 2 * S::NB;  // P·V m16 tiles (channels)
  // blocks per SM the register budget is shaped for (1: the compiler's choice). q4 keeps the
  // occupancy its shared memory allows up to head_dim 128: 4 blocks at head_dim 64, 3 at 96 / 128
  // (<= 168 registers; the compiler's choice was 170 at 128, i.e. 2 blocks); 5 measured slower.
#ifndef KVQ_CUDA_Q4_MIN_BLOCKS
#define KVQ_CUDA_Q4_MIN_BLOCKS (HD <= 64 ? 4 : 3)
#endif
  // q8 at head_dim 128 is held to 3 blocks per SM as well (<= 168 registers: the compiler's choice
  // was 168 before the two-chunk q4 loop, 179 with its shared code, i.e. 2 blocks)
  static constexpr int MIN_BLOCKS = (F == dfmt::q4 && HD <= 128)   ? KVQ_CUDA_Q4_MIN_BLOCKS
                                    : (F == dfmt::q8 && HD == 128) ? 3
                                                                   : 1;
};

// The f16 scales of one token row as packed 32-bit words (NS = 1, 3: assembled from 16-bit loads).
template <int NS>
__device__ __forceinline__ void load_scale_words(const uint8_t* sp, uint32_t (&w)[(NS + 1) / 2]) {
  if constexpr (NS == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(sp);
  } else if constexpr (NS == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(sp);
    w[0] = x.x;
    w[1] = x.y;
  } else if constexpr (NS == 8) {
    const uint4 x = *reinterpret_cast<const uint4*>(sp);
    w[0] = x.x;
    w[1] = x.y;
    w[2] = x.z;
    w[3] = x.w;
  } else {
#pragma unroll
    for (int q2 = 0; q2 < (NS + 1) / 2; ++q2) {
      const uint32_t lo = reinterpret_cast<const uint16_t*>(sp)[2 * q2];
      const uint32_t hi = 2 * q2 + 1 < NS ? reinterpret_cast<const uint16_t*>(sp)[2 * q2 + 1] : 0u;
      w[q2] = lo | hi << 16;
    }
  }
}


// q4 V codes in the decode kernel's P·V (its own layout; the prefill kernel uses pv_out_channels'):
// byte b (0..3) of token A's and token B's words in the two 16-bit lanes, each byte in both halves of
// its lane, so one permute feeds the low- and the high-nibble A rows.
__host__ __device__ constexpr unsigned q4_pair_sel(int b) {
  return (unsigned)(b | b << 4 | (4 + b) << 8 | (4 + b) << 12);
}
// (a & m) | c as one LOP3: written in C with two immediates, the compiler emits two (SASS LOP3 takes
// one immediate; here it keeps the other constant in a register).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(m), "r"(c));
  return d;
}
// cp.async of 16 bytes where p holds, predicated rather than branched around.
__device__ __forceinline__ void cp_async16_if(void* dst, const void* src, bool p) {
  asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"((int)p)
               : "memory");
}
// Low nibble u of each 16-bit lane -> f16 (u - 8): 0x6400 | u is 1024 + u, minus 1032, exact.
__device__ __forceinline__ uint32_t q4_lo_f16(uint32_t pr) {
  return hsub2_u32(and_or(pr, 0x000F000Fu, 0x64006400u), 0x64086408u);
}
// High nibble u of each lane's low byte -> f16 (u - 8): 0x6400 | 16 u is 1024 + 16 u; times 1/16
// (0x2C00) minus 72 (0xD480) is u - 8, exact (one fused rounding of an exact value).
__device__ __forceinline__ uint32_t q4_hi_f16(uint32_t pr) {
  const uint32_t x = and_or(pr, 0x00F000F0u, 0x64006400u);
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&x), __halves2half2(__ushort_as_half(0x2C00), __ushort_as_half(0x2C00)),
                            __halves2half2(__ushort_as_half(0xD480), __ushort_as_half(0xD480)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// The V channels of q4 P·V tile mt (= 2 * block + mu) in lane group g's accumulator entries (0, 1)
// (A row g: the low nibble of byte beta = 4 (g & 3) + 2 mu + (g >> 2) of the block) and (2, 3) (row
// g + 8: its high nibble, element beta + 16, or beta + 8 in a 16-element last block, docs/formats.md).
// False where beta lies past a 16-element last block (head_dim % 32 == 16: bytes 0..7 only).
template <int HD>
__device__ __forceinline__ bool pv_out_channels_q4(int mt, int g, int& ch0, int& ch1) {
  using S = shape<dfmt::q4, HD>;
  const int bb = mt >> 1, mu = mt & 1;
  const bool last_partial = S::PARTIAL && bb == S::NB - 1;
  ch0 = 32 * bb + 4 * (g & 3) + 2 * mu + (g >> 2);
  ch1 = ch0 + (last_partial ? 8 : 16);
  return !last_partial || (g & 3) < 2;
}

template <dfmt F, int HD>
__global__ void __launch_bounds__(kThreads, cfg<F, HD>::MIN_BLOCKS) decode_kernel(decode_args a) {
  detail::pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  using S = shape<F, HD>;
  using C = cfg<F, HD>;
  constexpr int NSUB = C::NSUB;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int work = blockIdx.x; work < a.n_work; work += gridDim.x) {
  const int4 it = a.items[work / a.n_kv_head];
  const int seq = it.x, t0 = it.y, t1 = it.z, h = work % a.n_kv_head;
  const int nchunk = (t1 - t0 + kChunk - 1) / kChunk;
  const int my_chunks = nchunk > warp ? (nchunk - warp + kWarps - 1) / kWarps : 0;
  const int my_steps = (my_chunks + NSUB - 1) / NSUB;  // pipeline stages / softmax steps of NSUB chunks
  const int32_t* pages = a.indices + it.w;
  const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
  uint8_t* wbuf = smem + warp * C::STAGES * C::STAGE;
  auto chunk_tok = [&](int c) { return t0 + (warp + c * kWarps) * kChunk; };  // first token of chunk c
  // Page ids of this warp's chunks [32 b, 32 b + 32) (pg_cur) and of the next 32 (pg_nxt), one per
  // lane: a block's page-table load is issued 32 chunks before its first use, so no issue waits on it.
  auto pg_load = [&](int b) {
    const int c = 32 * b + lane;
    return c < my_chunks ? pages[chunk_tok(c) >> a.geo.page_shift] : 0;
  };
  int pg_cur = pg_load(0), pg_nxt = pg_load(1);
  auto page_of = [&](int c) {  // warp-uniform; called for c = 0, 1, 2, ... in order
    if ((c & 31) == 0 && c > 0) {
      pg_cur = pg_nxt;
      pg_nxt = pg_load((c >> 5) + 1);
    }
    return __shfl_sync(kFull, pg_cur, c & 31);
  };
  // pages of the next stage to issue, looked up one stage ahead (the shuffle's latency off the issue)
  int pg_next[NSUB];
  auto fetch_pages = [&](int j) {
#pragma unroll
    for (int u = 0; u < NSUB; ++u) pg_next[u] = j * NSUB + u < my_chunks ? page_of(j * NSUB + u) : 0;
  };

  // Full chunks (all but an item's last) are kChunk consecutive rows of one page, so piece p (PS bytes)
  // of a side's codes lies at byte p * PS of one range: this lane's pieces are one base address per
  // side plus constant offsets, and a chunk adds page * page_bytes + its row offset (one 32 x 32 -> 64
  // multiply-add). K scale pieces go to lanes [0, NSP), V scale pieces to [NSP, 2 NSP).
  constexpr int NP = kChunk * C::PPR;       // code pieces of one side and chunk
  constexpr int NSP = C::SCALE_BYTES / 16;  // 16-byte scale pieces of one side and chunk
  static_assert(2 * NSP <= 32, "one scale piece per lane");
  const uint8_t* lane_k = head_base + a.geo.k_codes + lane * C::PS;
  const uint8_t* lane_v = head_base + a.geo.v_codes + lane * C::PS;
  const bool lane_vs = lane >= NSP;
  const uint8_t* lane_s = head_base + (lane_vs ? a.geo.v_scales + 16 * (lane - NSP) : a.geo.k_scales + 16 * lane);
  const int lane_sd = 2 * kChunk * C::SR + (lane_vs ? C::SCALE_BYTES + 16 * (lane - NSP) : 16 * lane);
  const uint32_t page_bytes = (uint32_t)a.geo.page_bytes;  // < 2^32 (paged_kv_geometry_of)

  // Loads this warp's stage j (chunks j * NSUB + u) into buffer j % STAGES (one commit group, possibly
  // empty), then looks up the pages of stage j + 1.
  auto issue = [&](int j) {
    uint8_t* const sdst = wbuf + (j % C::STAGES) * C::STAGE;
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      const int c = j * NSUB + u;
      uint8_t* dst = sdst + u * C::SUB;
      if (c < my_chunks) {
        const uint32_t page = (uint32_t)pg_next[u];
        const int tok = chunk_tok(c);
        const int nvalid = min(kChunk, t1 - tok);
        const int off = tok & (a.geo.page_size - 1);
        if (nvalid == kChunk) {
          const uint64_t co = (uint64_t)page * page_bytes + (uint32_t)(off * S::CB);
          const uint8_t* ks = lane_k + co;
          const uint8_t* vs = lane_v + co;
#pragma unroll
          for (int it = 0; it < (NP + 31) / 32; ++it) {
            const int p = lane + 32 * it;
            if (NP % 32 == 0 || p < NP) {
              uint8_t* d = dst + (p / C::PPR) * C::SR + (p % C::PPR) * C::PS;
              cp_async<C::PS>(d, ks + 32 * it * C::PS, true);
              cp_async<C::PS>(d + kChunk * C::SR, vs + 32 * it * C::PS, true);
            }
          }
          if constexpr (S::NS > 0)
            cp_async16_if(dst + lane_sd, lane_s + ((uint64_t)page * page_bytes + (uint32_t)(off * S::NS * 2)),
                          lane < 2 * NSP);
        } else {  // the item's last, partial chunk: rows past the end zero-filled
          const uint8_t* blk = head_base + (int64_t)page * a.geo.page_bytes;
          for (int p = lane; p < NP; p += 32) {
            const int r = p / C::PPR, jj = p % C::PPR;
            const bool ok = r < nvalid;
            const int64_t so = (int64_t)(off + (ok ? r : 0)) * S::CB + jj * C::PS;
            cp_async<C::PS>(dst + r * C::SR + jj * C::PS, blk + a.geo.k_codes + so, ok);
            cp_async<C::PS>(dst + (kChunk + r) * C::SR + jj * C::PS, blk + a.geo.v_codes + so, ok);
          }
          if constexpr (S::NS > 0) {  // plain copy, scales of missing rows zeroed
            uint8_t* sd = dst + 2 * kChunk * C::SR;
            const int64_t so = (int64_t)off * S::NS * 2;
            const uint16_t* ks = reinterpret_cast<const uint16_t*>(blk + a.geo.k_scales + so);
            const uint16_t* vs = reinterpret_cast<const uint16_t*>(blk + a.geo.v_scales + so);
            for (int p = lane; p < kChunk * S::NS; p += 32) {
              const bool ok = p / S::NS < nvalid;
              reinterpret_cast<uint16_t*>(sd)[p] = ok ? ks[p] : (uint16_t)0;
              reinterpret_cast<uint16_t*>(sd + C::SCALE_BYTES)[p] = ok ? vs[p] : (uint16_t)0;
            }
          }
        }
      } else if (NSUB > 1 && j < my_steps) {
        // a stage's chunk past the warp's last: its rows are masked out of the softmax (p = 0), but
        // its V scales (uninitialised shared memory, possibly NaN) enter P' = p * scale: zeroed
        if constexpr (S::NS > 0)
          for (int p = lane; p < C::SCALE_BYTES / 4; p += 32)
            reinterpret_cast<uint32_t*>(dst + 2 * kChunk * C::SR + C::SCALE_BYTES)[p] = 0u;
      }
    }
    cp_async_commit();
    fetch_pages(j + 1);
  };
  fetch_pages(0);
#pragma unroll
  for (int j = 0; j < C::STAGES - 1; ++j) issue(j);

  // ---- queries of the group: rotate (f32), then quantize per K scale group (as kv_cache_quant:
  // int16 for q8 K, int8 for q4 K; one scale per K group) or round to f16 ----
  constexpr bool Q16 = F == dfmt::q8;
  constexpr float kQMax = Q16 ? (float)kq16_max : 127.0f;
  float* qf = reinterpret_cast<float*>(smem + C::REGION0);  // [8][HD]
  uint8_t* qq = smem + C::REGION0 + C::QF;  // q4: [8][HD] int8; q8: [2][8][HD] int8 (hi, lo); f16: [8][HD]
  float* qscale = reinterpret_cast<float*>(qq + C::QQ);      // [8][NQS]
  int* qsum = reinterpret_cast<int*>(qscale + kMaxGroup * C::NQS);  // [8][NB] (q4)
  const float* lam = k_lambda_row<HD>(a.k_lambda, a.stat_row, seq, a.n_kv_head, h);
  for (int i = threadIdx.x; i < kMaxGroup * HD; i += kThreads) {
    const int hh = i / HD, c = i % HD;
    const float x = hh < a.ng ? load_elem(a.q, ((int64_t)seq * a.n_head + (int64_t)h * a.ng + hh) * HD + c, a.q_bf16 != 0) : 0.0f;
    qf[i] = lambda_scaled(x, lam, c);
  }
  if (a.rot_block > 1) fwht_rows_block(qf, a.ng, HD, a.rot_block, a.rot_scale);
  else __syncthreads();
  if constexpr (F != dfmt::f16) {
    // Stores code qc of element i: int8 (q4), or int16 split as qc = 254 hi + lo (q8).
    auto put = [&](int i, int qc) {
      if constexpr (Q16) {
        const int hi = split_q16_hi(qc);
        reinterpret_cast<int8_t*>(qq)[i] = (int8_t)hi;
        reinterpret_cast<int8_t*>(qq)[kMaxGroup * HD + i] = (int8_t)(qc - 254 * hi);
      } else {
        reinterpret_cast<int8_t*>(qq)[i] = (int8_t)qc;
      }
    };
    if constexpr (S::NS > 1) {
      // 32-element groups, contiguous over the 8 heads (group u = head * NQS + i): 8 lanes per
      // group, 4 elements per lane, absmax over the 8 lanes.
      for (int u = 4 * warp + (lane >> 3); u < kMaxGroup * C::NQS; u += 4 * kWarps) {
        const int e = u * 32 + 4 * (lane & 7);
        const float4 x = *reinterpret_cast<const float4*>(qf + e);
        float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
        const query_quant qz = query_quant_of(amax, kQMax);
        put(e, query_code(qz, x.x));
        put(e + 1, query_code(qz, x.y));
        put(e + 2, query_code(qz, x.z));
        put(e + 3, query_code(qz, x.w));
        if ((lane & 7) == 0) qscale[u] = qz.scale;
      }
    } else {  // one group per row (head_dim 80): one warp per head
      for (int hh = warp; hh < kMaxGroup; hh += kWarps) {
        const float* x = qf + hh * HD;
        float amax = 0.0f;
        for (int c = lane; c < HD; c += 32) amax = fmaxf(amax, fabsf(x[c]));
        const query_quant qz = query_quant_of(warp_max(amax), kQMax);
        for (int c = lane; c < HD; c += 32) put(hh * HD + c, query_code(qz, x[c]));
        if (lane == 0) qscale[hh] = qz.scale;
      }
    }
    if constexpr (F == dfmt::q4) {  // sums of the int8 query per 32-element code block (the -8 offset)
      __syncthreads();
      if (threadIdx.x < kMaxGroup * S::NB) {
        const int hh = threadIdx.x / S::NB, bb = threadIdx.x % S::NB;
        const int m = (S::PARTIAL && bb == S::NB - 1) ? 16 : 32;
        const int8_t* qr = reinterpret_cast<const int8_t*>(qq) + hh * HD + 32 * bb;
        int sum = 0;
        for (int i = 0; i < m; ++i) sum += qr[i];
        qsum[threadIdx.x] = sum;
      }
    }
  } else {
    for (int i = threadIdx.x; i < kMaxGroup * HD; i += kThreads)
      reinterpret_cast<__half*>(qq)[i] = __float2half_rn(qf[i]);
  }
  __syncthreads();

  // Query fragments (rows = heads g; rows 8..15 of the MMA are zero): qa = the int8 query (q4), the
  // high int8 half (q8; ql the low half) or the f16 query.
  constexpr int NQ = F == dfmt::f16 ? HD / 16 : S::NB;
  constexpr int NL = Q16 ? S::NB : 1;
  uint32_t qa0[NQ], qa2[NQ], ql0[NL], ql2[NL];
  // q4: the -8 offset of the codes, 8 * (the block's query sum), enters through the float bias the
  // block dot is read back with, so every score MMA starts from the same constant accumulator
  float qbias[S::NB];
  float qsc[C::NQS];  // this thread's head's query scales, one per K scale group (NQS > 1)
  float sfac;
  if constexpr (F != dfmt::f16) {
#pragma unroll
    for (int bb = 0; bb < S::NB; ++bb) {
      const uint8_t* qr = qq + g * HD + 32 * bb;
      if (S::PARTIAL && bb == S::NB - 1) {
        if constexpr (F == dfmt::q4) {  // 16-element block: byte i holds e[i] and e[i + 8]
          qa0[bb] = t < 2 ? lds32(qr + 4 * t) : 0u;
          qa2[bb] = t < 2 ? lds32(qr + 8 + 4 * t) : 0u;
        } else {
          qa0[bb] = lds32(qr + 4 * t);
          qa2[bb] = 0u;
          ql0[bb] = lds32(qr + kMaxGroup * HD + 4 * t);
          ql2[bb] = 0u;
        }
      } else {
        qa0[bb] = lds32(qr + 4 * t);
        qa2[bb] = lds32(qr + 16 + 4 * t);
        if constexpr (Q16) {
          ql0[bb] = lds32(qr + kMaxGroup * HD + 4 * t);
          ql2[bb] = lds32(qr + kMaxGroup * HD + 16 + 4 * t);
        }
      }
      qbias[bb] = kBiasF + (F == dfmt::q4 ? (float)(8 * qsum[g * S::NB + bb]) : 0.0f);  // exact (< 2^24)
    }
#pragma unroll
    for (int k = 0; k < C::NQS; ++k) qsc[k] = qscale[g * C::NQS + k];
    sfac = C::NQS == 1 ? qsc[0] * a.sm_scale_log2 : a.sm_scale_log2;
  } else {
    const uint8_t* qr = qq + 2 * g * HD;
#pragma unroll
    for (int ks = 0; ks < NQ; ++ks) {
      qa0[ks] = lds32(qr + 2 * (16 * ks + 2 * t));
      qa2[ks] = lds32(qr + 2 * (16 * ks + 8 + 2 * t));
    }
    sfac = a.sm_scale_log2;
  }

  // ---- main loop over this warp's stages of NSUB chunks ----
  float m_run = -INFINITY, d_run = 0.0f;
  float acc[C::MT][4];
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
  float pscale = 1.0f, inv_pscale = 1.0f;
  // q4 rows of this thread in the P·V tiles (pv_out_channels_q4): byte 2 mu + (g >> 2) of word g & 3
  // of each block, its low nibble in A row g and its high nibble in row g + 8 (one byte permute each)
  const unsigned q4_sel[2] = {q4_pair_sel(g >> 2), q4_pair_sel(2 + (g >> 2))};
  // token rows of this thread's score / P columns: 2t, 2t+1, 8+2t, 9+2t
  const int rows[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};

  // ---- scores s[u][k] of row rows[k] of chunk u of stage i, head g (log2 units), unmasked ----
  auto stage_raw = [&](int i, float(&s)[NSUB][4]) {
    const uint8_t* stg = wbuf + (i % C::STAGES) * C::STAGE;
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      const uint8_t* kc = stg + u * C::SUB;
      const uint8_t* ksc = kc + 2 * kChunk * C::SR;
      if constexpr (F == dfmt::f16) {
        float cc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const uint8_t* base = kc + ((lane & 7) + 8 * (lane >> 4)) * C::SR + 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
          uint32_t r[4];
          ldsm_x4(r, base + 32 * ks);
          mma_f16(cc[0], qa0[ks], 0u, qa2[ks], 0u, r[0], r[1]);
          mma_f16(cc[1], qa0[ks], 0u, qa2[ks], 0u, r[2], r[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          s[u][2 * n] = cc[n][0] * sfac;
          s[u][2 * n + 1] = cc[n][1] * sfac;
        }
      } else {
        uint32_t kw[4][(S::NS + 1) / 2];
#pragma unroll
        for (int k = 0; k < 4; ++k) load_scale_words<S::NS>(ksc + rows[k] * S::NS * 2, kw[k]);
        s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.0f;
#pragma unroll
        for (int bb = 0; bb < S::NB; ++bb) {
          const bool last_partial = S::PARTIAL && bb == S::NB - 1;
          const int si = S::scale_index(bb);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const uint8_t* row = kc + (8 * n + g) * C::SR;
            uint32_t b0, b1;
            if constexpr (F == dfmt::q4) {
              const uint32_t w = (last_partial && t >= 2) ? 0u : lds32(row + 16 * bb + 4 * t);
              b0 = w & 0x0F0F0F0Fu;
              b1 = (w >> 4) & 0x0F0F0F0Fu;
            } else {
              b0 = lds32(row + 32 * bb + 4 * t);
              b1 = last_partial ? 0u : lds32(row + 32 * bb + 16 + 4 * t);
            }
            // q4: one constant accumulator for every score MMA; q8 keeps (kBias, kBias, 0, 0), which
            // its register allocation prefers
            int cc[4] = {kBias, kBias, F == dfmt::q4 ? kBias : 0, F == dfmt::q4 ? kBias : 0};
            mma_s8(cc, qa0[bb], 0u, qa2[bb], 0u, b0, b1);
            // exact block dots: kBias + raw read as a float is 1.5 * 2^23 + raw, and qbias is 1.5 * 2^23
            // + 8 * the query sum (q4), all integers below 2^24
            float d0 = __int_as_float(cc[0]) - qbias[bb], d1 = __int_as_float(cc[1]) - qbias[bb];
            if constexpr (Q16) {
              // int16 query: dot = 254 dot(hi) + dot(lo), each |.| < 2^22 (exact through the bias);
              // one FMA rounds the exact sum once, as the CPU's int32 -> float conversion does
              int cl[4] = {kBias, kBias, 0, 0};
              mma_s8(cl, ql0[bb], 0u, ql2[bb], 0u, b0, b1);
              d0 = fmaf(254.0f, d0, __int_as_float(cl[0]) - kBiasF);
              d1 = fmaf(254.0f, d1, __int_as_float(cl[1]) - kBiasF);
            }
            if constexpr (C::NQS > 1) {  // the query scale of this K scale group (NQS == 1: in sfac)
              d0 *= qsc[si];
              d1 *= qsc[si];
            }
            s[u][2 * n] = fmaf(scale_at(kw[2 * n], si), d0, s[u][2 * n]);
            s[u][2 * n + 1] = fmaf(scale_at(kw[2 * n + 1], si), d1, s[u][2 * n + 1]);
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) s[u][k] *= sfac;
      }
    }
  };
  // softcap, rows past the item's end, rows before a sliding window
  auto stage_mask = [&](int i, float(&s)[NSUB][4]) {
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      const int c = i * NSUB + u;
      const int tok = chunk_tok(c);
      const int nvalid = c < my_chunks ? min(kChunk, t1 - tok) : 0;
      if (a.softcap_log2 > 0.0f) {
#pragma unroll
        for (int k = 0; k < 4; ++k) s[u][k] = softcap_log2(s[u][k], a.softcap_log2);
      }
      if (nvalid < kChunk) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (rows[k] >= nvalid) s[u][k] = -INFINITY;
      }
      if (a.seq_lo) {  // sliding window: rows before the first visible token of the sequence
        const int skip = a.seq_lo[seq] - tok;
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (rows[k] < skip) s[u][k] = -INFINITY;
      }
    }
  };

  for (int i = 0; i < my_steps; ++i) {
    cp_async_wait<C::STAGES - 2>();
    __syncwarp();
    issue(i + C::STAGES - 1);
    float s[NSUB][4];
    stage_raw(i, s);
    stage_mask(i, s);
    const uint8_t* stg = wbuf + (i % C::STAGES) * C::STAGE;

    // ---- online softmax (log2 domain) over the stage's NSUB chunks, one row (head g) per 4 lanes ----
    float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[0][2], s[0][3]));
#pragma unroll
    for (int u = 1; u < NSUB; ++u) mx = fmaxf(mx, fmaxf(fmaxf(s[u][0], s[u][1]), fmaxf(s[u][2], s[u][3])));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = ex2(m_run - m_use);
    float p[NSUB][4];
    float psum = 0.0f;
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) p[u][k] = ex2(s[u][k] - m_use);
      psum += (p[u][0] + p[u][1]) + (p[u][2] + p[u][3]);
    }
    d_run = d_run * alpha + psum;
    m_run = m_new;
    if (__any_sync(kFull, alpha != 1.0f)) {  // lazy rescale: skipped once the maxima settle
      const float al0 = __shfl_sync(kFull, alpha, 8 * t), al1 = __shfl_sync(kFull, alpha, 8 * t + 4);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        acc[mt][0] *= al0;
        acc[mt][1] *= al1;
        acc[mt][2] *= al0;
        acc[mt][3] *= al1;
      }
    }

    // ---- P·V ----
    if constexpr (F == dfmt::f16) {
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
        const uint32_t pb0 = pack_half2(p[u][0], p[u][1]), pb1 = pack_half2(p[u][2], p[u][3]);
        const uint8_t* vc = stg + u * C::SUB + kChunk * C::SR;
        const uint8_t* base = vc + ((lane & 7) + 8 * (lane >> 4)) * C::SR + 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          uint32_t r[4];
          ldsm_x4_trans(r, base + 32 * mt);
          mma_f16(acc[mt], r[0], r[1], r[2], r[3], pb0, pb1);
        }
      }
    } else {
      if (i == 0) {  // exact power of two that brings this warp's V scales near 1 in f16
        float vmax = 0.0f;
        for (int k = lane; k < NSUB * kChunk * S::NS; k += 32) {
          const int u = k / (kChunk * S::NS), kk = k % (kChunk * S::NS);
          const uint8_t* vsc = stg + u * C::SUB + 2 * kChunk * C::SR + C::SCALE_BYTES;
          vmax = fmaxf(vmax, __half2float(reinterpret_cast<const __half*>(vsc)[kk]));
        }
        vmax = warp_max(vmax);
        int e = 0;
        if (vmax > 0.0f) frexpf(vmax, &e);
        e = max(e, -15);  // p * 2^-e stays <= 2^15 in f16
        pscale = ldexpf(1.0f, -e);
        inv_pscale = ldexpf(1.0f, e);
      }
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
        const uint8_t* vc = stg + u * C::SUB + kChunk * C::SR;
        const uint8_t* vsc = vc + kChunk * C::SR + C::SCALE_BYTES;
        // P' = f16(p * 2^-e) * f16 V scale, in f16x2 (two roundings of 2^-11: far below the 1e-3 budget)
        const uint32_t ph01 = pack_half2(p[u][0] * pscale, p[u][1] * pscale),
                       ph23 = pack_half2(p[u][2] * pscale, p[u][3] * pscale);
        uint32_t vw[4][(S::NS + 1) / 2];
#pragma unroll
        for (int k = 0; k < 4; ++k) load_scale_words<S::NS>(vsc + rows[k] * S::NS * 2, vw[k]);
#pragma unroll
        for (int bb = 0; bb < S::NB; ++bb) {
          const int si = S::scale_index(bb);
          const unsigned sel = (si & 1) ? 0x7632u : 0x5410u;
          const uint32_t pb0 = hmul2_u32(ph01, __byte_perm(vw[0][si >> 1], vw[1][si >> 1], sel));
          const uint32_t pb1 = hmul2_u32(ph23, __byte_perm(vw[2][si >> 1], vw[3][si >> 1], sel));
          const bool last_partial = S::PARTIAL && bb == S::NB - 1;
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint8_t* row = vc + rows[k] * C::SR;
            if constexpr (F == dfmt::q4)
              w[k] = (last_partial && (g & 3) >= 2) ? 0u : lds32(row + 16 * bb + 4 * (g & 3));
            else w[k] = (last_partial && g >= 4) ? 0u : lds32(row + 32 * bb + 4 * g);
          }
#pragma unroll
          for (int mu = 0; mu < 2; ++mu) {
            uint32_t x[4];
            if constexpr (F == dfmt::q4) {
              // one byte of tokens (2t, 2t+1) and of (8+2t, 9+2t); A rows g <- its low nibbles (x[0],
              // x[2]), g + 8 <- its high nibbles (x[1], x[3]), both exact f16 (u - 8)
              const uint32_t pa = __byte_perm(w[0], w[1], q4_sel[mu]), pb = __byte_perm(w[2], w[3], q4_sel[mu]);
              x[0] = q4_lo_f16(pa);
              x[1] = q4_hi_f16(pa);
              x[2] = q4_lo_f16(pb);
              x[3] = q4_hi_f16(pb);
            } else {
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                // r: 0 = (tokens 2t, 2t+1; byte 2mu), 1 = (same tokens; byte 2mu+1), 2, 3 = tokens 8+2t, 9+2t
                const uint32_t pr = pair_bytes(w[(r >> 1) * 2], w[(r >> 1) * 2 + 1], 2 * mu + (r & 1));
                x[r] = hsub2_u32((pr & 0x00FF00FFu) ^ 0x64806480u, 0x64806480u);
              }
            }
            // A rows (q8): g <- byte 2mu (x[0] tokens 2t.., x[2] tokens 8+2t..), g + 8 <- byte 2mu + 1
            mma_f16(acc[2 * bb + mu], x[0], x[1], x[2], x[3], pb0, pb1);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- merge the 4 warps' states in shared memory ----
  d_run += __shfl_xor_sync(kFull, d_run, 1);
  d_run += __shfl_xor_sync(kFull, d_run, 2);
  __syncthreads();
  float* ow = reinterpret_cast<float*>(smem);                                 // [warp][8][HD]
  float2* mdw = reinterpret_cast<float2*>(smem + kWarps * kMaxGroup * HD * 4);  // [warp][8]
  if (t == 0) mdw[warp * kMaxGroup + g] = make_float2(my_chunks > 0 ? m_run : -INFINITY, d_run);
  float* o0 = ow + (warp * kMaxGroup + 2 * t) * HD;  // head 2t
  float* o1 = o0 + HD;                                // head 2t + 1
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) {
    int ch0, ch1;
    float f;
    bool ok;
    if constexpr (F == dfmt::q4) {
      ok = pv_out_channels_q4<HD>(mt, g, ch0, ch1);
      f = inv_pscale;
    } else {
      ok = pv_out_channels<F, HD>(mt, g, inv_pscale, ch0, ch1, f);
    }
    if (ok) {
      o0[ch0] = acc[mt][0] * f;
      o1[ch0] = acc[mt][1] * f;
      o0[ch1] = acc[mt][2] * f;
      o1[ch1] = acc[mt][3] * f;
    }
  }
  __syncthreads();
  const int64_t wsb = (int64_t)work * a.ng;  // work = item * n_kv_head + h
  for (int i = threadIdx.x; i < a.ng * HD; i += kThreads) {
    const int hh = i / HD, c = i % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, mdw[w * kMaxGroup + hh].x);
    float o = 0.0f, d = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 md = mdw[w * kMaxGroup + hh];
      if (md.x != -INFINITY) {
        const float e = ex2(md.x - M);
        o += e * ow[(w * kMaxGroup + hh) * HD + c];
        d += e * md.y;
      }
    }
    a.ws_o[(wsb + hh) * HD + c] = o;
    if (c == 0) a.ws_md[wsb + hh] = make_float2(M, d);
  }
  __syncthreads();  // shared memory is reused by the next work item
  }
}

struct merge_args {
  const float* ws_o;
  const float2* ws_md;
  const int* item_ptr;  // [batch + 1]
  const void* q;
  const uint16_t* ek;   // exact window [batch][n_kv_head][cap][HD] f16
  const uint16_t* ev;
  const int32_t* elen;  // [batch] or nullptr
  const int32_t* eslot;  // [batch] slot of each sequence's exact rows, or nullptr (slot = sequence)
  const int32_t* gap_lo;  // [batch] rows [gap_lo, gap_hi) of [0, elen) skipped, or nullptr
  const int32_t* gap_hi;
  void* out;            // [batch][n_head][HD]
  int ecap;
  int q_bf16, out_f16;
  int n_head, n_kv_head, ng;
  float sm_scale_log2;
  float softcap_log2;  // as decode_args
  int rot_block;       // the query's rotation (K's basis of the exact rows)
  float rot_scale;
  int out_rot_block;  // the output's inverse rotation (V's basis; kivi4: K unrotated, V rotated)
  float out_rot_scale;
  const float* k_lambda;  // as decode_args
  const int32_t* stat_row;
};

template <int HD>
constexpr int merge_smem_bytes(int cap) {
  // sc[cap] rounded up to whole 16-byte words plus one: compute-sanitizer saw the P·V loop's shared
  // loads reach 12 bytes past sc[cap - 1] when a query attended all cap rows (cap 205)
  return (2 * HD + 64 + (cap + 3) / 4 * 4 + 4) * 4;
}

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kWarps; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// One block per (sequence, kv head, query head of the group): the exact window (f32 rotated q x f16
// rows), the merge of the work items' states (attn_state::merge in log2 units), o / d, the inverse
// rotation, the store.
template <int HD>
__global__ void __launch_bounds__(kThreads) merge_kernel(merge_args a) {
  detail::pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  extern __shared__ __align__(16) float fm[];
  float* qf = fm;         // [HD] rotated query
  float* of = qf + HD;    // [HD] exact-window o, then the output
  float* red = of + HD;   // [64] reductions
  float* sc = red + 64;   // [cap] exact-window scores, then probabilities
  const int seq = blockIdx.x, h = blockIdx.y, hh = blockIdx.z, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gl = a.gap_lo ? a.gap_lo[seq] : 0, gw = a.gap_lo ? a.gap_hi[seq] - gl : 0;
  const int ne = a.elen ? a.elen[seq] - gw : 0;  // rows attended; index j is row j, or j + gw past the gap
  const int64_t qrow = (int64_t)seq * a.n_head + (int64_t)h * a.ng + hh;
  float m_e = -INFINITY, d_e = 0.0f;
  if (ne > 0) {
    const float* lam = k_lambda_row<HD>(a.k_lambda, a.stat_row, seq, a.n_kv_head, h);
    for (int c = threadIdx.x; c < HD; c += kThreads) qf[c] = lambda_scaled(load_elem(a.q, qrow * HD + c, a.q_bf16 != 0), lam, c);
    if (a.rot_block > 1) fwht_rows_block(qf, 1, HD, a.rot_block, a.rot_scale);
    else __syncthreads();
    const int64_t eb = ((int64_t)(a.eslot ? a.eslot[seq] : seq) * a.n_kv_head + h) * a.ecap * HD;
    const __half* kb = reinterpret_cast<const __half*>(a.ek) + eb;
    const __half* vb = reinterpret_cast<const __half*>(a.ev) + eb;
    for (int j = warp; j < ne; j += kWarps) {
      const int64_t r = j < gl ? j : j + gw;
      float dot = 0.0f;
      for (int c = lane; c < HD; c += 32) dot = fmaf(qf[c], __half2float(kb[r * HD + c]), dot);
      dot = warp_sum(dot);
      if (lane == 0) sc[j] = softcap_log2(dot * a.sm_scale_log2, a.softcap_log2);
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < ne; j += kThreads) m = fmaxf(m, sc[j]);
    m_e = block_reduce(m, red, true);
    float d = 0.0f;
    for (int j = threadIdx.x; j < ne; j += kThreads) {
      const float p = ex2(sc[j] - m_e);
      sc[j] = p;
      d += p;
    }
    d_e = block_reduce(d, red + 8, false);  // contains the barrier that publishes sc
    for (int c = threadIdx.x; c < HD; c += kThreads) {
      float o = 0.0f;
      for (int j = 0; j < ne; ++j) o = fmaf(sc[j], __half2float(vb[(int64_t)(j < gl ? j : j + gw) * HD + c]), o);
      of[c] = o;
    }
  }
  const int i0 = a.item_ptr[seq], i1 = a.item_ptr[seq + 1];
  const int64_t stride = (int64_t)a.n_kv_head * a.ng;  // states between consecutive items
  const int64_t k0 = ((int64_t)i0 * a.n_kv_head + h) * a.ng + hh;
  float m = -INFINITY;
  for (int it = threadIdx.x; it < i1 - i0; it += kThreads) m = fmaxf(m, a.ws_md[k0 + it * stride].x);
  const float M = fmaxf(block_reduce(m, red + 16, true), m_e);
  for (int c = threadIdx.x; c < HD; c += kThreads) {
    float o = 0.0f, d = 0.0f;
    if (ne > 0) {
      const float e = ex2(m_e - M);
      o = of[c] * e;
      d = d_e * e;
    }
    int it = 0;
    for (; it + 4 <= i1 - i0; it += 4) {  // four states in flight
      float2 md[4];
      float x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        md[u] = a.ws_md[k0 + (it + u) * stride];
        x[u] = a.ws_o[(k0 + (it + u) * stride) * HD + c];
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float e = ex2(md[u].x - M);
        o = fmaf(e, x[u], o);
        d = fmaf(e, md[u].y, d);
      }
    }
    for (; it < i1 - i0; ++it) {
      const float2 md = a.ws_md[k0 + it * stride];
      const float e = ex2(md.x - M);
      o = fmaf(e, a.ws_o[(k0 + it * stride) * HD + c], o);
      d = fmaf(e, md.y, d);
    }
    of[c] = d > 0.0f ? o * (1.0f / d) : 0.0f;
  }
  if (a.out_rot_block > 1) fwht_rows_block(of, 1, HD, a.out_rot_block, a.out_rot_scale);  // Hadamard: its own inverse
  else __syncthreads();
  for (int c = threadIdx.x; c < HD; c += kThreads) {
    if (a.out_f16) reinterpret_cast<__half*>(a.out)[qrow * HD + c] = __float2half_rn(of[c]);
    else reinterpret_cast<float*>(a.out)[qrow * HD + c] = of[c];
  }
}

int round16(int64_t n) { return (int)((n + 15) / 16 * 16); }

}  // namespace

struct decode_plan::impl {
  paged_kv_format f;
  paged_kv_geometry geo;
  decode_params p;
  int batch = 0, ng = 0, exact_cap = 0, n_items = 0, split = 0;
  int dec_smem = 0, merge_smem = 0, grid = 0;
  int4* items = nullptr;
  int* item_ptr = nullptr;
  int* seq_lo = nullptr;  // [batch] (sliding window or body_lo only)
  bool tiles = false;     // kivi4 prompt chunk in query tiles (decode_params::kivi_tiles)
  int* tile_len = nullptr;  // [batch] body rows per entry (tiles)
  int last_pages = 0;       // indptr[batch - 1] (tiles: the page list every entry reads a prefix of)
  float* ws_o = nullptr;
  float2* ws_md = nullptr;
  size_t ws_bytes = 0;

  ~impl() {
    cudaFree(items);
    cudaFree(item_ptr);
    cudaFree(seq_lo);
    cudaFree(tile_len);
    cudaFree(ws_o);
    cudaFree(ws_md);
  }
};

decode_plan::decode_plan(const paged_kv_format& f, const decode_params& p, const int32_t* indptr_host,
                         const int32_t* last_page_len_host, int batch, int exact_cap)
    : p_(std::make_unique<impl>()) {
  require();
  impl& s = *p_;
  s.f = f;
  s.geo = paged_kv_geometry_of(f);
  s.p = p;
  if (p.n_head < f.n_kv_head || p.n_head % f.n_kv_head != 0 || p.n_head / f.n_kv_head > kMaxGroup)
    fail_unsupported("[cuda attn_decode] n_head " + std::to_string(p.n_head) + " must be a multiple of n_kv_head " +
                     std::to_string(f.n_kv_head) + " with at most " + std::to_string(kMaxGroup) + " query heads per kv head");
  if (!std::isfinite(p.spec.scale)) fail_input("[cuda attn_decode] scale must be finite");
  if (p.spec.window < 0) fail_input("[cuda attn_decode] window must be >= 0, got " + std::to_string(p.spec.window));
  if (!(p.spec.softcap >= 0.0f) || !std::isfinite(p.spec.softcap))
    fail_input("[cuda attn_decode] softcap must be finite and >= 0, got " + std::to_string(p.spec.softcap));
  if (p.body_lo < 0) fail_input("[cuda attn_decode] body_lo must be >= 0, got " + std::to_string(p.body_lo));
  if (p.spec.window > 0 && exact_cap > 0)
    fail_unsupported("[cuda attn_decode] a sliding window (window " + std::to_string(p.spec.window) +
                     ") with an exact window view: the exact rows carry no positions");
  if (p.q_elem == kv_elem::f32) fail_unsupported("[cuda attn_decode] queries must be f16 or bf16, got f32");
  if (p.out_elem == kv_elem::bf16) fail_unsupported("[cuda attn_decode] output must be f32 or f16, got bf16");
  if (p.split_tokens < 0 || p.split_tokens % 16 != 0)
    fail_input("[cuda attn_decode] split_tokens must be 0 (auto) or a positive multiple of 16, got " +
               std::to_string(p.split_tokens));
  if (batch < 0) fail_input("[cuda attn_decode] batch must be >= 0, got " + std::to_string(batch));
  if (exact_cap < 0 || exact_cap > 1024)
    fail_unsupported("[cuda attn_decode] exact window capacity must be in [0, 1024], got " + std::to_string(exact_cap));
  if (batch > 0 && (!indptr_host || !last_page_len_host))
    fail_input("[cuda attn_decode] host copies of indptr and last_page_len are required");
  s.batch = batch;
  s.ng = p.n_head / f.n_kv_head;
  s.exact_cap = exact_cap;

  // kernel attributes and occupancy
  int occ = 1, sms = 1, dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  const bool kivi = f.format == kv_format::kivi4;
  if (kivi) {
    dispatch_format_hd(dfmt::f16, f.head_dim, [&](auto, auto hc) {
      constexpr int HD = decltype(hc)::value;
      s.merge_smem = merge_smem_bytes<HD>(exact_cap);
      check(cudaFuncSetAttribute(merge_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, s.merge_smem),
            "cudaFuncSetAttribute(merge)");
    });
    occ = kivi_decode_blocks_per_sm(f.head_dim, s.ng);
  } else
    dispatch_format_hd(to_dfmt(f.format), f.head_dim, [&](auto fc, auto hc) {
      constexpr dfmt F = decltype(fc)::value;
      constexpr int HD = decltype(hc)::value;
      s.dec_smem = cfg<F, HD>::SMEM;
      s.merge_smem = merge_smem_bytes<HD>(exact_cap);
      check(cudaFuncSetAttribute(decode_kernel<F, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, s.dec_smem),
            "cudaFuncSetAttribute(decode)");
      check(cudaFuncSetAttribute(merge_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, s.merge_smem),
            "cudaFuncSetAttribute(merge)");
      check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, decode_kernel<F, HD>, kThreads, s.dec_smem),
            "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    });
  if (occ < 1)
    fail_unsupported("[cuda attn_decode] the decode kernel does not fit on this GPU (shared memory " +
                     std::to_string(s.dec_smem) + " bytes)");

  // sequence lengths and the split-KV work list
  std::vector<int64_t> len(batch);   // tokens of the paged body
  std::vector<int32_t> lo(batch, p.body_lo);  // first token the decode query sees (key_range, body_lo)
  std::vector<int64_t> beg(batch, 0); // first token of the first item: lo rounded down to a chunk
  int64_t total = 0;
  for (int b = 0; b < batch; ++b) {
    const int32_t np = indptr_host[b + 1] - indptr_host[b];
    if (np < 0) fail_input("[cuda attn_decode] indptr must be non-decreasing (sequence " + std::to_string(b) + ")");
    if (np > 0 && (last_page_len_host[b] < 1 || last_page_len_host[b] > f.page_size))
      fail_input("[cuda attn_decode] last_page_len[" + std::to_string(b) + "] = " + std::to_string(last_page_len_host[b]) +
                 " must be in [1, page_size " + std::to_string(f.page_size) + "]");
    len[b] = np > 0 ? (int64_t)(np - 1) * f.page_size + last_page_len_host[b] : 0;
    if (len[b] > INT32_MAX - 64) fail_unsupported("[cuda attn_decode] sequence " + std::to_string(b) + " is too long");
    if (len[b] > 0)
      lo[b] = std::max(p.spec.key_range((int)len[b] - 1).lo, p.body_lo);  // the query sits at the last token
    beg[b] = lo[b] / kChunk * kChunk;
    len[b] = lo[b] < len[b] ? len[b] - beg[b] : 0;  // from here on: the tokens the items cover
    total += len[b];
  }
  // Split-KV: the grid is persistent (at most `slots` blocks looping over (item, kv head) work), so
  // the item length T is chosen to minimise waves(T) * (T + fixed cost), the makespan of equal items.
  const int64_t slots = (int64_t)sms * occ;
  auto items_of = [&](int64_t T, int64_t* maxper) {
    int64_t n = 0, mx = 0;
    for (int b = 0; b < batch; ++b) {
      if (len[b] == 0) continue;
      const int64_t k = (len[b] + T - 1) / T;
      n += k;
      mx = std::max<int64_t>(mx, round16((len[b] + k - 1) / k));
    }
    *maxper = mx;
    return n;
  };
  int64_t split = p.split_tokens;
  int64_t maxlen = 0;
  for (int64_t l : len) maxlen = std::max(maxlen, l);
  s.tiles = kivi && p.kivi_tiles && kivi_tiles_supported(f.head_dim) && batch > 0 && p.spec.window == 0;
  if (s.tiles) {
    for (int b = 1; b < batch; ++b)
      if (len[b] < len[b - 1] || indptr_host[b + 1] - indptr_host[b] < indptr_host[b] - indptr_host[b - 1])
        fail_input("[cuda attn_decode] kivi_tiles: entry " + std::to_string(b) +
                   " holds fewer body rows or pages than entry " + std::to_string(b - 1) +
                   " (the entries must be a prompt chunk's queries in order)");
    split = std::max<int64_t>(64, round16(maxlen));  // one work item per entry
  }
  if (split == 0 && !s.tiles && split_tokens_env() > 0) split = std::max<int64_t>(64, round16(split_tokens_env()));
  if (split == 0) {
    constexpr int64_t kFixed = 96;  // per-item cost in token equivalents (query prep, pipeline fill, merge)
    double best = 1e300;
    split = 64;
    const int64_t step = std::max<int64_t>(16, round16(maxlen / 4096));  // at most ~4096 candidates
    for (int64_t T = 64; T <= std::max<int64_t>(64, round16(maxlen)); T += step) {
      int64_t mx = 0;
      const int64_t n = items_of(T, &mx) * f.n_kv_head;
      const double cost = (double)((n + slots - 1) / slots) * (double)(mx + kFixed);
      if (cost < best) {
        best = cost;
        split = T;
      }
    }
  }
  std::vector<int4> items;
  std::vector<int> item_ptr(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    item_ptr[b] = (int)items.size();
    if (len[b] == 0) continue;
    const int64_t n = (len[b] + split - 1) / split;
    const int per = round16((len[b] + n - 1) / n);  // even items, multiples of 16 (chunks never straddle)
    for (int64_t t0 = 0; t0 < len[b]; t0 += per)
      items.push_back(make_int4(b, (int)(beg[b] + t0), (int)(beg[b] + std::min<int64_t>(len[b], t0 + per)),
                                indptr_host[b]));
  }
  item_ptr[batch] = (int)items.size();
  s.n_items = (int)items.size();
  s.split = (int)split;
  s.grid = (int)std::min<int64_t>((int64_t)s.n_items * f.n_kv_head, slots);
  const size_t n_states = (size_t)std::max(s.n_items, 1) * f.n_kv_head * s.ng;
  check(cudaMalloc(&s.items, std::max<size_t>(1, items.size()) * sizeof(int4)), "cudaMalloc(items)");
  check(cudaMalloc(&s.item_ptr, (batch + 1) * sizeof(int)), "cudaMalloc(item_ptr)");
  check(cudaMalloc(&s.ws_o, n_states * f.head_dim * sizeof(float)), "cudaMalloc(workspace)");
  check(cudaMalloc(&s.ws_md, n_states * sizeof(float2)), "cudaMalloc(workspace)");
  s.ws_bytes = n_states * (f.head_dim * sizeof(float) + sizeof(float2)) + items.size() * sizeof(int4) + (batch + 1) * sizeof(int);
  if (!items.empty()) copy_to_device(s.items, items.data(), items.size() * sizeof(int4));
  copy_to_device(s.item_ptr, item_ptr.data(), (batch + 1) * sizeof(int));
  if (s.tiles) {
    std::vector<int> tl(batch);
    for (int b = 0; b < batch; ++b) tl[b] = (int)len[b];
    check(cudaMalloc(&s.tile_len, batch * sizeof(int)), "cudaMalloc(tile_len)");
    copy_to_device(s.tile_len, tl.data(), batch * sizeof(int));
    s.last_pages = indptr_host[batch - 1];
    s.ws_bytes += batch * sizeof(int);
  }
  if ((p.spec.window > 0 || p.body_lo > 0) && batch > 0) {
    check(cudaMalloc(&s.seq_lo, batch * sizeof(int)), "cudaMalloc(seq_lo)");
    copy_to_device(s.seq_lo, lo.data(), batch * sizeof(int));
    s.ws_bytes += batch * sizeof(int);
  }
}

decode_plan::~decode_plan() = default;

bool decode_plan::update(const int32_t* indptr_host, const int32_t* last_page_len_host, void* stream) {
  impl& s = *p_;
  if (s.batch == 0 || s.p.spec.window > 0 || !indptr_host || !last_page_len_host) return false;
  std::vector<int4> items;
  std::vector<int> item_ptr(s.batch + 1, 0);
  for (int b = 0; b < s.batch; ++b) {
    const int32_t np = indptr_host[b + 1] - indptr_host[b];
    if (np < 0 || (np > 0 && (last_page_len_host[b] < 1 || last_page_len_host[b] > s.f.page_size))) return false;
    const int64_t n_tok = np > 0 ? (int64_t)(np - 1) * s.f.page_size + last_page_len_host[b] : 0;
    item_ptr[b] = (int)items.size();
    // the constructor's items with its split (no window: every item starts at body_lo's chunk; seq_lo
    // holds body_lo for every sequence, unchanged)
    if (n_tok <= s.p.body_lo) continue;
    const int64_t beg = s.p.body_lo / kChunk * kChunk, len = n_tok - beg;
    const int64_t n = (len + s.split - 1) / s.split;
    const int per = round16((len + n - 1) / n);
    for (int64_t t0 = 0; t0 < len; t0 += per)
      items.push_back(make_int4(b, (int)(beg + t0), (int)(beg + std::min<int64_t>(len, t0 + per)), indptr_host[b]));
  }
  item_ptr[s.batch] = (int)items.size();
  if ((int)items.size() != s.n_items) return false;  // the launch would change: make a new plan
  const cudaStream_t st = as_stream(stream);
  check(cudaMemcpyAsync(s.items, items.data(), items.size() * sizeof(int4), cudaMemcpyHostToDevice, st),
        "cudaMemcpyAsync(items)");
  check(cudaMemcpyAsync(s.item_ptr, item_ptr.data(), (s.batch + 1) * sizeof(int), cudaMemcpyHostToDevice, st),
        "cudaMemcpyAsync(item_ptr)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");  // the host vectors go out of scope
  return true;
}

int decode_plan::n_items() const { return p_->n_items; }
int decode_plan::split_tokens() const { return p_->split; }
size_t decode_plan::workspace_bytes() const { return p_->ws_bytes; }

void decode_plan::run(const paged_kv_view& kv, const void* q, void* out, const exact_window_view* exact,
                      void* stream) const {
  const impl& s = *p_;
  const paged_kv_format& f = kv.format;
  if (f.format != s.f.format || f.head_dim != s.f.head_dim || f.n_kv_head != s.f.n_kv_head ||
      f.page_size != s.f.page_size || f.rotation != s.f.rotation || kv.batch != s.batch)
    fail_input("[cuda attn_decode] the view's format or batch differs from the plan's");
  if (s.batch == 0) return;
  if (!kv.pool || !kv.indptr || !kv.indices || !q || !out)
    fail_input("[cuda attn_decode] pool, indptr, indices, q and out must be device pointers");
  check_k_lambda(kv, "[cuda attn_decode]");
  if (exact && exact->len && (!exact->k || !exact->v || exact->cap > s.exact_cap || exact->cap < 1))
    fail_input("[cuda attn_decode] exact window: k, v required and cap in [1, plan's exact_cap " +
               std::to_string(s.exact_cap) + "]");
  if (exact && exact->len && (exact->gap_lo != nullptr) != (exact->gap_hi != nullptr))
    fail_input("[cuda attn_decode] exact window: gap_lo and gap_hi go together");
  const bool kivi = f.format == kv_format::kivi4;
  if (kivi && kv.k_lambda) fail_unsupported("[cuda attn_decode] kivi4 pages take no K channel scale");
  const cudaStream_t st = as_stream(stream);
  const float l2e = 1.4426950408889634f;
  dispatch_format_hd(kivi ? dfmt::f16 : to_dfmt(f.format), f.head_dim, [&](auto fc, auto hc) {
    constexpr dfmt F = decltype(fc)::value;
    constexpr int HD = decltype(hc)::value;
    if (kivi && s.tiles && s.n_items > 0) {
      kivi_tiles_args a;
      a.pool = kv.pool;
      a.geo = to_dev(s.geo, f.page_size);
      a.pages = kv.indices + s.last_pages;
      a.len = s.tile_len;
      a.item_ptr = s.item_ptr;
      a.q = q;
      a.ws_o = s.ws_o;
      a.ws_md = s.ws_md;
      a.batch = s.batch;
      a.q_bf16 = s.p.q_elem == kv_elem::bf16;
      a.n_head = s.p.n_head;
      a.n_kv_head = f.n_kv_head;
      a.ng = s.ng;
      a.qt = std::max(1, 64 / s.ng);
      a.sm_scale_log2 = s.p.spec.scale * l2e;
      a.softcap_log2 = s.p.spec.softcap * l2e;
      kivi_tiles_launch(HD, a, st);
    } else if (kivi && s.n_items > 0) {
      kivi_decode_args a;
      a.pool = kv.pool;
      a.geo = to_dev(s.geo, f.page_size);
      a.indices = kv.indices;
      a.items = s.items;
      a.q = q;
      a.ws_o = s.ws_o;
      a.ws_md = s.ws_md;
      a.n_work = s.n_items * f.n_kv_head;
      a.q_bf16 = s.p.q_elem == kv_elem::bf16;
      a.n_head = s.p.n_head;
      a.n_kv_head = f.n_kv_head;
      a.ng = s.ng;
      a.sm_scale_log2 = s.p.spec.scale * l2e;
      a.softcap_log2 = s.p.spec.softcap * l2e;
      a.seq_lo = s.seq_lo;
      kivi_decode_launch(HD, a, s.grid, st);
    } else if (s.n_items > 0) {
      decode_args a;
      a.pool = kv.pool;
      a.geo = to_dev(s.geo, f.page_size);
      a.indptr = kv.indptr;
      a.indices = kv.indices;
      a.items = s.items;
      a.q = q;
      a.ws_o = s.ws_o;
      a.ws_md = s.ws_md;
      a.n_work = s.n_items * f.n_kv_head;
      a.q_bf16 = s.p.q_elem == kv_elem::bf16;
      a.n_head = s.p.n_head;
      a.n_kv_head = f.n_kv_head;
      a.ng = s.ng;
      a.sm_scale_log2 = s.p.spec.scale * l2e;
      a.softcap_log2 = s.p.spec.softcap * l2e;
      a.seq_lo = s.seq_lo;
      a.rot_block = s.geo.rot_block;
      a.rot_scale = s.geo.rot_scale;
      a.k_lambda = kv.k_lambda;
      a.stat_row = kv.stat_row;
      detail::launch_pdl(decode_kernel<F, HD>, (unsigned)s.grid, kThreads, s.dec_smem, st, a);
      check_launch("attn_decode (decode_kernel)");
    }
    merge_args m;
    m.ws_o = s.ws_o;
    m.ws_md = s.ws_md;
    m.item_ptr = s.item_ptr;
    m.q = q;
    const bool has_exact = exact && exact->len;
    m.ek = has_exact ? exact->k : nullptr;
    m.ev = has_exact ? exact->v : nullptr;
    m.elen = has_exact ? exact->len : nullptr;
    m.ecap = has_exact ? exact->cap : 0;
    m.eslot = has_exact ? exact->slot : nullptr;
    m.gap_lo = has_exact ? exact->gap_lo : nullptr;
    m.gap_hi = has_exact ? exact->gap_hi : nullptr;
    m.out = out;
    m.q_bf16 = s.p.q_elem == kv_elem::bf16;
    m.out_f16 = s.p.out_elem == kv_elem::f16;
    m.n_head = s.p.n_head;
    m.n_kv_head = f.n_kv_head;
    m.ng = s.ng;
    m.sm_scale_log2 = s.p.spec.scale * l2e;
    m.softcap_log2 = s.p.spec.softcap * l2e;
    m.rot_block = kivi ? 0 : s.geo.rot_block;  // kivi4: K (and its exact rows) unrotated
    m.rot_scale = kivi ? 1.0f : s.geo.rot_scale;
    m.out_rot_block = s.geo.rot_block;
    m.out_rot_scale = s.geo.rot_scale;
    m.k_lambda = kv.k_lambda;
    m.stat_row = kv.stat_row;
    const int msmem = merge_smem_bytes<HD>(m.ecap);
    detail::launch_pdl(merge_kernel<HD>, dim3((unsigned)s.batch, (unsigned)f.n_kv_head, (unsigned)s.ng), kThreads, msmem,
                       st, m);
    check_launch("attn_decode (merge_kernel)");
  });
}

}  // namespace kvq::cuda
