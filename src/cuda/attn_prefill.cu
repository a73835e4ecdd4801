// Causal prefill attention over the paged cache, computed on the packed codes (docs/cuda.md,
// "Prefill kernel"). FlashAttention-2 (Dao 2023, Sec. 3.1-3.2) tiling on the decode kernel's
// arithmetic (attn_decode.cu):
//
// Block = (tile of 64 query rows, kv head); 4 warps of 16 rows each. The rows of a sequence for kv
// head h are its queries x the GQA group flattened token-major (row = token * ng + head of the
// group), so a tile holds whole groups and no row is padding except at the sequence's end. The
// block walks the keys [0, last visible position] in tiles of 64 tokens, loaded once into shared
// memory by all 128 threads through a cp.async pipeline and read by the 4 warps; tiles past the
// block's last query are never loaded, 16-token sub-tiles past a warp's last query are skipped, and
// only sub-tiles that cross a row's position are masked (causal).
//   scores  S[row][tok] = mma.m16n8k32 s8 (rows = 16 query rows of the warp): the rotated query
//           quantized per K scale group exactly as the decode kernel and kv_cache_quant do (q4 K:
//           int8; q8 K: int16 as two int8 MMAs, 254 hi + lo) x K codes, the int32 block dots read
//           through the 1.5 * 2^23 bias, times the query scale and the f16 K scale; f16: f16 MMA.
//   P·V     O^T[channel][row] = mma.m16n8k16 f16, the V codes turned into exact f16 (u - 8) as A,
//           P' = f16(p 2^-e) * V scale as B, two MMAs (rows 0-7, 8-15) per A fragment.
// Online softmax in f32 (log2 domain) per row. A block owns its rows' whole key range, and its
// epilogue normalises, undoes the V rotation and stores directly, unless the plan splits long
// tiles over the keys (split-KV, see prefill_plan): then each part stores its unnormalised state
// and a second kernel merges the parts.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

using namespace detail;

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // query rows per block (16 per warp: one MMA M tile)
constexpr int kKeys = 64;           // key tokens per pipeline stage
constexpr int kSub = 16;            // key tokens per warp step (two MMA N tiles)
constexpr int kBias = 0x4B400000;   // float 1.5 * 2^23 as int: bias of the int32 accumulators
constexpr float kBiasF = 12582912.0f;
constexpr unsigned kFull = 0xffffffffu;

// One block's work: rows [row0, row0 + 64) of sequence seq (row = token * ng + head of the group)
// against keys [k_begin, k_end) (the whole visible range, or one part of it: split-KV).
struct tile_desc {
  int seq, row0;
  int qo0;    // first query row of the sequence in q / out (qo_indptr[seq])
  int pg0;    // first page-table entry of the sequence (indptr[seq])
  int pos0;   // position of the sequence's first query (kv_len - q_len)
  int q_len;  // queries of the sequence
  int k_begin, k_end;  // key range (k_begin a multiple of 64; k_end <= the rows' last position + 1)
  int ws;     // -1: store the output; else this part's slot in the workspace (unnormalised o, m, d)
};
// A split tile: its parts are workspace slots [ws0, ws0 + n_parts).
struct merge_desc {
  int row0, qo0, q_len, ws0, n_parts;
  int seq, pos0;  // the sequence (exact rows, stat_row) and the position of its first query
};

struct prefill_args {
  const uint8_t* pool;
  dev_geom geo;
  const int32_t* indices;
  const tile_desc* tiles;
  float* ws_o;    // [slots][n_kv_head][64][HD] unnormalised outputs of split parts (rotated basis)
  float2* ws_md;  // [slots][n_kv_head][64] {m (log2 units), d}
  const void* q;  // [n_q][n_head][HD]
  void* out;      // [n_q][n_head][HD]
  int q_bf16, out_f16;
  int n_head, n_kv_head, ng;
  float sm_scale_log2;
  float softcap_log2;
  int rot_block;
  float rot_scale;
  const float* k_lambda;    // K channel scale [rows][n_kv_head][HD] (q becomes q * lambda), or nullptr
  const int32_t* stat_row;  // [batch] row of k_lambda
  int body_lo;              // keys below it are masked (prefill_params::body_lo)
};

__device__ __forceinline__ float softcap_log2(float x, float c2) { return c2 > 0.0f ? c2 * tanhf(x / c2) : x; }

template <dfmt F, int HD>
struct pcfg {
  using S = shape<F, HD>;
  static constexpr int SR = S::CB % 16 == 0 ? S::CB + 16 : S::CB;  // smem row stride of K / V codes
  static constexpr int PS = S::CB % 16 == 0 ? 16 : 8;               // cp.async piece
  static constexpr int PPR = S::CB / PS;
  static constexpr int SCB = S::NS * 2;                             // scale bytes of one row
  static constexpr int SPS = SCB >= 16 ? 16 : SCB;                  // scale cp.async piece (4, 8, 16)
  static constexpr bool SCALE_ASYNC = S::NS > 0 && SCB % 4 == 0;
  static constexpr int STAGE = 2 * kKeys * SR + 2 * kKeys * SCB;
  static constexpr int STAGES = F == dfmt::f16 ? 2 : 3;
  static constexpr int PIPE = STAGES * STAGE;
  static constexpr int QF = kRows * HD * 4;  // f32 rotated queries (prologue), f32 outputs (epilogue)
  static constexpr int REGION0 = ((PIPE > QF ? PIPE : QF) + 15) / 16 * 16;
  static constexpr int QS = (F == dfmt::f16 ? 2 * HD : HD) + 16;  // smem row stride of the quantized queries
  static constexpr int QQ = (F == dfmt::q8 ? 2 : 1) * kRows * QS;
  static constexpr int NQS = S::NS > 0 ? S::NS : 1;
  static constexpr int SMEM = REGION0 + QQ + kRows * NQS * 4 + kRows * S::NB * 4;
  static constexpr int MT = F == dfmt::f16 ? HD / 16 : 2 * S::NB;  // P·V m16 tiles (channels)
};

template <int NS>
__device__ __forceinline__ void load_scale_words(const uint8_t* sp, uint32_t (&w)[(NS + 1) / 2]) {
#pragma unroll
  for (int q2 = 0; q2 < (NS + 1) / 2; ++q2) {
    if (2 * q2 + 1 < NS) {
      w[q2] = *reinterpret_cast<const uint32_t*>(sp + 4 * q2);  // rows are 2 * NS bytes: 4-aligned for even NS
    } else {
      w[q2] = reinterpret_cast<const uint16_t*>(sp)[2 * q2];
    }
  }
}
template <>
__device__ __forceinline__ void load_scale_words<3>(const uint8_t* sp, uint32_t (&w)[2]) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sp);  // 6-byte rows: 2-aligned only
  w[0] = (uint32_t)s[0] | (uint32_t)s[1] << 16;
  w[1] = s[2];
}

