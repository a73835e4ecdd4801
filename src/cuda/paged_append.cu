// Fused rotate-quantize-append into the paged layout, and the dequantize baseline.
#include <string>

#include "cuda/common.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

using namespace detail;

namespace {

constexpr int kAppendWarps = 4;

struct append_args {
  uint8_t* pool;
  dev_geom geo;
  const void* k;  // [n_tokens][n_kv_head][HD]
  const void* v;
  const int64_t* slots;  // [n_tokens]
  int64_t n_items;       // n_tokens * n_kv_head * 2
  int n_kv_head;
  int elem;              // 0 f16, 1 bf16, 2 f32
  const float* k_mu;     // K channel scale [rows][n_kv_head][HD], or nullptr
  const float* k_lambda;
  const int32_t* stat_row;  // [n_tokens]
  int rot_block;
  float rot_scale;
  uint16_t* ek;  // exact rows [n_slots][n_kv_head][ecap][HD] f16 (exact_rows_out), or nullptr
  uint16_t* ev;
  const int64_t* eslots;  // [n_tokens]
  int ecap;
};

__device__ __forceinline__ float load_any(const void* p, int64_t i, int elem) {
  return elem == 2 ? static_cast<const float*>(p)[i] : load_elem(p, i, elem == 1);
}

// One warp per (token, kv head, side). Mirrors kv_cache_quant::transform_side + quantize_row_ref:
// x -> (x - mu) / lambda (K with a channel scale) -> FWHT blocks -> f16 rounding -> per group absmax / qmax rounded up to f16 -> rint(x * (1/s))
// clamped -> code + offset -> pack (docs/formats.md).
template <dfmt F, int HD>
__global__ void __launch_bounds__(32 * kAppendWarps) append_kernel(append_args a) {
  detail::pdl_enter();  // first: the previous kernel's outputs (launch_pdl)
  using S = shape<F, HD>;
  __shared__ float xs[kAppendWarps][HD];
  __shared__ __align__(16) uint8_t us[kAppendWarps][HD];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = (int64_t)blockIdx.x * kAppendWarps + warp;
  if (item >= a.n_items) return;  // warp-uniform; only warp-level barriers follow
  const int side = (int)(item & 1);
  const int64_t th = item >> 1;
  const int64_t tok = th / a.n_kv_head;
  const int h = (int)(th % a.n_kv_head);
  const void* src = side ? a.v : a.k;
  const int64_t base = (tok * a.n_kv_head + h) * HD;
  const int64_t slot0 = a.slots[tok];
  if (slot0 < 0) return;  // warp-uniform: a token the caller keeps elsewhere (staged rows)
  // this token's exact row (exact_rows_out), or nullptr
  uint16_t* erow = nullptr;
  if (a.ek) {
    const int64_t es = a.eslots[tok];
    if (es >= 0) erow = (side ? a.ev : a.ek) + ((es / a.ecap * a.n_kv_head + h) * a.ecap + es % a.ecap) * HD;
  }
  // K channel scale: element c of the row becomes (x - mu_c) / lambda_c (lambda a power of two)
  const float* cmu = nullptr;
  const float* clam = nullptr;
  if (side == 0 && a.k_lambda) {
    const int64_t so = ((int64_t)a.stat_row[tok] * a.n_kv_head + h) * HD;
    cmu = a.k_mu + so;
    clam = a.k_lambda + so;
  }
  auto load_x = [&](int c) {
    const float x = load_any(src, base + c, a.elem);
    return clam ? __fdiv_rn(__fsub_rn(x, cmu[c]), clam[c]) : x;
  };
  if constexpr (HD % 32 == 0) {
    // Registers only: element k * 32 + lane in x[k]; FWHT stages h < 32 through shuffles, h >= 32 across
    // k; one 32-element group per k (group 32 when head_dim % 32 == 0).
    constexpr int EPL = HD / 32;
    float x[EPL];
#pragma unroll
    for (int k = 0; k < EPL; ++k) x[k] = load_x(k * 32 + lane);
    if (a.rot_block > 1) {
      for (int hs = 1; hs < 32 && hs < a.rot_block; hs *= 2) {
        const bool upper = lane & hs;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          const float y = __shfl_xor_sync(0xffffffffu, x[k], hs);
          x[k] = upper ? __fsub_rn(y, x[k]) : __fadd_rn(x[k], y);
        }
      }
#pragma unroll
      for (int hk = 1; hk < EPL; hk *= 2) {
        if (32 * hk >= a.rot_block) break;
#pragma unroll
        for (int k = 0; k < EPL; ++k)
          if (!(k & hk) && k + hk < EPL) {
            const float p = x[k], q = x[k + hk];
            x[k] = __fadd_rn(p, q);
            x[k + hk] = __fsub_rn(p, q);
          }
      }
#pragma unroll
      for (int k = 0; k < EPL; ++k) x[k] = __fmul_rn(x[k], a.rot_scale);
    }
    const int64_t page = slot0 / a.geo.page_size;
    const int row = (int)(slot0 % a.geo.page_size);
    uint8_t* blk = a.pool + page * a.geo.page_bytes + (int64_t)h * a.geo.head_bytes;
    uint8_t* codes = blk + (side ? a.geo.v_codes : a.geo.k_codes) + (int64_t)row * S::CB;
    if constexpr (F == dfmt::f16) {
#pragma unroll
      for (int k = 0; k < EPL; ++k)
        reinterpret_cast<uint16_t*>(codes)[k * 32 + lane] = __half_as_ushort(__float2half_rn(x[k]));
    } else {
      constexpr float qpos = F == dfmt::q8 ? 127.0f : 7.0f, qneg = F == dfmt::q8 ? 127.0f : 8.0f;
      constexpr int offset = F == dfmt::q8 ? 0 : 8;
      uint16_t* scales = reinterpret_cast<uint16_t*>(blk + (side ? a.geo.v_scales : a.geo.k_scales)) + (int64_t)row * EPL;
      float mx[EPL], mn[EPL];
#pragma unroll
      for (int k = 0; k < EPL; ++k) {
        x[k] = __half2float(__float2half_rn(x[k]));  // the cache stores f16-rounded values
        if (erow) erow[k * 32 + lane] = __half_as_ushort(__float2half_rn(x[k]));
        mx[k] = fmaxf(x[k], 0.0f);
        mn[k] = fminf(x[k], 0.0f);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
          mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], o));
          mn[k] = fminf(mn[k], __shfl_xor_sync(0xffffffffu, mn[k], o));
        }
