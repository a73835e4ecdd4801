// Scalar reference quantizers of the KV formats: per-token rows, KIVI per-channel groups and the
// int8 query. These are the oracle that SIMD / CUDA tiers must reproduce bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvq/error.h"
#include "kvq/f16.h"
#include "kvq/quant.h"

namespace kvq {

uint16_t f16_round_up(float v) {
  uint16_t h = f32_to_f16(v);
  if (f16_to_f32(h) < v && h < 0x7bff) ++h;  // positive: next representable value
  return h;
}

namespace {

// Index of the level nearest y (levels ascending; a tie goes to the upper level).
inline int nearest_level(const int8_t* lv, int n_levels, float y) {
  int c = 0;
  while (c + 1 < n_levels && y >= 0.5f * ((float)lv[c] + (float)lv[c + 1])) ++c;
  return c;
}

// Squared error of n values (stride floats apart) coded with scale s (an f16 value, != 0) as the
// nearest levels; writes the codes to u when non-null.
double levels_sse(const int8_t* lv, int n_levels, const float* x, int n, int stride, float s, uint8_t* u) {
  const float inv = 1.0f / s;
  double e = 0.0;
  for (int i = 0; i < n; ++i) {
    const float v = x[(int64_t)i * stride];
    const int c = nearest_level(lv, n_levels, v * inv);
    if (u) u[i] = (uint8_t)c;
    const double d = (double)(s * (float)lv[c]) - (double)v;
    e += d * d;
  }
  return e;
}

// Non-uniform formats (quant.h): one signed f16 scale, codes the nearest of the 2^b levels.
// Start: the element of largest magnitude (the first such) at levels[0]; then two least-squares
// refits of the scale to the current codes (s = sum x l / sum l^2, rounded to nearest f16), each
// kept only when the squared error drops. A group whose start scale rounds to 0 gets scale 0 and
// the codes of the level nearest 0 (value 0).
void quantize_group_levels(const kv_format_traits& t, const float* x, int n, int stride, uint8_t* u,
                           uint16_t* scale_out) {
  const int8_t* lv = t.levels;
  const int nl = 1 << t.bits;
  float ext = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = x[(int64_t)i * stride];
    if (std::fabs(v) > std::fabs(ext)) ext = v;
  }
  uint16_t sh = f32_to_f16(ext / (float)lv[0]);
  if (f16_to_f32(sh) == 0.0f) {
    const int c0 = nearest_level(lv, nl, 0.0f);
    for (int i = 0; i < n; ++i) u[i] = (uint8_t)c0;
    *scale_out = 0;
    return;
  }
  double best = levels_sse(lv, nl, x, n, stride, f16_to_f32(sh), u);
  uint8_t c[1024];
  for (int it = 0; it < 2; ++it) {
    double sxl = 0.0, sll = 0.0;
    for (int i = 0; i < n; ++i) {
      const double l = lv[u[i]];
      sxl += (double)x[(int64_t)i * stride] * l;
      sll += l * l;
    }
    if (!(sll > 0.0)) break;
    const double s = sxl / sll;
    if (!(std::fabs(s) <= 65504.0)) break;
    const uint16_t h = f32_to_f16((float)s);
    if (h == sh || f16_to_f32(h) == 0.0f) break;
    const double e = levels_sse(lv, nl, x, n, stride, f16_to_f32(h), c);
    if (!(e < best)) break;
    best = e;
    sh = h;
    std::copy(c, c + n, u);
  }
  *scale_out = sh;
}

// Quantizes n values (stride `stride` floats apart) sharing one scale (and zero) into u[n].
void quantize_group(const kv_format_traits& t, const float* x, int n, int stride, uint8_t* u,
                    uint16_t* scale_out, uint16_t* zero_out) {
  if (t.levels) return quantize_group_levels(t, x, n, stride, u, scale_out);
  if (!t.asymmetric) {
    // Signed scale (as llama.cpp's q4_0): the element of largest magnitude maps to the negative end
    // -qneg of the code range, the other sign uses up to +qpos, so 4 bits use all 16 codes
    // [-8, 7] and no element is clamped: |x - d * c| <= |d| / 2 everywhere. The sign of d is
    // stored in the f16 scale. q8 keeps +-127 (qneg == qpos) and a non-negative scale.
    const int qpos = t.code_max - t.code_offset;  // 127, 7, 3, 1
    const int qneg = t.code_offset - t.code_min;  // 127, 8, 4, 2
    float mn = 0.0f, mx = 0.0f;
    for (int i = 0; i < n; ++i) {
      mn = std::min(mn, x[(int64_t)i * stride]);
      mx = std::max(mx, x[(int64_t)i * stride]);
    }
    const bool neg = qneg == qpos || -mn >= mx;  // the extreme element is negative (or q8)
    const float ext = neg ? -mn : mx, other = neg ? mx : -mn;
    const float mag = std::max(ext / (float)qneg, other / (float)qpos);
    const uint16_t mh = f16_round_up(mag);
    const uint16_t sh = neg || mh == 0 ? mh : (uint16_t)(mh | 0x8000u);
    const float s = f16_to_f32(sh);
    const float inv = s != 0.0f ? 1.0f / s : 0.0f;
    for (int i = 0; i < n; ++i) {
      float c = std::rint(x[(int64_t)i * stride] * inv);
      c = std::min(std::max(c, (float)-qneg), (float)qpos);
      u[i] = (uint8_t)(int8_t)((int)c + t.code_offset);
    }
    *scale_out = sh;
    return;
  }
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = std::min(mn, x[(int64_t)i * stride]);
    mx = std::max(mx, x[(int64_t)i * stride]);
  }
  const uint16_t zh = f32_to_f16(mn);
  const float z = f16_to_f32(zh);
  const int levels = t.code_max - t.code_min;  // 2^b - 1
  const uint16_t sh = f16_round_up(std::max(0.0f, mx - z) / (float)levels);
  const float s = f16_to_f32(sh);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int i = 0; i < n; ++i) {
    float c = std::rint((x[(int64_t)i * stride] - z) * inv);
    c = std::min(std::max(c, 0.0f), (float)levels);
    u[i] = (uint8_t)(int8_t)((int)c + t.code_min);  // 8 bits: stored as c - 128
  }
  *scale_out = sh;
  *zero_out = zh;
}