template <dfmt F, int HD>
__global__ void __launch_bounds__(kThreads) prefill_kernel(prefill_args a) {
  using S = shape<F, HD>;
  using C = pcfg<F, HD>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const tile_desc td = a.tiles[blockIdx.x / a.n_kv_head];
  const int h = blockIdx.x % a.n_kv_head, ng = a.ng;
  const int n_rows = td.q_len * ng;
  const int rows_here = min(kRows, n_rows - td.row0);
  const int kv_end = td.k_end;  // keys past it are zero-filled (and masked: past every row's position)
  const int j0 = td.k_begin / kKeys;
  const int n_kt = (kv_end + kKeys - 1) / kKeys - j0;
  const uint8_t* head_base = a.pool + (int64_t)h * a.geo.head_bytes;
  const int32_t* pages = a.indices + td.pg0;
  auto q_index = [&](int r) {  // element offset of block row r in q / out
    const int R = td.row0 + r;
    return ((int64_t)(td.qo0 + R / ng) * a.n_head + (int64_t)h * ng + R % ng) * HD;
  };

  // ---- queries: times lambda (K channel scale), rotate (f32), quantize per K scale group (int8 for
  // q4 K, int16 for q8 K) or f16 ----
  constexpr bool Q16 = F == dfmt::q8;
  constexpr float kQMax = Q16 ? (float)kq16_max : 127.0f;
  float* qf = reinterpret_cast<float*>(smem);  // [64][HD], aliases the pipeline (used before it starts)
  uint8_t* qq = smem + C::REGION0;             // [64][QS] int8 / f16; q8: two planes (hi, lo)
  float* qscale = reinterpret_cast<float*>(qq + C::QQ);               // [64][NQS]
  int* qsum = reinterpret_cast<int*>(qscale + kRows * C::NQS);        // [64][NB] (q4)
  const float* lam = k_lambda_row<HD>(a.k_lambda, a.stat_row, td.seq, a.n_kv_head, h);
  for (int i = threadIdx.x; i < kRows * HD; i += kThreads) {
    const int r = i / HD, c = i % HD;
    qf[i] = r < rows_here ? lambda_scaled(load_elem(a.q, q_index(r) + c, a.q_bf16 != 0), lam, c) : 0.0f;
  }
  if (a.rot_block > 1) fwht_rows_block(qf, kRows, HD, a.rot_block, a.rot_scale);
  else __syncthreads();
  if constexpr (F != dfmt::f16) {
    auto put = [&](int r, int c, int qc) {
      if constexpr (Q16) {
        const int hi = split_q16_hi(qc);
        reinterpret_cast<int8_t*>(qq)[r * C::QS + c] = (int8_t)hi;
        reinterpret_cast<int8_t*>(qq)[kRows * C::QS + r * C::QS + c] = (int8_t)(qc - 254 * hi);
      } else {
        reinterpret_cast<int8_t*>(qq)[r * C::QS + c] = (int8_t)qc;
      }
    };
    if constexpr (S::NS > 1) {  // 32-element groups: 8 lanes per group, 4 elements per lane
      for (int u = 4 * warp + (lane >> 3); u < kRows * C::NQS; u += 4 * kWarps) {
        const int e = u * 32 + 4 * (lane & 7);
        const int r = e / HD, c = e % HD;
        const float4 x = *reinterpret_cast<const float4*>(qf + e);
        float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
        const query_quant qz = query_quant_of(amax, kQMax);
        put(r, c, query_code(qz, x.x));
        put(r, c + 1, query_code(qz, x.y));
        put(r, c + 2, query_code(qz, x.z));
        put(r, c + 3, query_code(qz, x.w));
        if ((lane & 7) == 0) qscale[u] = qz.scale;
      }
    } else {  // one group per row (head_dim 80): one warp per row
      for (int r = warp; r < kRows; r += kWarps) {
        const float* x = qf + r * HD;
        float amax = 0.0f;
        for (int c = lane; c < HD; c += 32) amax = fmaxf(amax, fabsf(x[c]));
        const query_quant qz = query_quant_of(warp_max(amax), kQMax);
        for (int c = lane; c < HD; c += 32) put(r, c, query_code(qz, x[c]));
        if (lane == 0) qscale[r] = qz.scale;
      }
    }
    if constexpr (F == dfmt::q4) {  // sums of the int8 query per 32-element code block (the -8 offset)
      __syncthreads();
      for (int i = threadIdx.x; i < kRows * S::NB; i += kThreads) {
        const int r = i / S::NB, bb = i % S::NB;
        const int m = (S::PARTIAL && bb == S::NB - 1) ? 16 : 32;
        const int8_t* qr = reinterpret_cast<const int8_t*>(qq) + r * C::QS + 32 * bb;
        int sum = 0;
        for (int k = 0; k < m; ++k) sum += qr[k];
        qsum[i] = sum;
      }
    }
  } else {
    for (int i = threadIdx.x; i < kRows * HD; i += kThreads)
      reinterpret_cast<__half*>(qq + (i / HD) * C::QS)[i % HD] = __float2half_rn(qf[i]);
  }
  __syncthreads();  // qf is dead from here: the pipeline may overwrite it

  // ---- key pipeline: stage j holds keys [64 j, 64 j + 64): K rows, V rows, K scales, V scales ----
  auto issue = [&](int j) {
    if (j < n_kt) {
      uint8_t* dst = smem + (j % C::STAGES) * C::STAGE;
      const int tok0 = (j0 + j) * kKeys;
      for (int p = threadIdx.x; p < kKeys * C::PPR; p += kThreads) {
        const int r = p / C::PPR, piece = p % C::PPR;
        const int tok = tok0 + r;
        const bool ok = tok < kv_end;
        const int tk = ok ? tok : 0;
        const uint8_t* blk = head_base + (int64_t)pages[tk >> a.geo.page_shift] * a.geo.page_bytes;
        const int64_t so = (int64_t)(tk & (a.geo.page_size - 1)) * S::CB + piece * C::PS;
        cp_async<C::PS>(dst + r * C::SR + piece * C::PS, blk + a.geo.k_codes + so, ok);
        cp_async<C::PS>(dst + (kKeys + r) * C::SR + piece * C::PS, blk + a.geo.v_codes + so, ok);
      }
      if constexpr (S::NS > 0) {
        uint8_t* sd = dst + 2 * kKeys * C::SR;
        for (int r = threadIdx.x; r < kKeys; r += kThreads) {
          const int tok = tok0 + r;
          const bool ok = tok < kv_end;
          const int tk = ok ? tok : 0;
          const uint8_t* blk = head_base + (int64_t)pages[tk >> a.geo.page_shift] * a.geo.page_bytes;
          const int64_t so = (int64_t)(tk & (a.geo.page_size - 1)) * C::SCB;
          if constexpr (C::SCALE_ASYNC) {
#pragma unroll
            for (int pc = 0; pc < C::SCB / C::SPS; ++pc) {
              cp_async<C::SPS>(sd + r * C::SCB + pc * C::SPS, blk + a.geo.k_scales + so + pc * C::SPS, ok);
              cp_async<C::SPS>(sd + kKeys * C::SCB + r * C::SCB + pc * C::SPS, blk + a.geo.v_scales + so + pc * C::SPS, ok);
            }
          } else {  // 2- or 6-byte rows: plain copies (zeros past the end)
            const uint16_t* ks = reinterpret_cast<const uint16_t*>(blk + a.geo.k_scales + so);
            const uint16_t* vs = reinterpret_cast<const uint16_t*>(blk + a.geo.v_scales + so);
#pragma unroll
            for (int k = 0; k < S::NS; ++k) {
              reinterpret_cast<uint16_t*>(sd)[r * S::NS + k] = ok ? ks[k] : (uint16_t)0;
              reinterpret_cast<uint16_t*>(sd + kKeys * C::SCB)[r * S::NS + k] = ok ? vs[k] : (uint16_t)0;
            }
          }
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int j = 0; j < C::STAGES - 1; ++j) issue(j);

  // ---- this warp's rows: ra = 16 warp + g, rb = ra + 8; last visible key of each (-1: no row) ----
  const int ra = 16 * warp + g, rb = ra + 8;
  const int lim_a = ra < rows_here ? td.pos0 + (td.row0 + ra) / ng : -1;
  const int lim_b = rb < rows_here ? td.pos0 + (td.row0 + rb) / ng : -1;
  const int w_first = 16 * warp, w_last = min(16 * warp + 15, rows_here - 1);
  const int w_lo = w_first < rows_here ? td.pos0 + (td.row0 + w_first) / ng : -1;   // smallest limit of the warp
  const int w_hi = w_first < rows_here ? td.pos0 + (td.row0 + w_last) / ng : -1;    // largest
  const uint8_t* qra = qq + ra * C::QS;
  const uint8_t* qrb = qq + rb * C::QS;
  int cinit_a[S::NB], cinit_b[S::NB];
  float qsc_a[C::NQS], qsc_b[C::NQS];
  float sfac_a = a.sm_scale_log2, sfac_b = a.sm_scale_log2;
  if constexpr (F != dfmt::f16) {
#pragma unroll
    for (int bb = 0; bb < S::NB; ++bb) {
      cinit_a[bb] = kBias + (F == dfmt::q4 ? -8 * qsum[ra * S::NB + bb] : 0);
      cinit_b[bb] = kBias + (F == dfmt::q4 ? -8 * qsum[rb * S::NB + bb] : 0);
    }
#pragma unroll
    for (int k = 0; k < C::NQS; ++k) {
      qsc_a[k] = qscale[ra * C::NQS + k];
      qsc_b[k] = qscale[rb * C::NQS + k];
    }
    if constexpr (C::NQS == 1) {
      sfac_a *= qsc_a[0];
      sfac_b *= qsc_b[0];
    }
  }

  float m_a = -INFINITY, m_b = -INFINITY, d_a = 0.0f, d_b = 0.0f;
  float acc[2][C::MT][4];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf)
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) acc[hf][mt][0] = acc[hf][mt][1] = acc[hf][mt][2] = acc[hf][mt][3] = 0.0f;
  float pscale = 1.0f, inv_pscale = 1.0f;
  bool first = true;
  const uint32_t nib_mask = (g >> 2) ? 0x00F000F0u : 0x000F000Fu;
  const uint32_t nib_sub = (g >> 2) ? 0x64806480u : 0x64086408u;
  const int cols[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};  // key columns of s[n][e]: 8 n + 2 t + (e & 1)

  for (int j = 0; j < n_kt; ++j) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();  // stage j is visible to all; stage j - 1 is no longer read
    issue(j + C::STAGES - 1);
    const uint8_t* stage = smem + (j % C::STAGES) * C::STAGE;
#pragma unroll 1
    for (int sub = 0; sub < kKeys / kSub; ++sub) {
      const int tok = (j0 + j) * kKeys + sub * kSub;
      if (tok > w_hi) break;  // causal: no row of this warp sees these keys (warp-uniform)
      const uint8_t* kc = stage + sub * kSub * C::SR;
      const uint8_t* vc = stage + (kKeys + sub * kSub) * C::SR;
      const uint8_t* ksc = stage + 2 * kKeys * C::SR + sub * kSub * C::SCB;
      const uint8_t* vsc = ksc + kKeys * C::SCB;

      // s[n][e]: n = key half (8 n + ...), e = 0, 1 row a (keys 2t, 2t+1), e = 2, 3 row b
      float s[2][4];
      if constexpr (F == dfmt::f16) {
        float cc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const uint8_t* base = kc + ((lane & 7) + 8 * (lane >> 4)) * C::SR + 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
          uint32_t r[4];
          ldsm_x4(r, base + 32 * ks);
          const uint32_t a0 = lds32(qra + 2 * (16 * ks + 2 * t)), a1 = lds32(qrb + 2 * (16 * ks + 2 * t));
          const uint32_t a2 = lds32(qra + 2 * (16 * ks + 8 + 2 * t)), a3 = lds32(qrb + 2 * (16 * ks + 8 + 2 * t));
          mma_f16(cc[0], a0, a1, a2, a3, r[0], r[1]);
          mma_f16(cc[1], a0, a1, a2, a3, r[2], r[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          s[n][0] = cc[n][0] * sfac_a;
          s[n][1] = cc[n][1] * sfac_a;
          s[n][2] = cc[n][2] * sfac_b;
          s[n][3] = cc[n][3] * sfac_b;
        }
      } else {
        uint32_t kw[4][(S::NS + 1) / 2];
#pragma unroll
        for (int k = 0; k < 4; ++k) load_scale_words<S::NS>(ksc + cols[k] * C::SCB, kw[k]);
#pragma unroll
        for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int bb = 0; bb < S::NB; ++bb) {
          const bool last_partial = S::PARTIAL && bb == S::NB - 1;
          uint32_t qa0, qa1, qa2, qa3, ql0 = 0, ql1 = 0, ql2 = 0, ql3 = 0;
          if (last_partial) {
            if constexpr (F == dfmt::q4) {  // 16-element block: byte i holds e[i] and e[i + 8]
              qa0 = t < 2 ? lds32(qra + 32 * bb + 4 * t) : 0u;
              qa1 = t < 2 ? lds32(qrb + 32 * bb + 4 * t) : 0u;
              qa2 = t < 2 ? lds32(qra + 32 * bb + 8 + 4 * t) : 0u;
              qa3 = t < 2 ? lds32(qrb + 32 * bb + 8 + 4 * t) : 0u;
            } else {
              qa0 = lds32(qra + 32 * bb + 4 * t);
              qa1 = lds32(qrb + 32 * bb + 4 * t);
              qa2 = qa3 = 0u;
              ql0 = lds32(qra + kRows * C::QS + 32 * bb + 4 * t);
              ql1 = lds32(qrb + kRows * C::QS + 32 * bb + 4 * t);
            }
          } else {
            qa0 = lds32(qra + 32 * bb + 4 * t);
            qa1 = lds32(qrb + 32 * bb + 4 * t);
            qa2 = lds32(qra + 32 * bb + 16 + 4 * t);
            qa3 = lds32(qrb + 32 * bb + 16 + 4 * t);
            if constexpr (Q16) {
              ql0 = lds32(qra + kRows * C::QS + 32 * bb + 4 * t);
              ql1 = lds32(qrb + kRows * C::QS + 32 * bb + 4 * t);
              ql2 = lds32(qra + kRows * C::QS + 32 * bb + 16 + 4 * t);
              ql3 = lds32(qrb + kRows * C::QS + 32 * bb + 16 + 4 * t);
            }
          }
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
            int cc[4] = {cinit_a[bb], cinit_a[bb], cinit_b[bb], cinit_b[bb]};
            mma_s8(cc, qa0, qa1, qa2, qa3, b0, b1);
            float d[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) d[e] = __int_as_float(cc[e]) - kBiasF;  // exact block dots
            if constexpr (Q16) {
              int cl[4] = {kBias, kBias, kBias, kBias};
              mma_s8(cl, ql0, ql1, ql2, ql3, b0, b1);
#pragma unroll
              for (int e = 0; e < 4; ++e) d[e] = fmaf(254.0f, d[e], __int_as_float(cl[e]) - kBiasF);
            }
            if constexpr (C::NQS > 1) {
              d[0] *= qsc_a[si];
              d[1] *= qsc_a[si];
              d[2] *= qsc_b[si];
              d[3] *= qsc_b[si];
            }
            const float k0 = scale_at(kw[2 * n], si), k1 = scale_at(kw[2 * n + 1], si);
            s[n][0] = fmaf(k0, d[0], s[n][0]);
            s[n][1] = fmaf(k1, d[1], s[n][1]);
            s[n][2] = fmaf(k0, d[2], s[n][2]);
            s[n][3] = fmaf(k1, d[3], s[n][3]);
          }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          s[n][0] *= sfac_a;
          s[n][1] *= sfac_a;
          s[n][2] *= sfac_b;
          s[n][3] *= sfac_b;
        }
      }
      if (a.softcap_log2 > 0.0f) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = softcap_log2(s[n][e], a.softcap_log2);
      }
      // causal mask (also masks keys past kv_end: every limit is below it) and the exact sink's keys
      if (tok + kSub - 1 > w_lo || tok < a.body_lo) {
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = tok + cols[2 * n + (e & 1)];
            if (key > (e < 2 ? lim_a : lim_b) || key < a.body_lo) s[n][e] = -INFINITY;
          }
      }

      // ---- online softmax (log2 domain), rows a and b, each over 4 lanes ----
      float mxa = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
      float mxb = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
      mxa = fmaxf(mxa, __shfl_xor_sync(kFull, mxa, 1));
      mxa = fmaxf(mxa, __shfl_xor_sync(kFull, mxa, 2));
      mxb = fmaxf(mxb, __shfl_xor_sync(kFull, mxb, 1));
      mxb = fmaxf(mxb, __shfl_xor_sync(kFull, mxb, 2));
      const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
      const float mua = mna == -INFINITY ? 0.0f : mna, mub = mnb == -INFINITY ? 0.0f : mnb;
      const float al_a = ex2(m_a - mua), al_b = ex2(m_b - mub);
      float p[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        p[n][0] = ex2(s[n][0] - mua);
        p[n][1] = ex2(s[n][1] - mua);
        p[n][2] = ex2(s[n][2] - mub);
        p[n][3] = ex2(s[n][3] - mub);
      }
      d_a = d_a * al_a + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
      d_b = d_b * al_b + ((p[0][2] + p[0][3]) + (p[1][2] + p[1][3]));
      m_a = mna;
      m_b = mnb;
      if (__any_sync(kFull, al_a != 1.0f || al_b != 1.0f)) {  // lazy rescale
        const float a0 = __shfl_sync(kFull, al_a, 8 * t), a1 = __shfl_sync(kFull, al_a, 8 * t + 4);
        const float b0 = __shfl_sync(kFull, al_b, 8 * t), b1 = __shfl_sync(kFull, al_b, 8 * t + 4);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          acc[0][mt][0] *= a0;
          acc[0][mt][1] *= a1;
          acc[0][mt][2] *= a0;
          acc[0][mt][3] *= a1;
          acc[1][mt][0] *= b0;
          acc[1][mt][1] *= b1;
          acc[1][mt][2] *= b0;
          acc[1][mt][3] *= b1;
        }
      }

      // ---- P·V: O^T = V^T P^T, rows a (B = p[.][0..1]) and rows b (p[.][2..3]) ----
      if constexpr (F == dfmt::f16) {
        const uint32_t pa0 = pack_half2(p[0][0], p[0][1]), pa1 = pack_half2(p[1][0], p[1][1]);
        const uint32_t pb0 = pack_half2(p[0][2], p[0][3]), pb1 = pack_half2(p[1][2], p[1][3]);
        const uint8_t* base = vc + ((lane & 7) + 8 * (lane >> 4)) * C::SR + 16 * ((lane >> 3) & 1);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
          uint32_t r[4];
          ldsm_x4_trans(r, base + 32 * mt);
          mma_f16(acc[0][mt], r[0], r[1], r[2], r[3], pa0, pa1);
          mma_f16(acc[1][mt], r[0], r[1], r[2], r[3], pb0, pb1);
        }
      } else {
        if (first) {  // exact power of two that brings this warp's V scales near 1 in f16
          float vmax = 0.0f;
          for (int k = lane; k < kSub * S::NS; k += 32)
            vmax = fmaxf(vmax, __half2float(reinterpret_cast<const __half*>(vsc)[k]));
          vmax = warp_max(vmax);
          int e = 0;
          if (vmax > 0.0f) frexpf(vmax, &e);
          e = max(e, -15);
          pscale = ldexpf(1.0f, -e);
          inv_pscale = ldexpf(1.0f, e);
          first = false;
        }
        const uint32_t ha01 = pack_half2(p[0][0] * pscale, p[0][1] * pscale);
        const uint32_t ha23 = pack_half2(p[1][0] * pscale, p[1][1] * pscale);
        const uint32_t hb01 = pack_half2(p[0][2] * pscale, p[0][3] * pscale);
        const uint32_t hb23 = pack_half2(p[1][2] * pscale, p[1][3] * pscale);
        uint32_t vw[4][(S::NS + 1) / 2];
#pragma unroll
        for (int k = 0; k < 4; ++k) load_scale_words<S::NS>(vsc + cols[k] * C::SCB, vw[k]);
#pragma unroll
        for (int bb = 0; bb < S::NB; ++bb) {
          const int si = S::scale_index(bb);
          const unsigned sel = (si & 1) ? 0x7632u : 0x5410u;
          const uint32_t v01 = __byte_perm(vw[0][si >> 1], vw[1][si >> 1], sel);
          const uint32_t v23 = __byte_perm(vw[2][si >> 1], vw[3][si >> 1], sel);
          const uint32_t pa0 = hmul2_u32(ha01, v01), pa1 = hmul2_u32(ha23, v23);
          const uint32_t pb0 = hmul2_u32(hb01, v01), pb1 = hmul2_u32(hb23, v23);
          const bool last_partial = S::PARTIAL && bb == S::NB - 1;
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint8_t* row = vc + cols[k] * C::SR;
            if constexpr (F == dfmt::q4)
              w[k] = (last_partial && (g & 3) >= 2) ? 0u : lds32(row + 16 * bb + 4 * (g & 3));
            else
              w[k] = (last_partial && g >= 4) ? 0u : lds32(row + 32 * bb + 4 * g);
          }
#pragma unroll
          for (int mu = 0; mu < 2; ++mu) {
            uint32_t x[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const uint32_t pr = pair_bytes(w[(r >> 1) * 2], w[(r >> 1) * 2 + 1], 2 * mu + (r & 1));
              if constexpr (F == dfmt::q4)
                x[r] = hsub2_u32((pr & nib_mask) | 0x64006400u, nib_sub);
              else
                x[r] = hsub2_u32((pr & 0x00FF00FFu) ^ 0x64806480u, 0x64806480u);
            }
            mma_f16(acc[0][2 * bb + mu], x[0], x[1], x[2], x[3], pa0, pa1);
            mma_f16(acc[1][2 * bb + mu], x[0], x[1], x[2], x[3], pb0, pb1);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: o / d per row into shared memory (f32 [64][HD]), inverse rotation, store ----
  d_a += __shfl_xor_sync(kFull, d_a, 1);
  d_a += __shfl_xor_sync(kFull, d_a, 2);
  d_b += __shfl_xor_sync(kFull, d_b, 1);
  d_b += __shfl_xor_sync(kFull, d_b, 2);
  const bool part = td.ws >= 0;  // a split part: unnormalised o, and m, d, to the workspace
  const float inv_a = part ? 1.0f : d_a > 0.0f ? 1.0f / d_a : 0.0f;
  const float inv_b = part ? 1.0f : d_b > 0.0f ? 1.0f / d_b : 0.0f;
  const int64_t slot = part ? (int64_t)td.ws * a.n_kv_head + h : 0;
  if (part && t == 0) {
    a.ws_md[slot * kRows + ra] = make_float2(m_a, d_a);
    a.ws_md[slot * kRows + rb] = make_float2(m_b, d_b);
  }
  float inv[2][2];
  inv[0][0] = __shfl_sync(kFull, inv_a, 8 * t);  // rows 2t, 2t + 1 of each half
  inv[0][1] = __shfl_sync(kFull, inv_a, 8 * t + 4);
  inv[1][0] = __shfl_sync(kFull, inv_b, 8 * t);
  inv[1][1] = __shfl_sync(kFull, inv_b, 8 * t + 4);
  __syncthreads();  // every warp is done with the pipeline's shared memory
  float* of = reinterpret_cast<float*>(smem);  // [64][HD]
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float* o0 = of + (16 * warp + 8 * hf + 2 * t) * HD;  // row 2t of the half
    float* o1 = o0 + HD;                                  // row 2t + 1
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      int ch0, ch1;
      float f;
      if (pv_out_channels<F, HD>(mt, g, inv_pscale, ch0, ch1, f)) {
        o0[ch0] = acc[hf][mt][0] * f * inv[hf][0];
        o1[ch0] = acc[hf][mt][1] * f * inv[hf][1];
        o0[ch1] = acc[hf][mt][2] * f * inv[hf][0];
        o1[ch1] = acc[hf][mt][3] * f * inv[hf][1];
      }
    }
  }
  if (part) {  // the merge kernel normalises and rotates
    __syncthreads();
    float* wo = a.ws_o + slot * kRows * HD;
    for (int i = threadIdx.x; i < kRows * HD / 4; i += kThreads)
      reinterpret_cast<float4*>(wo)[i] = reinterpret_cast<const float4*>(of)[i];
    return;
  }
  if (a.rot_block > 1) fwht_rows_block(of, kRows, HD, a.rot_block, a.rot_scale);  // Hadamard: its own inverse
  else __syncthreads();
  for (int i = threadIdx.x; i < rows_here * HD; i += kThreads) {
    const int r = i / HD, c = i % HD;
    const int64_t oi = q_index(r) + c;
    if (a.out_f16) reinterpret_cast<__half*>(a.out)[oi] = __float2half_rn(of[i]);
    else reinterpret_cast<float*>(a.out)[oi] = of[i];
  }
}