#pragma unroll
      for (int k = 0; k < EPL; ++k) {
        const uint16_t sh = signed_scale_dev(mn[k], mx[k], qneg, qpos);
        const float sc = __half2float(__ushort_as_half(sh));
        const float inv = sc != 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
        const float c = fminf(fmaxf(rintf(__fmul_rn(x[k], inv)), -qneg), qpos);
        const int u = (int)c + offset;
        if (lane == k) scales[k] = sh;
        if constexpr (F == dfmt::q8) {
          codes[k * 32 + lane] = (uint8_t)(int8_t)u;
        } else {
          const int hi = __shfl_down_sync(0xffffffffu, u, 16);
          if (lane < 16) codes[k * 16 + lane] = (uint8_t)((u & 15) | (hi & 15) << 4);
        }
      }
    }
    return;
  }
  float* x = xs[warp];
  for (int i = lane; i < HD; i += 32) x[i] = load_x(i);
  if (a.rot_block > 1) fwht_row_warp(x, HD, a.rot_block, a.rot_scale, lane);
  __syncwarp();
  const int64_t page = slot0 / a.geo.page_size;
  const int row = (int)(slot0 % a.geo.page_size);
  uint8_t* blk = a.pool + page * a.geo.page_bytes + (int64_t)h * a.geo.head_bytes;
  uint8_t* codes = blk + (side ? a.geo.v_codes : a.geo.k_codes) + (int64_t)row * S::CB;
  if constexpr (F == dfmt::f16) {
    for (int i = lane; i < HD; i += 32) reinterpret_cast<uint16_t*>(codes)[i] = __half_as_ushort(__float2half_rn(x[i]));
    return;
  } else {
    constexpr int G = HD % 32 == 0 ? 32 : HD;
    constexpr int NG = HD / G;
    constexpr float qpos = F == dfmt::q8 ? 127.0f : 7.0f, qneg = F == dfmt::q8 ? 127.0f : 8.0f;
    constexpr int offset = F == dfmt::q8 ? 0 : 8;
    uint16_t* scales = reinterpret_cast<uint16_t*>(blk + (side ? a.geo.v_scales : a.geo.k_scales)) + (int64_t)row * NG;
    for (int i = lane; i < HD; i += 32) {
      x[i] = __half2float(__float2half_rn(x[i]));  // the cache stores f16-rounded values
      if (erow) erow[i] = __half_as_ushort(__float2half_rn(x[i]));
    }
    __syncwarp();
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      float mx = 0.0f, mn = 0.0f;
      for (int i = lane; i < G; i += 32) {
        mx = fmaxf(mx, x[gi * G + i]);
        mn = fminf(mn, x[gi * G + i]);
      }
      mx = warp_max(mx);
      mn = -warp_max(-mn);
      const uint16_t sh = signed_scale_dev(mn, mx, qneg, qpos);
      const float s = __half2float(__ushort_as_half(sh));
      const float inv = s != 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
      for (int i = lane; i < G; i += 32) {
        float c = rintf(__fmul_rn(x[gi * G + i], inv));
        c = fminf(fmaxf(c, -qneg), qpos);
        us[warp][gi * G + i] = (uint8_t)(int8_t)((int)c + offset);
      }
      if (lane == 0) scales[gi] = sh;
    }
    __syncwarp();
    const uint8_t* u = us[warp];
    if constexpr (F == dfmt::q8) {
      for (int w = lane; w < HD / 4; w += 32)
        reinterpret_cast<uint32_t*>(codes)[w] = reinterpret_cast<const uint32_t*>(u)[w];
    } else {
      for (int w = lane; w < S::CB / 4; w += 32) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * w + k;  // byte index in the row
          const int b = i / 16, beta = i % 16;
          const int half = (S::PARTIAL && b == S::NB - 1) ? 8 : 16;  // m / 2
          const uint32_t byte = (u[32 * b + beta] & 15u) | (uint32_t)(u[32 * b + beta + half] & 15u) << 4;
          word |= byte << (8 * k);
        }
        reinterpret_cast<uint32_t*>(codes)[w] = word;
      }
    }
  }
}