// Squared error of n values (stride floats apart) decoded with zero z and scale s > 0:
// c = clamp(rint((x - z) * (1 / s)), 0, levels), value = s * c + z (dequantize_channel_group_ref's
// arithmetic). Writes c when c_out is non-null.
double channel_sse(const float* x, int n, int stride, float z, float s, int levels, uint8_t* c_out) {
  const float inv = 1.0f / s;
  double e = 0.0;
  for (int i = 0; i < n; ++i) {
    const float v = x[(int64_t)i * stride];
    const float c = std::min(std::max(std::rint((v - z) * inv), 0.0f), (float)levels);
    if (c_out) c_out[i] = (uint8_t)c;
    const double d = (double)(s * c + z) - (double)v;
    e += d * d;
  }
  return e;
}

// KIVI per-channel K: the (zero, scale) pair of least squared error over the group, as in
// MSE-optimal clipping of a uniform quantizer (e.g. Banner et al. 2019, arXiv:1810.05723, ACIQ;
// Shao et al. 2024, OmniQuant, arXiv:2308.13137, learnable clipping) followed by a least-squares
// refit of scale and zero to the chosen codes (one step of Lloyd's alternating minimisation).
//  1. the plain min/max pair (quantize_group) is the starting point and the fallback: the result
//     never has a larger squared error;
//  2. clipping: the range [mn + i r / 32, mx - j r / 32] (r = mx - mn, i + j < 32), searched from
//     (i, j) = (0, 0) by steepest descent over the moves i+1, j+1, both, i-1, j-1 until none lowers
//     the error (the error is near-convex in (i, j): on tinylit K the descent's result is within
//     0.1 % of the best of the full grid, about 6 evaluations per channel instead of 500);
//  3. up to 4 least-squares refits: with the codes c fixed, (s, z) = argmin sum (s c + z - x)^2,
//     rounded to f16, kept while the error drops.
// Zero and scale are f16 rounded to nearest (the codes are clamped, so no rounding up is needed).
// On tinylit-hd64-gqa4 K (T = 64, 4 bits) the squared error is 0.82x that of min/max.
void quantize_channel_mse(const kv_format_traits& t, const float* x, int n, int stride, uint8_t* u,
                          uint16_t* scale_out, uint16_t* zero_out) {
  quantize_group(t, x, n, stride, u, scale_out, zero_out);  // min/max; the codes are u + code_min
  const float s0 = f16_to_f32(*scale_out);
  if (!(s0 > 0.0f)) return;  // constant channel: exact already
  const int levels = t.code_max - t.code_min;
  uint16_t best_z = *zero_out, best_s = *scale_out;
  double best = channel_sse(x, n, stride, f16_to_f32(best_z), s0, levels, nullptr);
  const auto consider = [&](uint16_t zh, uint16_t sh) {
    const float z = f16_to_f32(zh), s = f16_to_f32(sh);
    if (!(s > 0.0f) || !std::isfinite(s) || !std::isfinite(z)) return 1e300;
    const double e = channel_sse(x, n, stride, z, s, levels, nullptr);
    if (e < best) {
      best = e;
      best_z = zh;
      best_s = sh;
    }
    return e;
  };
  float mn = x[0], mx = x[0];
  for (int i = 1; i < n; ++i) {
    mn = std::min(mn, x[(int64_t)i * stride]);
    mx = std::max(mx, x[(int64_t)i * stride]);
  }
  constexpr int kSteps = 32;  // clip step r / 32 (about half a 4-bit step)
  const float r = mx - mn;
  double memo[kSteps][kSteps];  // error of clip (i, j); < 0: not yet evaluated
  for (auto& row : memo)
    for (double& e : row) e = -1.0;
  const auto clip_error = [&](int i, int j) {
    if (i < 0 || j < 0 || i + j >= kSteps) return 1e300;
    if (memo[i][j] < 0.0) {
      const uint16_t zh = f32_to_f16(mn + r * (float)i / kSteps);
      const float hi = mx - r * (float)j / kSteps;
      memo[i][j] = consider(zh, f32_to_f16(std::max(0.0f, hi - f16_to_f32(zh)) / (float)levels));
    }
    return memo[i][j];
  };
  int ci = 0, cj = 0;
  double ce = clip_error(0, 0);
  for (;;) {
    static constexpr int di[5] = {1, 0, 1, -1, 0}, dj[5] = {0, 1, 1, 0, -1};
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
  for (int it = 0; it < 4; ++it) {  // (u holds the codes of the current best pair)
    channel_sse(x, n, stride, f16_to_f32(best_z), f16_to_f32(best_s), levels, u);
    double sc = 0.0, scc = 0.0, sx = 0.0, scx = 0.0;
    for (int i = 0; i < n; ++i) {
      const double v = x[(int64_t)i * stride];
      sc += u[i];
      scc += (double)u[i] * u[i];
      sx += v;
      scx += u[i] * v;
    }
    const double det = n * scc - sc * sc;  // 0 when every code is equal
    if (!(det > 0.0)) break;
    const double s = (n * scx - sc * sx) / det, z = (sx - s * sc) / n;
    if (!(s > 0.0) || s > 65504.0 || std::fabs(z) > 65504.0) break;
    const double before = best;
    consider(f32_to_f16((float)z), f32_to_f16((float)s));
    if (!(best < before)) break;
  }
  channel_sse(x, n, stride, f16_to_f32(best_z), f16_to_f32(best_s), levels, u);
  for (int i = 0; i < n; ++i) u[i] = (uint8_t)(int8_t)((int)u[i] + t.code_min);  // 8 bits: c - 128
  *scale_out = best_s;
  *zero_out = best_z;
}

inline float code_value(const kv_format_traits& t, uint8_t u) {
  return t.levels ? (float)t.levels[u] : t.bits == 8 ? (float)(int8_t)u : (float)u;
}

}  // namespace

