// Private device helpers of the CUDA backend: error checks, cp.async, warp MMA wrappers, f16 and
// quantization arithmetic that must match the CPU oracle (src/quant/kv_quantize_ref.cpp) bit for bit.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "kvq/cuda.h"
#include "kvq/error.h"
#include "kvq/quant.h"

namespace kvq::cuda::detail {

// Throws kvq::error(internal) naming the op and the CUDA error.
void check(cudaError_t e, const char* op);
inline void check_launch(const char* op) { check(cudaGetLastError(), op); }

// Per-kernel formats. The device layout of a (page, kv head) block is documented in
// include/kvq/cuda.h; geometry values come from paged_kv_geometry_of().
enum class dfmt : int { q8, q4, f16 };

// Geometry of a device page as the kernels see it (bytes).
struct dev_geom {
  int64_t page_bytes = 0;  // one page, all kv heads
  int64_t head_bytes = 0;  // one (page, kv head) block
  int32_t k_codes = 0, v_codes = 0, k_scales = 0, v_scales = 0;  // offsets in the block
  int32_t page_size = 0;
  int32_t page_shift = 0;  // log2(page_size)
};

inline dfmt to_dfmt(kv_format f) {
  return f == kv_format::q8 ? dfmt::q8 : f == kv_format::q4 ? dfmt::q4 : dfmt::f16;
}
inline dev_geom to_dev(const paged_kv_geometry& g, int page_size) {
  dev_geom d;
  d.page_bytes = g.page_bytes;
  d.head_bytes = g.head_bytes;
  d.k_codes = (int32_t)g.k_codes;
  d.v_codes = (int32_t)g.v_codes;
  d.k_scales = (int32_t)g.k_scales;
  d.v_scales = (int32_t)g.v_scales;
  d.page_size = page_size;
  d.page_shift = page_size == 64 ? 6 : page_size == 32 ? 5 : 4;
  return d;
}
inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Programmatic dependent launch (Hopper; CUDA programming guide, "Programmatic Dependent Launch and
// Synchronization"): a kernel launched with launch_pdl may be scheduled while the kernel before it
// on the stream is still running, so that its launch overlaps that kernel's tail instead of
// following it (in a CUDA graph the edge is captured as a programmatic one). Every kernel launched
// this way must call pdl_enter() before its first access to device memory: it waits until the
// previous kernel has completed and its writes are visible (a no-op for a plain launch), then lets
// the next kernel be scheduled in turn. What a step computes is unchanged, bit for bit.
// KVQ_CUDA_PDL=0 in the environment (read once) launches them plainly: the benchmarks' A/B.
bool pdl_on();
// KVQ_CUDA_DECODE_SPLIT=T in the environment (read once): decode plans whose caller leaves the split
// to the plan (decode_params::split_tokens 0) take split-KV items of T tokens (rounded to 16, at
// least 64) instead of the plan's cost model: the benchmarks' sweep. 0 when unset.
int64_t split_tokens_env();
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  if (pdl_on()) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);  // errors: the caller's check_launch
}

