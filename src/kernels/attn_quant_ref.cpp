// Fused compressed-domain attention, scalar reference tier (the oracle of the SIMD tiers), and the
// dequantize-then-attend baseline.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/attn_quant_tiers.h"
#include "kvq/attention.h"
#include "kvq/cpu.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

constexpr int kBlock = 32;  // keys per online-softmax step

inline int code_int(const kv_format_traits& t, uint8_t u) {
  return t.levels ? (int)t.levels[u] : t.bits == 8 ? (int)(int8_t)u : (int)u;
}

// Row r of a dense side as f32.
void load_dense_row(const kv_quant_side& s, int r, int hd, float* y) {
  const uint8_t* p = s.codes + (int64_t)r * s.code_stride;
  switch (s.format) {
    case kv_format::f32:
      for (int i = 0; i < hd; ++i) y[i] = reinterpret_cast<const float*>(p)[i];
      break;
    case kv_format::f16:
      for (int i = 0; i < hd; ++i) y[i] = f16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
      break;
    default:
      for (int i = 0; i < hd; ++i) y[i] = bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
      break;
  }
}

}  // namespace

// Row r of a V side (dense or per-token) as f32.
void load_v_row_ref(const kv_quant_side& s, int r, int hd, float* y) {
  const auto& t = kv_traits(s.format);
  if (t.layout == kv_layout::dense) return load_dense_row(s, r, hd, y);
  dequantize_row_ref(s.format, s.codes + (int64_t)r * s.code_stride, s.scales + (int64_t)r * s.scale_stride, hd,
                     s.group, y);
}

namespace {

template <class Q>
void qk_i32_ref_t(const kv_quant_side& k, int r0, int n_rows, const Q* q8, int hd, int32_t* dots) {
  const auto& t = kv_traits(k.format);
  const int ng = hd / k.group;
  uint8_t u[1024];
  for (int j = 0; j < n_rows; ++j) {
    unpack_codes(t.bits, k.codes + (int64_t)(r0 + j) * k.code_stride, hd, u);
    for (int g = 0; g < ng; ++g) {
      int32_t acc = 0;
      for (int i = g * k.group; i < (g + 1) * k.group; ++i) acc += (int32_t)q8[i] * code_int(t, u[i]);
      dots[j * ng + g] = acc;
    }
  }
}

template <class Q>
void group_sums_t(const Q* q8, int hd, int group, int32_t* sums) {
  for (int g = 0; g < hd / group; ++g) {
    int32_t s = 0;
    for (int i = g * group; i < (g + 1) * group; ++i) s += q8[i];
    sums[g] = s;
  }
}

}  // namespace

void qk_i32_ref(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots) {
  qk_i32_ref_t(k, r0, n_rows, q8, hd, dots);
}
void qk_i32_ref(const kv_quant_side& k, int r0, int n_rows, const int16_t* q16, int hd, int32_t* dots) {
  qk_i32_ref_t(k, r0, n_rows, q16, hd, dots);
}
void q8_group_sums(const int8_t* q8, int hd, int group, int32_t* sums) { group_sums_t(q8, hd, group, sums); }
void q8_group_sums(const int16_t* q16, int hd, int group, int32_t* sums) { group_sums_t(q16, hd, group, sums); }

namespace {

// 8-bit per-token K groups above kq8_k_group_max could wrap the i32 group dot (issue 15 item 4):
// refused by every tier, as make_kv_cache refuses them, rather than returning a wrong-signed score.
void check_k_group(const kv_quant_view& kv) {
  const auto& tk = kv_traits(kv.k.format);
  if (tk.layout == kv_layout::per_token && tk.bits == 8 && kv.k.group > kq8_k_group_max)
    fail_unsupported("[attn_quant] 8-bit K group " + std::to_string(kv.k.group) + " exceeds " +
                     std::to_string(kq8_k_group_max) + ", the largest whose integer dot fits in int32");
}

}  // namespace