// kv_channel_stats_ref (src/cache/kv_cache_quant.cpp) on the device: block h = kv head, thread c =
// channel. The same double sums in token order (no contraction: __dadd_rn / __dmul_rn), the same
// roundings (double -> f32 -> f16 for mu; lround(log2) for the exponents).
__global__ void channel_stats_kernel(const float* x, int n_tokens, int nh, int hd, float* mu, float* lambda) {
  __shared__ double mxs;
  __shared__ double es;
  __shared__ double part[256];
  const int h = blockIdx.x, c = threadIdx.x;
  const int64_t stride = (int64_t)nh * hd;
  const float* xc = x + (int64_t)h * hd + c;
  double m = 0.0;
  for (int t = 0; t < n_tokens; ++t) m = __dadd_rn(m, (double)xc[t * stride]);
  m = m / n_tokens;
  double r = 0.0;
  for (int t = 0; t < n_tokens; ++t) {
    const double d = __dsub_rn((double)xc[t * stride], m);
    r = __dadd_rn(r, __dmul_rn(d, d));
  }
  r = sqrt(r / n_tokens);
  mu[(int64_t)h * hd + c] = __half2float(__float2half_rn(__double2float_rn(m)));
  part[c] = r;
  __syncthreads();
  if (c == 0) {
    double mx = 0.0;
    for (int i = 0; i < hd; ++i) mx = fmax(mx, part[i]);
    mxs = mx;
  }
  __syncthreads();
  const double mx = mxs;
  float* lam = lambda + (int64_t)h * hd;
  if (!(mx > 0.0)) {
    lam[c] = 1.0f;
    return;
  }
  const int e = (int)lround(log2(fmax(r, mx * 1e-3)));
  __syncthreads();
  part[c] = (double)e;
  __syncthreads();
  if (c == 0) {
    double s = 0.0;
    for (int i = 0; i < hd; ++i) s += part[i];
    es = s;
  }
  __syncthreads();
  const int shift = (int)lround(es / hd);
  lam[c] = ldexpf(1.0f, min(max(e - shift, -20), 20));
}

struct dequant_args {
  const uint8_t* src;
  dev_geom sg;
  uint8_t* dst;
  dev_geom dg;
  const int32_t* indices;
};