struct merge_args {
  const merge_desc* merges;
  const float* ws_o;
  const float2* ws_md;
  void* out;
  int out_f16;
  int n_head, n_kv_head, ng;
  int rot_block;
  float rot_scale;
  // the exact sink (exact_window_view), or ek == nullptr: row j is position j
  const uint16_t* ek;  // [n_slots][n_kv_head][ecap][HD] f16
  const uint16_t* ev;
  const int32_t* elen;   // [batch]
  const int32_t* eslot;  // [batch] or nullptr
  int ecap;
  const void* q;  // [n_q][n_head][HD] (the exact rows' scores)
  int q_bf16;
  float sm_scale_log2, softcap_log2;
  const float* k_lambda;
  const int32_t* stat_row;
};

constexpr int merge_smem_bytes(int hd) { return (kRows * hd + 2 * kRows) * 4; }

// One block per (split tile, kv head): the exact rows' state per row (f32 rotated query x f16 rows,
// one warp per row, online softmax), attn_state::merge of the tile's parts and that state per row
// (log2 units), normalisation, inverse rotation, store.
template <int HD>
__global__ void __launch_bounds__(kThreads) prefill_merge_kernel(merge_args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* of = reinterpret_cast<float*>(smem);  // [64][HD]: rotated queries, then exact o, then outputs
  float* me = of + kRows * HD;                 // [64] exact m (log2 units)
  float* de = me + kRows;                      // [64] exact d
  const merge_desc md = a.merges[blockIdx.x / a.n_kv_head];
  const int h = blockIdx.x % a.n_kv_head, ng = a.ng;
  const int rows_here = min(kRows, md.q_len * ng - md.row0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (a.ek) {
    const float* lam = k_lambda_row<HD>(a.k_lambda, a.stat_row, md.seq, a.n_kv_head, h);
    for (int i = threadIdx.x; i < kRows * HD; i += kThreads) {
      const int r = i / HD, c = i % HD, R = md.row0 + r;
      const int64_t qi = ((int64_t)(md.qo0 + R / ng) * a.n_head + (int64_t)h * ng + R % ng) * HD + c;
      of[i] = r < rows_here ? lambda_scaled(load_elem(a.q, qi, a.q_bf16 != 0), lam, c) : 0.0f;
    }
    if (a.rot_block > 1) fwht_rows_block(of, kRows, HD, a.rot_block, a.rot_scale);
    else __syncthreads();
    constexpr int EPL = (HD + 31) / 32;
    const int ne = a.elen[md.seq];
    const int64_t eb = ((int64_t)(a.eslot ? a.eslot[md.seq] : md.seq) * a.n_kv_head + h) * a.ecap * HD;
    const __half* kb = reinterpret_cast<const __half*>(a.ek) + eb;
    const __half* vb = reinterpret_cast<const __half*>(a.ev) + eb;
    for (int r = warp; r < kRows; r += kWarps) {
      const int n_vis = r < rows_here ? min(ne, md.pos0 + (md.row0 + r) / ng + 1) : 0;  // rows j <= position
      float qv[EPL], ov[EPL];
#pragma unroll
      for (int k = 0; k < EPL; ++k) {
        const int c = k * 32 + lane;
        qv[k] = c < HD ? of[r * HD + c] : 0.0f;
        ov[k] = 0.0f;
      }
      float m = -INFINITY, d = 0.0f;
      for (int j = 0; j < n_vis; ++j) {
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          const int c = k * 32 + lane;
          if (c < HD) dot = fmaf(qv[k], __half2float(kb[(int64_t)j * HD + c]), dot);
        }
        const float sj = softcap_log2(warp_sum(dot) * a.sm_scale_log2, a.softcap_log2);
        const float mn = fmaxf(m, sj), al = ex2(m - mn), pj = ex2(sj - mn);
        d = d * al + pj;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          const int c = k * 32 + lane;
          if (c < HD) ov[k] = fmaf(pj, __half2float(vb[(int64_t)j * HD + c]), ov[k] * al);
        }
        m = mn;
      }
#pragma unroll
      for (int k = 0; k < EPL; ++k) {
        const int c = k * 32 + lane;
        if (c < HD) of[r * HD + c] = ov[k];
      }
      if (lane == 0) {
        me[r] = m;
        de[r] = d;
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kRows * HD; i += kThreads) {
    const int r = i / HD;
    float M = -INFINITY;
    for (int pp = 0; pp < md.n_parts; ++pp)
      M = fmaxf(M, a.ws_md[((int64_t)(md.ws0 + pp) * a.n_kv_head + h) * kRows + r].x);
    float o = 0.0f, d = 0.0f;
    if (a.ek && me[r] != -INFINITY) {
      M = fmaxf(M, me[r]);
      const float e = ex2(me[r] - M);
      o = of[i] * e;
      d = de[r] * e;
    }
    for (int pp = 0; pp < md.n_parts; ++pp) {
      const int64_t slot = (int64_t)(md.ws0 + pp) * a.n_kv_head + h;
      const float2 st = a.ws_md[slot * kRows + r];
      if (st.x == -INFINITY) continue;
      const float e = ex2(st.x - M);
      o = fmaf(e, a.ws_o[slot * kRows * HD + i], o);
      d = fmaf(e, st.y, d);
    }
    of[i] = d > 0.0f ? o / d : 0.0f;
  }
  if (a.rot_block > 1) fwht_rows_block(of, kRows, HD, a.rot_block, a.rot_scale);
  else __syncthreads();
  for (int i = threadIdx.x; i < rows_here * HD; i += kThreads) {
    const int r = i / HD, c = i % HD, R = md.row0 + r;
    const int64_t oi = ((int64_t)(md.qo0 + R / ng) * a.n_head + (int64_t)h * ng + R % ng) * HD + c;
    if (a.out_f16) reinterpret_cast<__half*>(a.out)[oi] = __float2half_rn(of[i]);
    else reinterpret_cast<float*>(a.out)[oi] = of[i];
  }
}

}  // namespace