void quantize_row_ref(kv_format f, const float* x, int head_dim, int group, uint8_t* codes,
                      uint16_t* scales) {
  const auto& t = kv_traits(f);
  KVQ_ASSERT(t.layout == kv_layout::per_token && head_dim % group == 0 && head_dim % 8 == 0);
  const int ng = head_dim / group;
  uint8_t u[1024];
  KVQ_ASSERT(head_dim <= 1024);
  for (int g = 0; g < ng; ++g)
    quantize_group(t, x + g * group, group, 1, u + g * group, &scales[g], t.asymmetric ? &scales[ng + g] : nullptr);
  pack_codes(t.bits, u, head_dim, codes);
}

void dequantize_row_ref(kv_format f, const uint8_t* codes, const uint16_t* scales, int head_dim,
                        int group, float* y) {
  const auto& t = kv_traits(f);
  KVQ_ASSERT(t.layout == kv_layout::per_token && head_dim % group == 0 && head_dim <= 1024);
  const int ng = head_dim / group;
  uint8_t u[1024];
  unpack_codes(t.bits, codes, head_dim, u);
  for (int g = 0; g < ng; ++g) {
    const float s = f16_to_f32(scales[g]);
    if (!t.asymmetric) {  // no "+ 0": a negative scale times code 0 stays -0, as on the GPU
      for (int i = g * group; i < (g + 1) * group; ++i) y[i] = s * (code_value(t, u[i]) - (float)t.code_offset);
      continue;
    }
    const float z = f16_to_f32(scales[ng + g]);
    for (int i = g * group; i < (g + 1) * group; ++i) y[i] = s * (code_value(t, u[i]) - (float)t.code_offset) + z;
  }
}