// One block per (page entry, kv head); each thread writes 8 f16 values (16 bytes) per step.
template <dfmt F, int HD>
__global__ void __launch_bounds__(128) dequant_kernel(dequant_args a) {
  using S = shape<F, HD>;
  if constexpr (F == dfmt::f16) {
    return;
  } else {
    const int64_t page = a.indices[blockIdx.x];
    const int h = blockIdx.y;
    const uint8_t* sb = a.src + page * a.sg.page_bytes + (int64_t)h * a.sg.head_bytes;
    uint8_t* db = a.dst + page * a.dg.page_bytes + (int64_t)h * a.dg.head_bytes;
    const int per_row = HD / 8;
    for (int side = 0; side < 2; ++side) {
      const uint8_t* codes = sb + (side ? a.sg.v_codes : a.sg.k_codes);
      const __half* scales = reinterpret_cast<const __half*>(sb + (side ? a.sg.v_scales : a.sg.k_scales));
      uint8_t* out = db + (side ? a.dg.v_codes : a.dg.k_codes);
      for (int i = threadIdx.x; i < a.sg.page_size * per_row; i += blockDim.x) {
        const int row = i / per_row, c8 = i % per_row * 8;
        const int b = c8 / 32, beta = c8 % 32;
        const float s = __half2float(scales[row * S::NS + S::scale_index(b)]);
        float y[8];
        if constexpr (F == dfmt::q8) {
          const uint2 w = *reinterpret_cast<const uint2*>(codes + (int64_t)row * S::CB + c8);
#pragma unroll
          for (int k = 0; k < 8; ++k) y[k] = s * (float)(int8_t)((k < 4 ? w.x : w.y) >> (8 * (k % 4)));
        } else {
          const int half = (S::PARTIAL && b == S::NB - 1) ? 8 : 16;
          const int shift = beta < half ? 0 : 4;
          const uint2 w = *reinterpret_cast<const uint2*>(codes + (int64_t)row * S::CB + 16 * b + beta % half);
#pragma unroll
          for (int k = 0; k < 8; ++k) y[k] = s * (float)((int)(((k < 4 ? w.x : w.y) >> (8 * (k % 4) + shift)) & 15u) - 8);
        }
        uint4 o;
        o.x = pack_half2(y[0], y[1]);
        o.y = pack_half2(y[2], y[3]);
        o.z = pack_half2(y[4], y[5]);
        o.w = pack_half2(y[6], y[7]);
        *reinterpret_cast<uint4*>(out + (int64_t)row * 2 * HD + 2 * c8) = o;
      }
    }
  }
}

void check_view(const paged_kv_view& kv, const char* op) {
  if (!kv.pool || !kv.indptr || !kv.indices || !kv.last_page_len || kv.batch < 0 || kv.n_pages < 1)
    fail_input(std::string("[") + op + "] incomplete paged_kv_view (pool, indptr, indices, last_page_len, n_pages >= 1)");
}

}  // namespace