namespace {

// The plan's query tiles from its host tables: 64 query rows (tokens x GQA group heads) of one
// sequence each, with the keys their rows see (constructor and update(); errors as the class says).
struct tile_list {
  std::vector<tile_desc> tiles;
  std::vector<int64_t> cost;  // keys each tile reads
};
tile_list make_tiles(const paged_kv_format& f, const prefill_params& p, int ng, const int32_t* qo_indptr_host,
                     const int32_t* indptr_host, const int32_t* last_page_len_host, int batch) {
  const std::string op = "[cuda attn_prefill] ";
  tile_list out;
  std::vector<tile_desc>& tiles = out.tiles;
  std::vector<int64_t>& cost = out.cost;
  if (batch > 0 && qo_indptr_host[0] != 0) fail_input(op + "qo_indptr[0] must be 0, got " + std::to_string(qo_indptr_host[0]));
  for (int b = 0; b < batch; ++b) {
    const int32_t np = indptr_host[b + 1] - indptr_host[b];
    const int32_t nq = qo_indptr_host[b + 1] - qo_indptr_host[b];
    if (np < 0 || nq < 0)
      fail_input(op + "indptr and qo_indptr must be non-decreasing (sequence " + std::to_string(b) + ")");
    if (np > 0 && (last_page_len_host[b] < 1 || last_page_len_host[b] > f.page_size))
      fail_input(op + "last_page_len[" + std::to_string(b) + "] = " + std::to_string(last_page_len_host[b]) +
                 " must be in [1, page_size " + std::to_string(f.page_size) + "]");
    const int64_t len = np > 0 ? (int64_t)(np - 1) * f.page_size + last_page_len_host[b] : 0;
    if (nq > len)
      fail_input(op + "sequence " + std::to_string(b) + " has " + std::to_string(nq) + " queries but its pages hold " +
                 std::to_string(len) + " positions (the queries are the last q_len positions, appended first)");
    if (len > INT32_MAX - 64) fail_unsupported(op + "sequence " + std::to_string(b) + " is too long");
    const int64_t rows = (int64_t)nq * ng;
    if (rows > INT32_MAX - 64) fail_unsupported(op + "sequence " + std::to_string(b) + " has too many query rows");
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      tile_desc d;
      d.seq = b;
      d.row0 = (int)r0;
      d.qo0 = qo_indptr_host[b];
      d.pg0 = indptr_host[b];
      d.pos0 = (int)(len - nq);
      d.q_len = nq;
      d.k_begin = p.body_lo / kKeys * kKeys;
      d.k_end = d.pos0 + (int)((std::min<int64_t>(r0 + kRows, rows) - 1) / ng) + 1;  // keys its rows see
      d.ws = -1;
      tiles.push_back(d);
      cost.push_back(std::max(0, d.k_end - d.k_begin));
    }
  }
  return out;
}

