// KIVI pages (kivi4, include/kvq/cuda.h): the append (exact f16 rows of K and V, V's q4a codes), the
// per-channel quantization of whole K groups, and the move of the residual's exact rows.
// Compiled with -fmad=false (src/cuda/CMakeLists.txt): the K quantizer repeats kv_quantize_ref.cpp's
// float and double expressions, which the CPU evaluates without contraction, so every product and
// sum here is rounded on its own exactly as there (bit-equal codes, scales and zeros).
#include <string>

#include "cuda/common.cuh"
#include "kvq/cuda.h"

namespace kvq::cuda {

using namespace detail;

namespace {

constexpr int kWarps = 4;
constexpr int kGroup = 32;  // KIVI group (rows per K scale group), V's q4a group (elements per scale)

struct kivi_append_args {
  uint8_t* pool;
  dev_geom geo;
  const void* k;  // [n_tokens][n_kv_head][HD]
  const void* v;
  const int64_t* slots;  // [n_tokens] V page slots (negative: none)
  int64_t n_items;       // n_tokens * n_kv_head * 2
  int n_kv_head, elem, rot_block;
  float rot_scale;
  uint16_t *ek, *ev;
  const int64_t* eslots;  // [n_tokens]
  int ecap;
};

// std::min / std::max as the CPU reference calls them (mn = min(mn, x)): on equal values (+0 / -0)
// the first argument is kept, so the sign of a zero minimum matches too (fminf leaves it open).
__device__ __forceinline__ float cpu_min(float a, float b) { return b < a ? b : a; }
__device__ __forceinline__ float cpu_max(float a, float b) { return a < b ? b : a; }

__device__ __forceinline__ float load_any(const void* p, int64_t i, int elem) {
  return elem == 2 ? static_cast<const float*>(p)[i] : load_elem(p, i, elem == 1);
}

// One warp per (token, kv head, side): kv_cache_quant::transform_side (FWHT for V, f16 rounding),
// the exact row, and for V quantize_row_ref(q4a, group 32): zero = f16(min), scale = f16_round_up(
// max(0, max - zero) / 15), code = clamp(rint((x - zero) * (1 / scale)), 0, 15).
template <int HD>
__global__ void __launch_bounds__(32 * kWarps) kivi_append_kernel(kivi_append_args a) {
  __shared__ float xs[kWarps][HD];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t item = (int64_t)blockIdx.x * kWarps + warp;
  if (item >= a.n_items) return;  // warp-uniform
  const int side = (int)(item & 1);
  const int64_t th = item >> 1, tok = th / a.n_kv_head;
  const int h = (int)(th % a.n_kv_head);
  const int64_t es = a.eslots[tok], slot = side ? a.slots[tok] : -1;
  if (es < 0 && slot < 0) return;
  float* x = xs[warp];
  const int64_t base = (tok * a.n_kv_head + h) * HD;
  for (int c = lane; c < HD; c += 32) x[c] = load_any(side ? a.v : a.k, base + c, a.elem);
  if (side && a.rot_block > 1) fwht_row_warp(x, HD, a.rot_block, a.rot_scale, lane);
  __syncwarp();
  for (int c = lane; c < HD; c += 32) x[c] = __half2float(__float2half_rn(x[c]));
  __syncwarp();
  if (es >= 0) {
    uint16_t* erow = (side ? a.ev : a.ek) + ((es / a.ecap * a.n_kv_head + h) * a.ecap + es % a.ecap) * HD;
    for (int c = lane; c < HD; c += 32) erow[c] = __half_as_ushort(__float2half_rn(x[c]));
  }
  if (slot < 0) return;
  constexpr int NG = HD / kGroup;
  const int64_t page = slot / a.geo.page_size;
  const int row = (int)(slot % a.geo.page_size);
  uint8_t* blk = a.pool + page * a.geo.page_bytes + (int64_t)h * a.geo.head_bytes;
  uint8_t* codes = blk + a.geo.v_codes + (int64_t)row * (HD / 2);
  uint16_t* sc = reinterpret_cast<uint16_t*>(blk + a.geo.v_scales) + (int64_t)row * 2 * NG;
#pragma unroll
  for (int g = 0; g < NG; ++g) {
    const float xv = x[g * kGroup + lane];
    // the group's min / max, ties kept by the lower lane: the first element on equal values, as the
    // CPU's sequential std::min / std::max
    float mn = xv, mx = xv;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float pn = __shfl_xor_sync(0xffffffffu, mn, o), px = __shfl_xor_sync(0xffffffffu, mx, o);
      const bool lower = !(lane & o);
      mn = lower ? cpu_min(mn, pn) : cpu_min(pn, mn);
      mx = lower ? cpu_max(mx, px) : cpu_max(px, mx);
    }
    const uint16_t zh = __half_as_ushort(__float2half_rn(mn));
    const float z = __half2float(__ushort_as_half(zh));
    const uint16_t sh = f16_round_up_dev(cpu_max(0.0f, mx - z) / 15.0f);
    const float s = __half2float(__ushort_as_half(sh));
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    const int u = (int)cpu_min(cpu_max(rintf((xv - z) * inv), 0.0f), 15.0f);
    const int hi = __shfl_down_sync(0xffffffffu, u, 16);  // block_kv4: byte i = e[i] | e[i + 16] << 4
    if (lane < 16) codes[g * 16 + lane] = (uint8_t)(u | hi << 4);
    if (lane == 0) {
      sc[g] = sh;
      sc[NG + g] = zh;
    }
  }
}

// ---- K per channel: quantize_channel_mse of kv_quantize_ref.cpp for n = 32 values ----

// f16 round to nearest and back (kvq::f32_to_f16 / f16_to_f32).
__device__ __forceinline__ uint16_t to_h(float v) { return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ float of_h(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// channel_sse: squared error of x[32] decoded with zero z and scale s > 0; codes to c_out if given.
__device__ double channel_sse(const float* x, float z, float s, int levels, uint8_t* c_out) {
  const float inv = 1.0f / s;
  double e = 0.0;
  for (int i = 0; i < kGroup; ++i) {
    const float v = x[i];
    const float c = cpu_min(cpu_max(rintf((v - z) * inv), 0.0f), (float)levels);
    if (c_out) c_out[i] = (uint8_t)c;
    const double d = (double)(s * c + z) - (double)v;
    e += d * d;
  }
  return e;
}

struct mse_state {
  const float* x;
  int levels;
  uint16_t best_z, best_s;
  double best;
  // kv_quantize_ref.cpp's `consider`: the pair's error, kept when it beats the best so far
  __device__ double consider(uint16_t zh, uint16_t sh) {
    const float z = of_h(zh), s = of_h(sh);
    if (!(s > 0.0f) || isinf(s) || isinf(z) || isnan(z)) return 1e300;
    const double e = channel_sse(x, z, s, levels, nullptr);
    if (e < best) {
      best = e;
      best_z = zh;
      best_s = sh;
    }
    return e;
  }
};

// One channel: u[32] codes (0..15), scale and zero as f16 bits. The CPU memoises the clip errors
// (memo[i][j]); here they are recomputed, which gives the same values and the same decisions (a
// pair already considered never beats the best again: its error is >= the best).
__device__ void quantize_channel_mse(const float* x, uint8_t* u, uint16_t* scale_out, uint16_t* zero_out) {
  constexpr int levels = 15;
  // quantize_group's asymmetric min/max start
  float mn = x[0], mx = x[0];
  for (int i = 1; i < kGroup; ++i) {
    mn = cpu_min(mn, x[i]);
    mx = cpu_max(mx, x[i]);
  }
  const uint16_t zh0 = to_h(mn);
  const float z0 = of_h(zh0);
  const uint16_t sh0 = f16_round_up_dev(cpu_max(0.0f, mx - z0) / (float)levels);
  const float s0 = of_h(sh0);
  if (!(s0 > 0.0f)) {  // constant channel: quantize_group's codes (all 0) stand
    for (int i = 0; i < kGroup; ++i) u[i] = 0;
    *scale_out = sh0;
    *zero_out = zh0;
    return;
  }
  mse_state st{x, levels, zh0, sh0, 0.0};
  st.best = channel_sse(x, z0, s0, levels, nullptr);
  constexpr int kSteps = 32;
  const float r = mx - mn;
  auto clip_error = [&](int i, int j) -> double {
    if (i < 0 || j < 0 || i + j >= kSteps) return 1e300;
    const uint16_t zh = to_h(mn + r * (float)i / kSteps);
    const float hi = mx - r * (float)j / kSteps;
    return st.consider(zh, to_h(cpu_max(0.0f, hi - of_h(zh)) / (float)levels));
  };
  int ci = 0, cj = 0;
  double ce = clip_error(0, 0);
  for (;;) {
    const int di[5] = {1, 0, 1, -1, 0}, dj[5] = {0, 1, 1, 0, -1};
    int ni = ci, nj = cj;
    double ne = ce;
    for (int k = 0; k < 5; ++k) {
      const double e = clip_error(ci + di[k], cj + dj[k]);
      if (e < ne) {
        ne = e;
        ni = ci + di[k];
        nj = cj + dj[k];
      }
    }
    if (ni == ci && nj == cj) break;
    ci = ni;
    cj = nj;
    ce = ne;
  }
  for (int it = 0; it < 4; ++it) {
    channel_sse(x, of_h(st.best_z), of_h(st.best_s), levels, u);
    double sc = 0.0, scc = 0.0, sx = 0.0, scx = 0.0;
    for (int i = 0; i < kGroup; ++i) {
      const double v = x[i];
      sc += u[i];
      scc += (double)u[i] * u[i];
      sx += v;
      scx += u[i] * v;
    }
    const double det = kGroup * scc - sc * sc;
    if (!(det > 0.0)) break;
    const double s = (kGroup * scx - sc * sx) / det, z = (sx - s * sc) / kGroup;
    if (!(s > 0.0) || s > 65504.0 || fabs(z) > 65504.0) break;
    const double before = st.best;
    st.consider(to_h((float)z), to_h((float)s));
    if (!(st.best < before)) break;
  }
  channel_sse(x, of_h(st.best_z), of_h(st.best_s), levels, u);
  *scale_out = st.best_s;
  *zero_out = st.best_z;
}

struct kivi_group_args {
  uint8_t* pool;
  dev_geom geo;
  const uint16_t* ek;  // [n_slots][n_kv_head][cap][HD]
  int cap, n_kv_head;
  const int64_t* src;  // [n_groups]
  const int64_t* dst;  // [n_groups]
};

// Grid (group, kv head); one thread per channel.
template <int HD>
__global__ void __launch_bounds__(HD) kivi_group_kernel(kivi_group_args a) {
  __shared__ uint8_t us[kGroup][HD];
  const int j = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
  const int64_t es = a.src[j], slot = a.dst[j];
  if (slot < 0) return;  // a padding entry (the whole block)
  const uint16_t* rows = a.ek + ((es / a.cap * a.n_kv_head + h) * a.cap + es % a.cap) * HD;
  float x[kGroup];
  for (int i = 0; i < kGroup; ++i) x[i] = of_h(rows[(int64_t)i * HD + c]);
  uint8_t u[kGroup];
  uint16_t sh, zh;
  quantize_channel_mse(x, u, &sh, &zh);
  for (int i = 0; i < kGroup; ++i) us[i][c] = u[i];
  const int64_t page = slot / a.geo.page_size;
  const int row0 = (int)(slot % a.geo.page_size);
  uint8_t* blk = a.pool + page * a.geo.page_bytes + (int64_t)h * a.geo.head_bytes;
  uint16_t* sc = reinterpret_cast<uint16_t*>(blk + a.geo.k_scales) + (int64_t)(row0 / kGroup) * 2 * HD;
  sc[c] = sh;
  sc[HD + c] = zh;
  __syncthreads();
  // pack: byte b of a row = e[32 (b / 16) + b % 16] | e[.. + 16] << 4
  uint8_t* codes = blk + a.geo.k_codes + (int64_t)row0 * (HD / 2);
  for (int i = c; i < kGroup * HD / 2; i += HD) {
    const int r = i / (HD / 2), b = i % (HD / 2);
    const int e = 32 * (b / 16) + b % 16;
    codes[(int64_t)r * (HD / 2) + b] = (uint8_t)(us[r][e] | us[r][e + 16] << 4);
  }
}

__global__ void move_rows_kernel(uint16_t* k, uint16_t* v, int n_kv_head, int hd, int cap, const int32_t* moves) {
  const int4 m = reinterpret_cast<const int4*>(moves)[blockIdx.x];  // {slot, dst_row, src_row, n_rows}
  const int h = blockIdx.y;
  const int64_t base = ((int64_t)m.x * n_kv_head + h) * cap * hd;
  uint16_t* side = blockIdx.z ? v : k;
  for (int r = 0; r < m.w; ++r) {  // in row order: a row is read before any later row overwrites it
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
      const uint16_t t = side[base + (int64_t)(m.z + r) * hd + c];
      side[base + (int64_t)(m.y + r) * hd + c] = t;
    }
    __syncthreads();
  }
}

template <class Fn>
void by_hd(int hd, Fn&& fn) {
  switch (hd) {
    case 64: fn(std::integral_constant<int, 64>{}); break;
    case 96: fn(std::integral_constant<int, 96>{}); break;
    case 128: fn(std::integral_constant<int, 128>{}); break;
    case 256: fn(std::integral_constant<int, 256>{}); break;
    default: fail(errc::internal, "[cuda kivi] head_dim " + std::to_string(hd) + " slipped past validation");
  }
}

void check_kivi(const paged_kv_view& kv, const char* op) {
  paged_kv_geometry_of(kv.format);
  if (kv.format.format != kv_format::kivi4)
    fail_unsupported(std::string("[") + op + "] needs kivi4 pages, got '" + kv_traits(kv.format.format).name + "'");
  if (!kv.pool) fail_input(std::string("[") + op + "] paged_kv_view has no pool");
}

}  // namespace

void append_kivi(const paged_kv_view& kv, const void* k, const void* v, kv_elem elem, const int64_t* slots,
                 int n_tokens, const exact_rows_out& exact, void* stream) {
  require();
  check_kivi(kv, "cuda append_kivi");
  const paged_kv_geometry g = paged_kv_geometry_of(kv.format);
  if (n_tokens < 0) fail_input("[cuda append_kivi] n_tokens must be >= 0, got " + std::to_string(n_tokens));
  if (!exact.k || !exact.v || !exact.slots || exact.cap < 1)
    fail_input("[cuda append_kivi] exact rows: k, v, slots required and cap >= 1, got cap " +
               std::to_string(exact.cap));
  if (n_tokens == 0) return;
  if (!k || !v || !slots) fail_input("[cuda append_kivi] k, v and slots must be device pointers");
  kivi_append_args a;
  a.pool = kv.pool;
  a.geo = to_dev(g, kv.format.page_size);
  a.k = k;
  a.v = v;
  a.slots = slots;
  a.n_items = (int64_t)n_tokens * kv.format.n_kv_head * 2;
  a.n_kv_head = kv.format.n_kv_head;
  a.elem = elem == kv_elem::f32 ? 2 : elem == kv_elem::bf16 ? 1 : 0;
  a.rot_block = g.rot_block;
  a.rot_scale = g.rot_scale;
  a.ek = exact.k;
  a.ev = exact.v;
  a.eslots = exact.slots;
  a.ecap = exact.cap;
  const int64_t blocks = (a.n_items + kWarps - 1) / kWarps;
  by_hd(kv.format.head_dim, [&](auto hc) {
    kivi_append_kernel<decltype(hc)::value><<<(unsigned)blocks, 32 * kWarps, 0, as_stream(stream)>>>(a);
  });
  check_launch("append_kivi");
}

void quantize_kivi_groups(const paged_kv_view& kv, const uint16_t* exact_k, int cap, const int64_t* src_rows,
                          const int64_t* dst_slots, int n_groups, void* stream) {
  require();
  check_kivi(kv, "cuda quantize_kivi_groups");
  const paged_kv_geometry g = paged_kv_geometry_of(kv.format);
  if (n_groups < 0) fail_input("[cuda quantize_kivi_groups] n_groups must be >= 0, got " + std::to_string(n_groups));
  if (n_groups == 0) return;
  if (!exact_k || !src_rows || !dst_slots || cap < kGroup)
    fail_input("[cuda quantize_kivi_groups] exact_k, src_rows, dst_slots required and cap >= 32, got cap " +
               std::to_string(cap));
  kivi_group_args a{kv.pool, to_dev(g, kv.format.page_size), exact_k, cap, kv.format.n_kv_head, src_rows, dst_slots};
  by_hd(kv.format.head_dim, [&](auto hc) {
    constexpr int HD = decltype(hc)::value;
    kivi_group_kernel<HD><<<dim3((unsigned)n_groups, (unsigned)kv.format.n_kv_head), HD, 0, as_stream(stream)>>>(a);
  });
  check_launch("quantize_kivi_groups");
}

void move_exact_rows(uint16_t* k, uint16_t* v, int n_kv_head, int head_dim, int cap, const int32_t* moves, int n,
                     void* stream) {
  require();
  if (n < 0 || n_kv_head < 1 || head_dim < 1 || cap < 1)
    fail_input("[cuda move_exact_rows] n >= 0, n_kv_head, head_dim and cap >= 1 required");
  if (n == 0) return;
  if (!k || !v || !moves) fail_input("[cuda move_exact_rows] k, v and moves must be device pointers");
  move_rows_kernel<<<dim3((unsigned)n, (unsigned)n_kv_head, 2), 128, 0, as_stream(stream)>>>(k, v, n_kv_head, head_dim,
                                                                                             cap, moves);
  check_launch("move_exact_rows");
}

}  // namespace kvq::cuda