void append_paged(const paged_kv_view& kv, const void* k, const void* v, kv_elem elem, const int64_t* slots,
                  int n_tokens, void* stream, const exact_rows_out* exact) {
  require();
  const paged_kv_geometry g = paged_kv_geometry_of(kv.format);
  if (kv.format.format == kv_format::kivi4)
    fail_unsupported("[cuda append_paged] kivi4 pages are written by append_kivi and quantize_kivi_groups");
  if (!kv.pool) fail_input("[cuda append_paged] paged_kv_view has no pool");
  if (elem != kv_elem::f16 && elem != kv_elem::bf16 && elem != kv_elem::f32)
    fail_unsupported("[cuda append_paged] input must be f16, bf16 or f32");
  if ((kv.k_mu == nullptr) != (kv.k_lambda == nullptr) || (kv.k_lambda && !kv.stat_row))
    fail_input("[cuda append_paged] K channel scale: k_mu, k_lambda and stat_row go together");
  if (kv.k_lambda && kv.format.format == kv_format::f16)
    fail_unsupported("[cuda append_paged] K channel scale on an f16 cache (the CPU applies it to compressed K only)");
  if (n_tokens < 0) fail_input("[cuda append_paged] n_tokens must be >= 0, got " + std::to_string(n_tokens));
  if (exact && kv.format.format == kv_format::f16)
    fail_unsupported("[cuda append_paged] exact rows of an f16 cache (its pages hold the exact rows)");
  if (exact && (!exact->k || !exact->v || !exact->slots || exact->cap < 1))
    fail_input("[cuda append_paged] exact rows: k, v, slots required and cap >= 1, got cap " +
               std::to_string(exact->cap));
  if (n_tokens == 0) return;
  if (!k || !v || !slots) fail_input("[cuda append_paged] k, v and slots must be device pointers");
  append_args a;
  a.pool = kv.pool;
  a.geo = to_dev(g, kv.format.page_size);
  a.k = k;
  a.v = v;
  a.slots = slots;
  a.n_items = (int64_t)n_tokens * kv.format.n_kv_head * 2;
  a.n_kv_head = kv.format.n_kv_head;
  a.elem = elem == kv_elem::f32 ? 2 : elem == kv_elem::bf16 ? 1 : 0;
  a.k_mu = kv.k_mu;
  a.k_lambda = kv.k_lambda;
  a.stat_row = kv.stat_row;
  a.rot_block = g.rot_block;
  a.rot_scale = g.rot_scale;
  a.ek = exact ? exact->k : nullptr;
  a.ev = exact ? exact->v : nullptr;
  a.eslots = exact ? exact->slots : nullptr;
  a.ecap = exact ? exact->cap : 1;
  const int64_t blocks = (a.n_items + kAppendWarps - 1) / kAppendWarps;
  dispatch_format_hd(to_dfmt(kv.format.format), kv.format.head_dim, [&](auto fc, auto hc) {
    detail::launch_pdl(append_kernel<decltype(fc)::value, decltype(hc)::value>, (unsigned)blocks, 32 * kAppendWarps, 0,
                       as_stream(stream), a);
  });
  check_launch("append_paged");
}

void channel_stats(const float* x, int n_tokens, int n_kv_head, int head_dim, float* mu, float* lambda, void* stream) {
  require();
  paged_kv_format f;
  f.format = kv_format::f16;
  f.head_dim = head_dim;
  f.n_kv_head = n_kv_head;
  paged_kv_geometry_of(f);  // head_dim in the supported set (<= 256), n_kv_head >= 1
  if (n_tokens < 1) fail_input("[cuda channel_stats] n_tokens must be >= 1, got " + std::to_string(n_tokens));
  if (!x || !mu || !lambda) fail_input("[cuda channel_stats] x, mu and lambda must be device pointers");
  channel_stats_kernel<<<(unsigned)n_kv_head, (unsigned)head_dim, 0, as_stream(stream)>>>(x, n_tokens, n_kv_head,
                                                                                          head_dim, mu, lambda);
  check_launch("channel_stats");
}

void dequantize_paged(const paged_kv_view& src, const paged_kv_view& dst, int n_entries, void* stream) {
  require();
  check_view(src, "cuda dequantize_paged");
  const paged_kv_geometry sg = paged_kv_geometry_of(src.format), dg = paged_kv_geometry_of(dst.format);
  if (src.format.format == kv_format::kivi4)
    fail_unsupported("[cuda dequantize_paged] kivi4 pages have no dequantize baseline");
  if (src.format.format == kv_format::f16 || dst.format.format != kv_format::f16 ||
      src.format.head_dim != dst.format.head_dim || src.format.n_kv_head != dst.format.n_kv_head ||
      src.format.page_size != dst.format.page_size || !dst.pool || dst.n_pages < src.n_pages)
    fail_input("[cuda dequantize_paged] dst must be an f16 pool of the same head_dim, n_kv_head, page_size and >= n_pages");
  if (n_entries < 0) fail_input("[cuda dequantize_paged] n_entries must be >= 0, got " + std::to_string(n_entries));
  if (n_entries == 0) return;
  dequant_args a{src.pool, to_dev(sg, src.format.page_size), dst.pool, to_dev(dg, dst.format.page_size), src.indices};
  dispatch_format_hd(to_dfmt(src.format.format), src.format.head_dim, [&](auto fc, auto hc) {
    dequant_kernel<decltype(fc)::value, decltype(hc)::value>
        <<<dim3((unsigned)n_entries, (unsigned)src.format.n_kv_head), 128, 0, as_stream(stream)>>>(a);
  });
  check_launch("dequantize_paged");
}

}  // namespace kvq::cuda