// The work items: the tiles, long ones cut over the keys when the tiles alone would leave resident
// block slots idle, longest first; merges of the split tiles (or, with exact rows, of every tile).
struct work_list {
  std::vector<tile_desc> items;
  std::vector<merge_desc> merges;
  int n_slots = 0;  // workspace slots of the split parts
};
work_list split_tiles(const tile_list& tl, int n_kv_head, int64_t slots, int exact_cap) {
  const std::vector<tile_desc>& tiles = tl.tiles;
  const std::vector<int64_t>& cost = tl.cost;
  work_list out;
  int& n_slots = out.n_slots;
  // Split-KV (Flash-Decoding's idea applied to prefill tiles): when the tiles alone would leave
  // resident block slots idle (a short chunk, few kv heads, a long history), long tiles are cut into
  // parts of about T keys (T a multiple of 64, >= 1024), T chosen so that the parts fill the slots;
  // the parts' states merge in a second kernel.
  int64_t total = 0;
  for (int64_t c : cost) total += c;
  total *= n_kv_head;
  int64_t T = INT64_MAX;
  if ((int64_t)tiles.size() * n_kv_head < slots) T = std::max<int64_t>(1024, (total / slots + 63) / 64 * 64);
  std::vector<tile_desc> items;
  std::vector<int64_t> item_cost;
  std::vector<merge_desc>& merges = out.merges;
  for (size_t i = 0; i < tiles.size(); ++i) {
    const tile_desc& d = tiles[i];
    const int span = std::max(0, d.k_end - d.k_begin);
    const int64_t np = T == INT64_MAX ? 1 : std::max<int64_t>(1, (span + T - 1) / T);
    if (np == 1 && exact_cap == 0) {
      items.push_back(d);
      item_cost.push_back(span);
      continue;
    }
    // split parts, or (exact rows) the tile as the one part whose state the merge kernel completes
    const int per = std::max(64, (int)(((span + np - 1) / np + 63) / 64 * 64));
    merge_desc m{d.row0, d.qo0, d.q_len, n_slots, 0, d.seq, d.pos0};
    for (int k0 = d.k_begin; k0 < std::max(d.k_end, d.k_begin + 1); k0 += per) {
      tile_desc pd = d;
      pd.k_begin = k0;
      pd.k_end = std::min(d.k_end, k0 + per);
      pd.ws = n_slots++;
      items.push_back(pd);
      item_cost.push_back(std::max(0, pd.k_end - pd.k_begin));
      ++m.n_parts;
    }
    merges.push_back(m);
  }
  // longest key ranges first (the tail of the grid is then the short items)
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return item_cost[x] > item_cost[y]; });
  std::vector<tile_desc> sorted(items.size());
  for (size_t i = 0; i < order.size(); ++i) sorted[i] = items[order[i]];
  out.items = std::move(sorted);
  return out;
}

}  // namespace