void quantize_channel_group_ref(kv_format f, const float* x, int n_tokens, int head_dim,
                                uint8_t* codes, uint16_t* scales) {
  const auto& t = kv_traits(f);
  KVQ_ASSERT(t.layout == kv_layout::per_channel && head_dim % 8 == 0 && n_tokens >= 1);
  std::vector<uint8_t> u((size_t)n_tokens * head_dim), col(n_tokens);
  for (int c = 0; c < head_dim; ++c) {
    quantize_channel_mse(t, x + c, n_tokens, head_dim, col.data(), &scales[c], &scales[head_dim + c]);
    for (int j = 0; j < n_tokens; ++j) u[(size_t)j * head_dim + c] = col[j];
  }
  const size_t row = kv_code_bytes(f, head_dim);
  for (int j = 0; j < n_tokens; ++j) pack_codes(t.bits, u.data() + (size_t)j * head_dim, head_dim, codes + j * row);
}

void dequantize_channel_group_ref(kv_format f, const uint8_t* codes, const uint16_t* scales,
                                  int n_tokens, int head_dim, float* y) {
  const auto& t = kv_traits(f);
  KVQ_ASSERT(t.layout == kv_layout::per_channel && head_dim <= 1024);
  const size_t row = kv_code_bytes(f, head_dim);
  uint8_t u[1024];
  for (int j = 0; j < n_tokens; ++j) {
    unpack_codes(t.bits, codes + j * row, head_dim, u);
    for (int c = 0; c < head_dim; ++c)
      y[(size_t)j * head_dim + c] =
          f16_to_f32(scales[c]) * (code_value(t, u[c]) - (float)t.code_offset) + f16_to_f32(scales[head_dim + c]);
  }
}

namespace {

// Symmetric absmax quantization of a query to integers in [-qmax, qmax]; returns the scale.
template <class Q>
float quantize_query(const float* x, int n, float qmax, Q* q) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / qmax;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int i = 0; i < n; ++i) q[i] = (Q)std::min(std::max(std::rint(x[i] * inv), -qmax), qmax);
  return s;
}

}  // namespace

float quantize_q16_ref(const float* x, int n, int16_t* q) { return quantize_query(x, n, (float)kq16_max, q); }

float quantize_q8_ref(const float* x, int n, int8_t* q) { return quantize_query(x, n, 127.0f, q); }

}  // namespace kvq