// Compile-time shape of a (format, head_dim) instance.
template <dfmt F, int HD>
struct shape {
  static_assert(HD % 16 == 0 && HD >= 32 && HD <= 256, "head_dim: multiple of 16 in [32, 256]");
  static constexpr int NB = (HD + 31) / 32;          // 32-element code blocks per row
  static constexpr bool PARTIAL = HD % 32 != 0;       // the last block holds 16 elements
  static constexpr int NS = F == dfmt::f16 ? 0 : (HD % 32 == 0 ? HD / 32 : 1);  // f16 scales/row
  static constexpr int CB = F == dfmt::q4 ? HD / 2 : F == dfmt::q8 ? HD : 2 * HD;  // code bytes/row
  static constexpr int block_bytes = F == dfmt::q4 ? 16 : 32;  // bytes of one full code block
  __host__ __device__ static constexpr int scale_index(int b) { return NS == 1 ? 0 : b; }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async of N bytes (4, 8 or 16); `valid` false zero-fills the destination without reading.
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  const int sz = valid ? N : 0;
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(sz)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_u32(dst)), "l"(src), "n"(N), "r"(sz)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// D += A B, m16n8k32, s8 x s8 -> s32. Fragments (PTX ISA, lane = 4 * g + t):
//   A: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..]
//   B: b0 = B[4t..4t+3][g], b1 = B[16+4t..][g];  C: c0,c1 = C[g][2t, 2t+1], c2,c3 = C[g+8][..]
__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// D += A B, m16n8k16, f16 x f16 -> f32. A: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t..], a2 = A[g][8+2t..],
// a3 = A[g+8][8+2t..]; B: b0 = B[2t, 2t+1][g], b1 = B[8+2t..][g]; C as for mma_s8.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// P·V output tile mt of the decode and prefill kernels: the two V channels ch0, ch1 that lane group
// g's accumulator entries (0, 1) and (2, 3) hold, and the factor f that undoes the codes' scaling in
// the MMA (inv_pscale for q8 / q4, 1/16 more for q4's high nibbles, 1 for f16). False when those
// channels lie past the 16 elements of a partial last block (head_dim % 32 == 16).
template <dfmt F, int HD>
__device__ __forceinline__ bool pv_out_channels(int mt, int g, float inv_pscale, int& ch0, int& ch1, float& f) {
  using S = shape<F, HD>;
  if constexpr (F == dfmt::f16) {
    ch0 = 16 * mt + g;
    ch1 = ch0 + 8;
    f = 1.0f;
    return true;
  } else {
    const int bb = mt >> 1, mu = mt & 1;
    const bool last_partial = S::PARTIAL && bb == S::NB - 1;
    bool ok;
    f = inv_pscale;
    if constexpr (F == dfmt::q4) {
      const int j = g & 3, hs = g >> 2;
      ch0 = 32 * bb + (last_partial ? 8 : 16) * hs + 4 * j + 2 * mu;
      ok = !last_partial || j < 2;
      if (hs) f *= 0.0625f;  // high nibbles entered the MMA as 16 * (u - 8)
    } else {
      ch0 = 32 * bb + 4 * g + 2 * mu;
      ok = !last_partial || g < 4;
    }
    ch1 = ch0 + 1;
    return ok;
  }
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t hsub2_u32(uint32_t a, uint32_t b) {
  __half2 x = *reinterpret_cast<const __half2*>(&a), y = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hsub2(x, y);
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  __half2 x = *reinterpret_cast<const __half2*>(&a), y = *reinterpret_cast<const __half2*>(&b);
  const __half2 r = __hmul2(x, y);
  return *reinterpret_cast<const uint32_t*>(&r);
}

__device__ __forceinline__ float load_elem(const void* p, int64_t i, bool bf16) {
  const uint16_t u = static_cast<const uint16_t*>(p)[i];
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(u)) : __half2float(__ushort_as_half(u));
}

// kvq::f16_round_up: the smallest f16 >= v (v >= 0, finite), as f16 bits.
__device__ __forceinline__ uint16_t f16_round_up_dev(float v) {
  uint16_t h = __half_as_ushort(__float2half_rn(v));
  if (__half2float(__ushort_as_half(h)) < v && h < 0x7bff) ++h;
  return h;
}

// kvq::quantize_row_ref's signed scale of a symmetric group with minimum mn <= 0 and maximum
// mx >= 0: the extreme element maps to -qneg, the other sign uses up to +qpos; the sign of the
// scale is stored in the f16 bits (q8: qneg == qpos, never negative).
__device__ __forceinline__ uint16_t signed_scale_dev(float mn, float mx, float qneg, float qpos) {
  const bool neg = qneg == qpos || -mn >= mx;
  const float ext = neg ? -mn : mx, other = neg ? mx : -mn;
  const float mag = fmaxf(__fdiv_rn(ext, qneg), __fdiv_rn(other, qpos));
  const uint16_t mh = f16_round_up_dev(mag);
  return neg || mh == 0 ? mh : (uint16_t)(mh | 0x8000u);
}

// 2^x on the special-function unit (flush-to-zero; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-diagonal orthonormal FWHT (kvq::rotation hadamard) of `rows` rows of x[rows][hd] in shared
// memory, by all threads of the block (contains __syncthreads). Same adds, subtracts and final
// multiply as kvq::fwht_radix2_ref (Sylvester order, stages h = 1, 2, 4, ...), so bit-identical.
__device__ __forceinline__ void fwht_rows_block(float* x, int rows, int hd, int block, float scale) {
  const int pairs = rows * hd / 2;
  for (int h = 1; h < block; h *= 2) {
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
      // pair i -> element j with bit h clear, partner j + h (rows are contiguous, block | hd)
      const int lo = i % h, hi = i / h;
      const int j = hi * 2 * h + lo;
      const float a = x[j], b = x[j + h];
      x[j] = __fadd_rn(a, b);
      x[j + h] = __fsub_rn(a, b);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * hd; i += blockDim.x) x[i] = __fmul_rn(x[i], scale);
  __syncthreads();
}