struct prefill_plan::impl {
  paged_kv_format f;
  paged_kv_geometry geo;
  prefill_params p;
  int batch = 0, ng = 0, n_tiles = 0, n_items = 0, n_merges = 0, n_slots = 0, smem = 0, n_q = 0, exact_cap = 0;
  int64_t slots = 0;  // resident blocks the GPU holds (SMs x occupancy): the split-KV rule's target
  tile_desc* tiles = nullptr;  // [n_items] work items (tiles or parts of tiles), longest first
  merge_desc* merges = nullptr;
  float* ws_o = nullptr;
  float2* ws_md = nullptr;
  size_t ws_bytes = 0;

  ~impl() {
    cudaFree(tiles);
    cudaFree(merges);
    cudaFree(ws_o);
    cudaFree(ws_md);
  }
};

prefill_plan::prefill_plan(const paged_kv_format& f, const prefill_params& p, const int32_t* qo_indptr_host,
                           const int32_t* indptr_host, const int32_t* last_page_len_host, int batch, int exact_cap)
    : p_(std::make_unique<impl>()) {
  require();
  impl& s = *p_;
  s.f = f;
  const std::string op = "[cuda attn_prefill] ";
  try {
    s.geo = paged_kv_geometry_of(f);  // format, head_dim, page size, rotation
  } catch (const error& e) {
    throw error(e.code(), op + e.what());
  }
  if (f.format == kv_format::kivi4)
    fail_unsupported(op +
                     "kivi4 pages have no prefill kernel yet (attend a prompt through decode_plan, one entry "
                     "per query)");
  s.p = p;
  if (f.n_kv_head < 1) fail_input(op + "n_kv_head must be >= 1, got " + std::to_string(f.n_kv_head));
  if (p.n_head < f.n_kv_head || p.n_head % f.n_kv_head != 0)
    fail_unsupported(op + "n_head " + std::to_string(p.n_head) + " must be a multiple of n_kv_head " +
                     std::to_string(f.n_kv_head));
  if (!std::isfinite(p.spec.scale)) fail_input(op + "scale must be finite");
  if (p.spec.window != 0)
    fail_unsupported(op + "sliding window " + std::to_string(p.spec.window) + " (only full causal attention)");
  if (!(p.spec.softcap >= 0.0f) || !std::isfinite(p.spec.softcap))
    fail_input(op + "softcap must be finite and >= 0, got " + std::to_string(p.spec.softcap));
  if (p.q_elem == kv_elem::f32) fail_unsupported(op + "queries must be f16 or bf16, got f32");
  if (p.out_elem == kv_elem::bf16) fail_unsupported(op + "output must be f32 or f16, got bf16");
  if (batch < 0) fail_input(op + "batch must be >= 0, got " + std::to_string(batch));
  if (p.body_lo < 0) fail_input(op + "body_lo must be >= 0, got " + std::to_string(p.body_lo));
  if (exact_cap < 0 || exact_cap > 1024)
    fail_unsupported(op + "exact window capacity must be in [0, 1024], got " + std::to_string(exact_cap));
  s.exact_cap = exact_cap;
  if (batch > 0 && (!qo_indptr_host || !indptr_host || !last_page_len_host))
    fail_input(op + "host copies of qo_indptr, indptr and last_page_len are required");
  s.batch = batch;
  s.ng = p.n_head / f.n_kv_head;
  tile_list tl = make_tiles(f, p, s.ng, qo_indptr_host, indptr_host, last_page_len_host, batch);
  const std::vector<tile_desc>& tiles = tl.tiles;
  s.n_q = batch > 0 ? qo_indptr_host[batch] : 0;
  if ((int64_t)tiles.size() * f.n_kv_head > INT32_MAX / 64) fail_unsupported(op + "too many query tiles");
  s.n_tiles = (int)tiles.size();
  if (s.n_tiles == 0) return;
  int occ = 0, sms = 1, dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  dispatch_format_hd(to_dfmt(f.format), f.head_dim, [&](auto fc, auto hc) {
    constexpr dfmt F = decltype(fc)::value;
    constexpr int HD = decltype(hc)::value;
    s.smem = pcfg<F, HD>::SMEM;
    check(cudaFuncSetAttribute(prefill_kernel<F, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, s.smem),
          "cudaFuncSetAttribute(prefill)");
    check(cudaFuncSetAttribute(prefill_merge_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               merge_smem_bytes(HD)),
          "cudaFuncSetAttribute(prefill merge)");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, prefill_kernel<F, HD>, kThreads, s.smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  });
  if (occ < 1)
    fail_unsupported(op + "the prefill kernel does not fit on this GPU (shared memory " + std::to_string(s.smem) +
                     " bytes)");
  s.slots = (int64_t)sms * occ;
  work_list wl = split_tiles(tl, f.n_kv_head, s.slots, exact_cap);
  std::vector<tile_desc>& sorted = wl.items;
  std::vector<merge_desc>& merges = wl.merges;
  s.n_slots = wl.n_slots;
  s.n_items = (int)sorted.size();
  s.n_merges = (int)merges.size();
  check(cudaMalloc(&s.tiles, sorted.size() * sizeof(tile_desc)), "cudaMalloc(prefill tiles)");
  copy_to_device(s.tiles, sorted.data(), sorted.size() * sizeof(tile_desc));
  s.ws_bytes = sorted.size() * sizeof(tile_desc);
  if (s.n_merges > 0) {
    const size_t n = (size_t)s.n_slots * f.n_kv_head * kRows;
    check(cudaMalloc(&s.merges, merges.size() * sizeof(merge_desc)), "cudaMalloc(prefill merges)");
    check(cudaMalloc(&s.ws_o, n * f.head_dim * sizeof(float)), "cudaMalloc(prefill workspace)");
    check(cudaMalloc(&s.ws_md, n * sizeof(float2)), "cudaMalloc(prefill workspace)");
    copy_to_device(s.merges, merges.data(), merges.size() * sizeof(merge_desc));
    s.ws_bytes += merges.size() * sizeof(merge_desc) + n * (f.head_dim * sizeof(float) + sizeof(float2));
  }
}