void attn_quant_ref(const kv_quant_view& kv, const attn_query_view& qv, attn_state* states) {
  const int hd = kv.head_dim, ng = qv.n_group, ntq = qv.n_tokens * ng;
  const auto& tk = kv_traits(kv.k.format);
  check_k_group(kv);
  KVQ_ASSERT(hd <= 1024 && kv_traits(kv.v.format).layout != kv_layout::per_channel);
  thread_local std::vector<key_span> span;  // rows each query token may see (qv.spec)
  thread_local std::vector<float> sc, fold, row;
  thread_local std::vector<int32_t> qsum, dots;
  span.resize(qv.n_tokens);
  const key_span all = qv.tile_rows(kv.pos_begin, kv.n_pos, span.data());
  const int lo_min = all.lo, max_limit = all.hi;
  if (max_limit == 0) return;
  auto sees = [&](int t, int r) { return r >= span[t].lo && r < span[t].hi; };
  sc.resize((size_t)ntq * kBlock);
  row.resize(hd);
  const int ngk = tk.layout == kv_layout::per_token ? hd / kv.k.group : 0;
  if (tk.layout == kv_layout::per_token) {
    KVQ_ASSERT((qv.q8 || qv.q16) && qv.q8_scale);
    qsum.resize((size_t)ntq * ngk);
    dots.resize(ngk);
    for (int t = 0; t < qv.n_tokens; ++t)
      for (int g = 0; g < ng; ++g) {
        const int64_t at = t * qv.stride_t + (int64_t)g * hd;
        int32_t* sums = &qsum[(size_t)(t * ng + g) * ngk];
        if (qv.q16) q8_group_sums(qv.q16 + at, hd, kv.k.group, sums);
        else q8_group_sums(qv.q8 + at, hd, kv.k.group, sums);
      }
  }
  if (tk.layout == kv_layout::per_channel) fold.resize((size_t)ntq * (hd + 1));
  int cur_group = -1;
  uint8_t u[1024];
  for (int p0 = lo_min; p0 < max_limit; p0 += kBlock) {
    const int n = std::min(kBlock, max_limit - p0);
    for (int j = 0; j < n; ++j) {
      const int r = p0 + j;
      if (tk.layout == kv_layout::per_token) {
        const uint16_t* s = kv.k.scales + (int64_t)r * kv.k.scale_stride;
        for (int t = 0; t < qv.n_tokens; ++t) {
          if (!sees(t, r)) continue;
          for (int g = 0; g < ng; ++g) {
            const int64_t at = t * qv.stride_t + (int64_t)g * hd;
            if (qv.q16) qk_i32_ref(kv.k, r, 1, qv.q16 + at, hd, dots.data());
            else qk_i32_ref(kv.k, r, 1, qv.q8 + at, hd, dots.data());
            const int32_t* qs = &qsum[(size_t)(t * ng + g) * ngk];
            const float* qsc = q8_scales(qv, t, g, ngk);
            float acc = 0.0f;
            for (int gr = 0; gr < ngk; ++gr) {
              const float f = qsc[qv.q8_group ? gr : 0];
              acc += f16_to_f32(s[gr]) * (float)(dots[gr] - tk.code_offset * qs[gr]) * f;
              if (tk.asymmetric) acc += f16_to_f32(s[ngk + gr]) * (float)qs[gr] * f;
            }
            sc[(size_t)(t * ng + g) * kBlock + j] = qv.spec.logit(acc * qv.spec.scale);
          }
        }
      } else if (tk.layout == kv_layout::per_channel) {
        const int gi = r / kv.k.group;
        if (gi != cur_group) {  // fold the group's per-channel scales into the float queries
          cur_group = gi;
          const uint16_t* s = kv.k.scales + (int64_t)gi * kv.k.scale_stride;
          for (int t = 0; t < qv.n_tokens; ++t)
            for (int g = 0; g < ng; ++g) {
              const float* q = qv.q + t * qv.stride_t + (int64_t)g * hd;
              float* a = &fold[(size_t)(t * ng + g) * (hd + 1)];
              float b = 0.0f;
              for (int c = 0; c < hd; ++c) {
                const float sc_c = f16_to_f32(s[c]);
                a[c] = q[c] * sc_c;
                b += q[c] * (f16_to_f32(s[hd + c]) - (float)tk.code_offset * sc_c);
              }
              a[hd] = b;
            }
        }
        unpack_codes(tk.bits, kv.k.codes + (int64_t)r * kv.k.code_stride, hd, u);
        for (int t = 0; t < qv.n_tokens; ++t) {
          if (!sees(t, r)) continue;
          for (int g = 0; g < ng; ++g) {
            const float* a = &fold[(size_t)(t * ng + g) * (hd + 1)];
            float acc = 0.0f;
            for (int c = 0; c < hd; ++c) acc += a[c] * (float)code_int(tk, u[c]);
            sc[(size_t)(t * ng + g) * kBlock + j] = qv.spec.logit((acc + a[hd]) * qv.spec.scale);
          }
        }
      } else {
        load_dense_row(kv.k, r, hd, row.data());
        for (int t = 0; t < qv.n_tokens; ++t) {
          if (!sees(t, r)) continue;
          for (int g = 0; g < ng; ++g) {
            const float* q = qv.q + t * qv.stride_t + (int64_t)g * hd;
            float acc = 0.0f;
            for (int i = 0; i < hd; ++i) acc += q[i] * row[i];
            sc[(size_t)(t * ng + g) * kBlock + j] = qv.spec.logit(acc * qv.spec.scale);
          }
        }
      }
    }
    // online softmax over the block
    for (int t = 0; t < qv.n_tokens; ++t) {
      const int j0 = std::clamp(span[t].lo - p0, 0, n), nt = std::clamp(span[t].hi - p0, 0, n);
      if (nt <= j0) continue;
      for (int g = 0; g < ng; ++g) {
        float* s = &sc[(size_t)(t * ng + g) * kBlock];
        attn_state& st = states[t * ng + g];
        float mx = s[j0];
        for (int j = j0 + 1; j < nt; ++j) mx = std::max(mx, s[j]);
        st.rescale_to(mx);
        for (int j = j0; j < nt; ++j) {
          s[j] = std::exp(s[j] - st.m);
          st.d += s[j];
        }
      }
    }
    // P·V, one V row at a time, shared by every query of the group
    for (int j = 0; j < n; ++j) {
      const int r = p0 + j;
      load_v_row_ref(kv.v, r, hd, row.data());
      for (int t = 0; t < qv.n_tokens; ++t) {
        if (!sees(t, r)) continue;
        for (int g = 0; g < ng; ++g) {
          const float w = sc[(size_t)(t * ng + g) * kBlock + j];
          float* o = states[t * ng + g].o;
          for (int i = 0; i < hd; ++i) o[i] += w * row[i];
        }
      }
    }
  }
}