// The same transform of one row x[hd] in shared memory by one warp (contains __syncwarp).
__device__ __forceinline__ void fwht_row_warp(float* x, int hd, int block, float scale, int lane) {
  for (int h = 1; h < block; h *= 2) {
    __syncwarp();
    for (int i = lane; i < hd / 2; i += 32) {
      const int lo = i % h, hi = i / h;
      const int j = hi * 2 * h + lo;
      const float a = x[j], b = x[j + h];
      x[j] = __fadd_rn(a, b);
      x[j + h] = __fsub_rn(a, b);
    }
  }
  __syncwarp();
  for (int i = lane; i < hd; i += 32) x[i] = __fmul_rn(x[i], scale);
  __syncwarp();
}

// STYLE.md habit 4: the one place where runtime (format, head_dim) become template constants.
// fn(std::integral_constant<dfmt, F>, std::integral_constant<int, HD>); the caller has validated
// the pair through paged_kv_geometry_of (unsupported values never reach here).
template <class Fn>
void dispatch_format_hd(dfmt f, int hd, Fn&& fn) {
  auto by_hd = [&](auto fc) {
    switch (hd) {
      case 64: fn(fc, std::integral_constant<int, 64>{}); break;
      case 80: fn(fc, std::integral_constant<int, 80>{}); break;
      case 96: fn(fc, std::integral_constant<int, 96>{}); break;
      case 128: fn(fc, std::integral_constant<int, 128>{}); break;
      case 256: fn(fc, std::integral_constant<int, 256>{}); break;
      default: fail(errc::internal, "[cuda] dispatch: head_dim " + std::to_string(hd) + " slipped past validation");
    }
  };
  switch (f) {
    case dfmt::q8: by_hd(std::integral_constant<dfmt, dfmt::q8>{}); break;
    case dfmt::q4: by_hd(std::integral_constant<dfmt, dfmt::q4>{}); break;
    default: by_hd(std::integral_constant<dfmt, dfmt::f16>{}); break;
  }
}

// ---- helpers of the decode and prefill attention kernels (attn_decode.cu, attn_prefill.cu) ----

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// kvq::quantize_q8_ref (qmax 127) or kvq::quantize_q16_ref (qmax kq16_max) of one group given its
// absmax: the same IEEE operations, so scale and codes are bit-identical to the CPU's.
struct query_quant {
  float qmax, scale, inv;
};
__device__ __forceinline__ query_quant query_quant_of(float amax, float qmax) {
  const float s = __fdiv_rn(amax, qmax);
  return {qmax, s, s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f};
}
__device__ __forceinline__ int query_code(const query_quant& z, float x) {
  return (int)fminf(fmaxf(rintf(__fmul_rn(x, z.inv)), -z.qmax), z.qmax);
}
static_assert(kq16_max == 127 * 254, "the int16 query splits as 254 hi + lo");
// hi of q = 254 hi + lo with hi, lo in [-127, 127] (|q| <= kq16_max): q / 254 rounded half away from 0.
__device__ __forceinline__ int split_q16_hi(int q) { return (q + (q >= 0 ? 127 : -127)) / 254; }

// Scale si of a row's f16 scales packed two per 32-bit word.
__device__ __forceinline__ float scale_at(const uint32_t* w, int si) {
  return __half2float(__ushort_as_half((unsigned short)(w[si >> 1] >> (16 * (si & 1)))));
}

// K channel scale (paged_kv_view::k_lambda; docs/formats.md "Rotation and channel scale"): the
// lambda row [HD] of kv head h for sequence seq of the page table (stat_row[seq] picks the row), or
// nullptr without the channel scale. Queries are scaled by it in f32 before their rotation, as
// kv_cache_quant's attend: q . k = (q * lambda) . ((k - mu) / lambda) + q . mu, and the last term,
// the same for all of a query's keys, cancels in the softmax.
template <int HD>
__device__ __forceinline__ const float* k_lambda_row(const float* k_lambda, const int32_t* stat_row, int seq,
                                                     int n_kv_head, int h) {
  return k_lambda ? k_lambda + ((int64_t)stat_row[seq] * n_kv_head + h) * HD : nullptr;
}
__device__ __forceinline__ float lambda_scaled(float x, const float* lam, int c) {
  return lam ? __fmul_rn(x, lam[c]) : x;
}
// Host check of a view's K channel scale before an attention launch (op: "[cuda attn_decode]" ...).
inline void check_k_lambda(const paged_kv_view& kv, const char* op) {
  if (kv.k_lambda && (!kv.stat_row || kv.format.format == kv_format::f16))
    fail_input(std::string(op) + " K channel scale: k_lambda needs stat_row and a q8 / q4 cache");
}

// Byte i of token A's word and of token B's word, each in the low byte of one 16-bit lane.
__device__ __forceinline__ uint32_t pair_bytes(uint32_t wa, uint32_t wb, int i) {
  return __byte_perm(wa, wb, (unsigned)(i | i << 4 | (4 + i) << 8 | (4 + i) << 12));
}

}  // namespace kvq::cuda::detail