prefill_plan::~prefill_plan() = default;

bool prefill_plan::update(const int32_t* qo_indptr_host, const int32_t* indptr_host, const int32_t* last_page_len_host,
                          void* stream) {
  impl& s = *p_;
  if (s.n_tiles == 0 || !qo_indptr_host || !indptr_host || !last_page_len_host) return false;
  tile_list tl;
  try {
    tl = make_tiles(s.f, s.p, s.ng, qo_indptr_host, indptr_host, last_page_len_host, s.batch);
  } catch (const error&) {
    return false;  // a malformed table: the constructor says what is wrong
  }
  if ((int)tl.tiles.size() != s.n_tiles || qo_indptr_host[s.batch] != s.n_q) return false;
  const work_list wl = split_tiles(tl, s.f.n_kv_head, s.slots, s.exact_cap);
  if ((int)wl.items.size() != s.n_items || (int)wl.merges.size() != s.n_merges || wl.n_slots != s.n_slots)
    return false;  // the launch would change: make a new plan
  const cudaStream_t st = as_stream(stream);
  check(cudaMemcpyAsync(s.tiles, wl.items.data(), wl.items.size() * sizeof(tile_desc), cudaMemcpyHostToDevice, st),
        "cudaMemcpyAsync(prefill tiles)");
  if (s.n_merges > 0)
    check(cudaMemcpyAsync(s.merges, wl.merges.data(), wl.merges.size() * sizeof(merge_desc), cudaMemcpyHostToDevice,
                          st),
          "cudaMemcpyAsync(prefill merges)");
  check(cudaStreamSynchronize(st), "cudaStreamSynchronize");  // the host vectors go out of scope
  return true;
}