// Rows [0, n) of a dense or per-token side to f32 (the AVX2 dequantizer where it applies).
static void dequantize_side(const kv_quant_side& s, int n, int hd, float* y) {
  const auto& t = kv_traits(s.format);
  if (t.layout == kv_layout::per_token && best_isa() >= isa::avx2 && hd % 16 == 0 && hd <= 256 &&
      (s.group % 32 == 0 || s.group == hd))
    return dequantize_rows_avx2(s, 0, n, hd, y);
  for (int r = 0; r < n; ++r) load_v_row_ref(s, r, hd, y + (size_t)r * hd);
}

void attn_dequant_ref(const kv_quant_view& kv, const attn_query_view& qv, attn_state* states) {
  const int hd = kv.head_dim, ng = qv.n_group;
  const auto& tk = kv_traits(kv.k.format);
  std::vector<float> kf((size_t)kv.n_pos * hd), vf((size_t)kv.n_pos * hd);  // [n_pos, head_dim]
  // 1. dequantize the whole view
  if (tk.layout == kv_layout::per_channel) {
    for (int r0 = 0; r0 < kv.n_pos; r0 += kv.k.group) {
      const int n = std::min(kv.k.group, kv.n_pos - r0);
      dequantize_channel_group_ref(kv.k.format, kv.k.codes + (int64_t)r0 * kv.k.code_stride,
                                   kv.k.scales + (int64_t)(r0 / kv.k.group) * kv.k.scale_stride, n, hd,
                                   &kf[(size_t)r0 * hd]);
    }
  } else {
    dequantize_side(kv.k, kv.n_pos, hd, kf.data());
  }
  dequantize_side(kv.v, kv.n_pos, hd, vf.data());
  // 2. attend in f32 over the dequantized copy, with the query the fused kernel sees
  std::vector<float> q((size_t)qv.n_tokens * ng * hd);  // [n_tokens, n_group, head_dim]
  for (int t = 0; t < qv.n_tokens; ++t)
    for (int g = 0; g < ng; ++g) {
      float* dst = &q[((size_t)t * ng + g) * hd];
      if (tk.layout == kv_layout::per_token) {
        const int64_t at = t * qv.stride_t + (int64_t)g * hd;
        const float* qsc = q8_scales(qv, t, g, hd / kv.k.group);
        for (int i = 0; i < hd; ++i)
          dst[i] = (float)(qv.q16 ? qv.q16[at + i] : qv.q8[at + i]) * qsc[qv.q8_group ? i / qv.q8_group : 0];
      } else {
        const float* qs = qv.q + t * qv.stride_t + (int64_t)g * hd;
        std::copy(qs, qs + hd, dst);
      }
    }
  kv_dense_view dv;
  dv.k = kf.data();
  dv.v = vf.data();
  dv.type_k = dv.type_v = kv_elem::f32;
  dv.row_stride = hd;
  dv.pos_begin = kv.pos_begin;
  dv.n_pos = kv.n_pos;
  dv.head_dim = hd;
  attn_query_view all = qv;
  all.q = q.data();
  all.stride_t = (int64_t)ng * hd;
  attn_dense(dv, all, states);
}

isa attn_quant_tier(const kv_quant_view& kv) {
  const isa tier = best_isa();
  if (tier >= isa::avx512 && attn_quant_supported_avx512(kv)) return isa::avx512;
  if (tier >= isa::avx2 && attn_quant_supported_avx2(kv)) return isa::avx2;
  return isa::scalar;
}

void attn_quant(const kv_quant_view& kv, const attn_query_view& q, attn_state* states) {
  check_k_group(kv);
  const isa tier = best_isa();
  if (tier >= isa::avx512 && attn_quant_supported_avx512(kv)) return attn_quant_avx512(kv, q, states);
  if (tier >= isa::avx2 && attn_quant_supported_avx2(kv)) return attn_quant_avx2(kv, q, states);
  attn_quant_ref(kv, q, states);
}

}  // namespace kvq