int prefill_plan::n_tiles() const { return p_->n_tiles; }
int prefill_plan::n_items() const { return p_->n_items; }
size_t prefill_plan::workspace_bytes() const { return p_->ws_bytes; }

void prefill_plan::run(const paged_kv_view& kv, const void* q, void* out, const exact_window_view* exact,
                       void* stream) const {
  const impl& s = *p_;
  const paged_kv_format& f = kv.format;
  if (f.format != s.f.format || f.head_dim != s.f.head_dim || f.n_kv_head != s.f.n_kv_head ||
      f.page_size != s.f.page_size || f.rotation != s.f.rotation || kv.batch != s.batch)
    fail_input("[cuda attn_prefill] the view's format or batch differs from the plan's");
  if (s.n_tiles == 0) return;
  if (!kv.pool || !kv.indices || !q || !out)
    fail_input("[cuda attn_prefill] pool, indices, q and out must be device pointers");
  check_k_lambda(kv, "[cuda attn_prefill]");
  const bool has_exact = exact && exact->len;
  if (has_exact && (exact->gap_lo || exact->gap_hi))
    fail_unsupported("[cuda attn_prefill] exact rows with a gap (gap_lo / gap_hi) are decode_plan's only");
  if (has_exact && (!exact->k || !exact->v || exact->cap < 1 || exact->cap > s.exact_cap))
    fail_input("[cuda attn_prefill] exact window: k, v required and cap in [1, plan's exact_cap " +
               std::to_string(s.exact_cap) + "]");
  const float l2e = 1.4426950408889634f;
  dispatch_format_hd(to_dfmt(f.format), f.head_dim, [&](auto fc, auto hc) {
    constexpr dfmt F = decltype(fc)::value;
    constexpr int HD = decltype(hc)::value;
    prefill_args a;
    a.pool = kv.pool;
    a.geo = to_dev(s.geo, f.page_size);
    a.indices = kv.indices;
    a.tiles = s.tiles;
    a.ws_o = s.ws_o;
    a.ws_md = s.ws_md;
    a.q = q;
    a.out = out;
    a.q_bf16 = s.p.q_elem == kv_elem::bf16;
    a.out_f16 = s.p.out_elem == kv_elem::f16;
    a.n_head = s.p.n_head;
    a.n_kv_head = f.n_kv_head;
    a.ng = s.ng;
    a.sm_scale_log2 = s.p.spec.scale * l2e;
    a.softcap_log2 = s.p.spec.softcap * l2e;
    a.rot_block = s.geo.rot_block;
    a.rot_scale = s.geo.rot_scale;
    a.k_lambda = kv.k_lambda;
    a.stat_row = kv.stat_row;
    a.body_lo = s.p.body_lo;
    const unsigned grid = (unsigned)s.n_items * (unsigned)f.n_kv_head;
    prefill_kernel<F, HD><<<grid, kThreads, s.smem, as_stream(stream)>>>(a);
    check_launch("attn_prefill (prefill_kernel)");
    if (s.n_merges > 0) {
      merge_args m;
      m.merges = s.merges;
      m.ws_o = s.ws_o;
      m.ws_md = s.ws_md;
      m.out = out;
      m.out_f16 = a.out_f16;
      m.n_head = a.n_head;
      m.n_kv_head = a.n_kv_head;
      m.ng = a.ng;
      m.rot_block = a.rot_block;
      m.rot_scale = a.rot_scale;
      m.ek = has_exact ? exact->k : nullptr;
      m.ev = has_exact ? exact->v : nullptr;
      m.elen = has_exact ? exact->len : nullptr;
      m.eslot = has_exact ? exact->slot : nullptr;
      m.ecap = has_exact ? exact->cap : 0;
      m.q = q;
      m.q_bf16 = a.q_bf16;
      m.sm_scale_log2 = a.sm_scale_log2;
      m.softcap_log2 = a.softcap_log2;
      m.k_lambda = kv.k_lambda;
      m.stat_row = kv.stat_row;
      const unsigned n_blocks = (unsigned)s.n_merges * (unsigned)f.n_kv_head;
      prefill_merge_kernel<HD><<<n_blocks, kThreads, merge_smem_bytes(HD), as_stream(stream)>>>(m);
      check_launch("attn_prefill (prefill_merge_kernel)");
    }
  });
}

}  // namespace kvq::cuda
