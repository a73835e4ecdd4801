// Attention variants (attn_spec: sliding window, logit soft-cap) in every CPU tier against float64:
// the fused compressed-domain kernels (scalar reference, AVX2, AVX-512, the dequantize-then-attend
// baseline), the dense kernels (reference, AVX2, AVX-512) and the certified kernel (its bound
// must cover the error against float64 attention restricted to the window). Windows {1, 17, 97,
// full}; the float64 reference attends over the values each kernel really sees (the dequantized
// rows, and for per-token K the int8 / int16 query dequantized), so the difference is f32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/attn_dense_tiers.h"
#include "kernels/attn_quant_tiers.h"
#include "kv_side_util.h"
#include "kvq/attention.h"
#include "kvq/attn_certified.h"
#include "kvq/cpu.h"
#include "kvq/f16.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq {
namespace {

constexpr int kWindows[] = {1, 17, 97, 0};  // 0: full (global causal)

// out[hd] = softmax_j(spec.logit(scale q·k_j)) v_j over rows [lo, hi) of K, V [n, hd], float64.
std::vector<double> attend_f64(const double* q, const std::vector<float>& k, const std::vector<float>& v, int hd,
                               key_span rows, const attn_spec& spec) {
  std::vector<double> s(rows.hi > rows.lo ? rows.hi - rows.lo : 0), out(hd, 0.0);
  if (s.empty()) return out;
  double mx = -1e300;
  for (int j = rows.lo; j < rows.hi; ++j) {
    double a = 0;
    for (int i = 0; i < hd; ++i) a += q[i] * k[(size_t)j * hd + i];
    a *= spec.scale;
    if (spec.softcap > 0) a = spec.softcap * std::tanh(a / spec.softcap);
    s[j - rows.lo] = a;
    mx = std::max(mx, a);
  }
  double den = 0;
  for (double& x : s) den += (x = std::exp(x - mx));
  for (int j = rows.lo; j < rows.hi; ++j)
    for (int i = 0; i < hd; ++i) out[i] += s[j - rows.lo] / den * v[(size_t)j * hd + i];
  return out;
}

// max |a - b| / max |b|.
template <class A, class B>
double test_rel_err(const A& a, const B& b) {
  double e = 0, m = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    e = std::max(e, std::abs((double)a[i] - (double)b[i]));
    m = std::max(m, std::abs((double)b[i]));
  }
  return e / m;
}

// A side's rows dequantized to f32 [n, hd] (per-channel groups start at row 0).
std::vector<float> dequantized(const kv_quant_side& s, int n, int hd) {
  std::vector<float> y((size_t)n * hd);
  if (kv_traits(s.format).layout == kv_layout::per_channel) {
    for (int r0 = 0; r0 < n; r0 += s.group)
      dequantize_channel_group_ref(s.format, s.codes + (int64_t)r0 * s.code_stride,
                                   s.scales + (int64_t)(r0 / s.group) * s.scale_stride, std::min(s.group, n - r0), hd,
                                   &y[(size_t)r0 * hd]);
  } else {
    for (int r = 0; r < n; ++r) load_v_row_ref(s, r, hd, &y[(size_t)r * hd]);
  }
  return y;
}

using quant_fn = void (*)(const kv_quant_view&, const attn_query_view&, attn_state*);
struct quant_tier {
  const char* name;
  bool available;
  quant_fn fn;
};
std::vector<quant_tier> quant_tiers() {
  return {{"ref", true, attn_quant_ref},
          {"avx2", best_isa() >= isa::avx2, attn_quant_avx2},
          {"avx512", best_isa() >= isa::avx512, attn_quant_avx512},
          {"dequant", true, attn_dequant_ref}};
}

// Every fused tier with windows {1, 17, 97, full} x soft-cap {none, 4}: K and V formats of each
// layout, a view that starts at position 5 (so window starts fall inside it and before it), a
// prefill tile of 20 query tokens and a decode query, GQA 3. Also checks that the window and the
// cap matter (the output differs from the full / uncapped one by far more than the tolerance).
TEST(attn_variants, fused_tiers_honour_window_and_softcap_vs_float64) {
  std::mt19937 rng(11);
  const kv_format kf[] = {kv_format::q4, kv_format::q8, kv_format::q2a, kv_format::kivi4, kv_format::f16};
  const kv_format vf[] = {kv_format::q4, kv_format::q8a, kv_format::f16};
  const int n_pos = 300, pos_begin = 5, ng = 3;
  double worst[4] = {0, 0, 0, 0};
  int cases = 0;
  for (int hd : {64, 128, 80, 112})
    for (int ki = 0; ki < 5; ++ki)
      for (int vi = 0; vi < 3; ++vi) {
        const kv_format fk = kf[ki], fv = vf[(vi + ki) % 3];
        const bool k_tok = kv_traits(fk).layout == kv_layout::per_token;
        // per-token: elements per scale (head_dim when 32 does not divide it); KIVI: tokens per group
        const int kg = k_tok && hd % 32 ? hd : 32;
        auto kb = make_side(fk, n_pos, hd, kg, rng);
        auto vb = make_side(fv, n_pos, hd, hd % 32 ? hd : 32, rng);
        const std::vector<float> kd = dequantized(kb.side, n_pos, hd), vd = dequantized(vb.side, n_pos, hd);
        kv_quant_view kv;
        kv.k = kb.side;
        kv.v = vb.side;
        kv.pos_begin = pos_begin;
        kv.n_pos = n_pos;
        kv.head_dim = hd;
        for (int n_tok : {20, 1}) {
          std::normal_distribution<float> nd(0.f, 1.f);
          std::vector<float> q((size_t)n_tok * ng * hd);
          for (auto& x : q) x = nd(rng);
          // the query the kernels see: int16 for 8-bit K, int8 per K group otherwise, f32 for dense / KIVI
          const bool k8 = k_tok && kv_traits(fk).bits == 8;
          const int nqg = hd / kg;
          std::vector<int8_t> q8(q.size());
          std::vector<int16_t> q16(q.size());
          std::vector<float> q8s((size_t)n_tok * ng * nqg);
          std::vector<double> qd(q.begin(), q.end());  // [n_tok, ng, hd] as seen by the kernel
          if (k_tok)
            for (size_t i = 0; i < (size_t)n_tok * ng; ++i)
              for (int gi = 0; gi < nqg; ++gi) {
                const size_t at = i * hd + (size_t)gi * kg;
                const float sc = k8 ? quantize_q16_ref(&q[at], kg, &q16[at]) : quantize_q8_ref(&q[at], kg, &q8[at]);
                q8s[i * nqg + gi] = sc;
                for (int e = 0; e < kg; ++e) qd[at + e] = (double)(k8 ? q16[at + e] : q8[at + e]) * sc;
              }
          attn_query_view qv;
          qv.q = q.data();
          qv.stride_t = (int64_t)ng * hd;
          qv.n_tokens = n_tok;
          qv.n_group = ng;
          qv.head_dim = hd;
          qv.pos0 = pos_begin + n_pos - n_tok - 2;  // the last two rows are in no query's range
          if (k_tok) {
            if (k8) qv.q16 = q16.data();
            else qv.q8 = q8.data();
            qv.q8_scale = q8s.data();
            qv.q8_scale_stride_t = (int64_t)ng * nqg;
            qv.q8_group = kg;
          }
          for (float cap : {0.0f, 4.0f})
            for (int w : kWindows) {
              qv.spec.scale = 1.0f / std::sqrt((float)hd);
              qv.spec.window = w;
              qv.spec.softcap = cap;
              attn_spec full = qv.spec;
              full.window = 0;
              full.softcap = 0;
              const int nq = n_tok * ng;
              std::vector<double> ref((size_t)nq * hd), ref_full((size_t)nq * hd);
              for (int t = 0; t < n_tok; ++t)
                for (int g = 0; g < ng; ++g) {
                  const double* qq = &qd[((size_t)t * ng + g) * hd];
                  const auto r = attend_f64(qq, kd, vd, hd, qv.rows(t, pos_begin, n_pos), qv.spec);
                  const auto f = attend_f64(qq, kd, vd, hd, full.view_rows(qv.pos0 + t, pos_begin, n_pos), full);
                  std::copy(r.begin(), r.end(), ref.begin() + ((size_t)t * ng + g) * hd);
                  std::copy(f.begin(), f.end(), ref_full.begin() + ((size_t)t * ng + g) * hd);
                }
              const double changed = test_rel_err(ref_full, ref);
              if (w != 0 || cap > 0) {  // the variant must matter, or this case tests nothing
                EXPECT_GT(changed, 1e-2) << "window " << w << " cap " << cap;
              }
              const auto tiers = quant_tiers();
              for (size_t ti = 0; ti < tiers.size(); ++ti) {
                const quant_tier& tier = tiers[ti];
                if (!tier.available) continue;
                // every shape here has a SIMD tier (head_dim a multiple of 16)
                if (ti == 1) {
                  ASSERT_TRUE(attn_quant_supported_avx2(kv)) << "hd " << hd;
                }
                if (ti == 2) {
                  ASSERT_TRUE(attn_quant_supported_avx512(kv)) << "hd " << hd;
                }
                std::vector<float> o((size_t)nq * hd), out((size_t)nq * hd);
                std::vector<attn_state> st(nq);
                for (int i = 0; i < nq; ++i) st[i] = attn_state::empty(&o[(size_t)i * hd], hd);
                tier.fn(kv, qv, st.data());
                for (int i = 0; i < nq; ++i) st[i].finalize(&out[(size_t)i * hd]);
                const double e = test_rel_err(out, ref);
                worst[ti] = std::max(worst[ti], e);
                EXPECT_LE(e, 5e-5) << tier.name << " K " << kv_traits(fk).name << " V " << kv_traits(fv).name << " hd "
                                   << hd << " tokens " << n_tok << " window " << w << " cap " << cap;
                ++cases;
              }
            }
        }
      }
  const auto tiers = quant_tiers();
  for (int ti = 0; ti < 4; ++ti)
    std::printf("[variants] %s: worst relative error vs float64 %.3g%s\n", tiers[ti].name, worst[ti],
                tiers[ti].available ? "" : " (tier not available here)");
  std::printf("[variants] %d fused cases\n", cases);
}

// The dense kernels (reference, best tier through attn_dense, and the AVX2 / AVX-512 builds where
// the CPU has them) over f32 / f16 / bf16 rows, same sweep.
TEST(attn_variants, dense_tiers_honour_window_and_softcap_vs_float64) {
  std::mt19937 rng(12);
  const int n_pos = 260, pos_begin = 40, ng = 4;
  struct dense_tier {
    const char* name;
    bool available;
    void (*fn)(const kv_dense_view&, const attn_query_view&, attn_state*);
  };
  const dense_tier tiers[] = {{"ref", true, attn_dense_ref},
                              {"dispatch", true, attn_dense},
                              {"avx2", best_isa() >= isa::avx2, attn_dense_avx2},
                              {"avx512", best_isa() >= isa::avx512, attn_dense_avx512}};
  double worst = 0;
  for (int hd : {128, 80, 112})
    for (kv_format f : {kv_format::f32, kv_format::f16, kv_format::bf16}) {
      auto kb = make_side(f, n_pos, hd, 0, rng);
      auto vb = make_side(f, n_pos, hd, 0, rng);
      const std::vector<float> kd = dequantized(kb.side, n_pos, hd), vd = dequantized(vb.side, n_pos, hd);
      kv_dense_view dv;
      dv.k = kb.codes.data();
      dv.v = vb.codes.data();
      dv.type_k = dv.type_v = f == kv_format::f32 ? kv_elem::f32 : f == kv_format::f16 ? kv_elem::f16 : kv_elem::bf16;
      dv.row_stride = hd;
      dv.pos_begin = pos_begin;
      dv.n_pos = n_pos;
      dv.head_dim = hd;
      for (int n_tok : {33, 1}) {
        std::normal_distribution<float> nd(0.f, 1.f);
        std::vector<float> q((size_t)n_tok * ng * hd);
        for (auto& x : q) x = nd(rng);
        attn_query_view qv;
        qv.q = q.data();
        qv.stride_t = (int64_t)ng * hd;
        qv.n_tokens = n_tok;
        qv.n_group = ng;
        qv.head_dim = hd;
        qv.pos0 = pos_begin + n_pos - n_tok;
        for (float cap : {0.0f, 4.0f})
          for (int w : kWindows) {
            qv.spec.scale = 1.0f / std::sqrt((float)hd);
            qv.spec.window = w;
            qv.spec.softcap = cap;
            const int nq = n_tok * ng;
            std::vector<double> ref((size_t)nq * hd);
            for (int t = 0; t < n_tok; ++t)
              for (int g = 0; g < ng; ++g) {
                const std::vector<double> qq(q.begin() + ((size_t)t * ng + g) * hd,
                                             q.begin() + ((size_t)t * ng + g + 1) * hd);
                const auto r = attend_f64(qq.data(), kd, vd, hd, qv.rows(t, pos_begin, n_pos), qv.spec);
                std::copy(r.begin(), r.end(), ref.begin() + ((size_t)t * ng + g) * hd);
              }
            for (const dense_tier& tier : tiers) {
              if (!tier.available) continue;
              std::vector<float> o((size_t)nq * hd), out((size_t)nq * hd);
              std::vector<attn_state> st(nq);
              for (int i = 0; i < nq; ++i) st[i] = attn_state::empty(&o[(size_t)i * hd], hd);
              tier.fn(dv, qv, st.data());
              for (int i = 0; i < nq; ++i) st[i].finalize(&out[(size_t)i * hd]);
              const double e = test_rel_err(out, ref);
              worst = std::max(worst, e);
              EXPECT_LE(e, 5e-5) << tier.name << " " << kv_traits(f).name << " hd " << hd << " tokens " << n_tok
                                 << " window " << w << " cap " << cap;
            }
          }
      }
    }
  std::printf("[variants] dense tiers: worst relative error vs float64 %.3g\n", worst);
}

// Paged dense views (kv_dense_view::page_rows) against the same rows gathered into one contiguous
// view: every tier must give the same states bit for bit (m, d and o), whatever the page size,
// the view's first row on its page, the pages' order in memory, the rows' stride within a page
// (the other kv heads' rows between them, NaN here, so that a row read from the wrong place
// shows), windows and soft-cap.
TEST(attn_variants, paged_dense_views_equal_contiguous_bit_for_bit) {
  std::mt19937 rng(14);
  struct dense_tier {
    const char* name;
    bool available;
    void (*fn)(const kv_dense_view&, const attn_query_view&, attn_state*);
  };
  const dense_tier tiers[] = {{"ref", true, attn_dense_ref},
                              {"dispatch", true, attn_dense},
                              {"avx2", best_isa() >= isa::avx2, attn_dense_avx2},
                              {"avx512", best_isa() >= isa::avx512, attn_dense_avx512}};
  auto bits = [](float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
  };
  int cases = 0, runs = 0;
  for (kv_elem e : {kv_elem::f32, kv_elem::f16, kv_elem::bf16})
    for (int hd : {64, 80})
      for (int n_pos : {1, 17, 97, 200}) {
        const int eb = kv_elem_bytes(e), nh = 2, h = (cases % 2);  // the view's kv head of nh
        std::normal_distribution<float> nd(0.f, 2.f);
        // contiguous rows [n_pos, hd]
        std::vector<uint8_t> kc((size_t)n_pos * hd * eb), vc(kc.size());
        for (auto* c : {&kc, &vc})
          for (size_t i = 0; i < (size_t)n_pos * hd; ++i) {
            const float x = nd(rng);
            if (e == kv_elem::f32) std::memcpy(c->data() + i * 4, &x, 4);
            else {
              const uint16_t y = e == kv_elem::f16 ? f32_to_f16(x) : f32_to_bf16(x);
              std::memcpy(c->data() + i * 2, &y, 2);
            }
          }
        for (int page_rows : {1, 5, 8, 16, 33, 64})
          for (int row0 : std::set<int>{0, page_rows / 2, page_rows - 1}) {
            ++cases;
            // pages of [page_rows, nh, hd], NaN everywhere but head h's rows, stored in reverse order
            const int n_pages = (row0 + n_pos + page_rows - 1) / page_rows;
            const size_t page_bytes = (size_t)page_rows * nh * hd * eb;
            std::vector<uint8_t> kp(n_pages * page_bytes), vp(kp.size());
            const uint16_t nan16 = e == kv_elem::f16 ? 0x7e00 : 0x7fc0;
            const float nan32 = std::nanf("");
            for (auto* b : {&kp, &vp})
              for (size_t i = 0; i < b->size() / eb; ++i) {
                if (e == kv_elem::f32) std::memcpy(b->data() + i * 4, &nan32, 4);
                else std::memcpy(b->data() + i * 2, &nan16, 2);
              }
            std::vector<const void*> kpt(n_pages), vpt(n_pages);
            for (int j = 0; j < n_pages; ++j) {
              const size_t at = (size_t)(n_pages - 1 - j) * page_bytes + (size_t)h * hd * eb;
              kpt[j] = kp.data() + at;
              vpt[j] = vp.data() + at;
            }
            for (int p = 0; p < n_pos; ++p) {
              const int x = row0 + p;
              const size_t off = (size_t)(x % page_rows) * nh * hd * eb;
              std::memcpy((uint8_t*)kpt[x / page_rows] + off, kc.data() + (size_t)p * hd * eb, (size_t)hd * eb);
              std::memcpy((uint8_t*)vpt[x / page_rows] + off, vc.data() + (size_t)p * hd * eb, (size_t)hd * eb);
            }
            kv_dense_view dc, dp;
            dc.type_k = dc.type_v = e;
            dc.pos_begin = 7;
            dc.n_pos = n_pos;
            dc.head_dim = hd;
            dp = dc;
            dc.k = kc.data();
            dc.v = vc.data();
            dc.row_stride = hd;
            dp.k_pages = kpt.data();
            dp.v_pages = vpt.data();
            dp.page_rows = page_rows;
            dp.page_row0 = row0;
            dp.row_stride = (int64_t)nh * hd;
            const int ng = 1 + cases % 7, n_tok = cases % 3 == 0 ? 5 : 1;
            std::vector<float> q((size_t)n_tok * ng * hd);
            for (auto& x : q) x = nd(rng);
            attn_query_view qv;
            qv.q = q.data();
            qv.stride_t = (int64_t)ng * hd;
            qv.n_tokens = n_tok;
            qv.n_group = ng;
            qv.head_dim = hd;
            qv.pos0 = 7 + n_pos - n_tok;
            qv.spec.scale = 1.0f / std::sqrt((float)hd);
            for (int w : kWindows)
              for (float cap : {0.0f, 4.0f}) {
                qv.spec.window = w;
                qv.spec.softcap = cap;
                const int nq = n_tok * ng;
                for (const dense_tier& tier : tiers) {
                  if (!tier.available) continue;
                  std::vector<float> oc((size_t)nq * hd), op(oc.size());
                  std::vector<attn_state> sc(nq), sp(nq);
                  for (int i = 0; i < nq; ++i) {
                    sc[i] = attn_state::empty(&oc[(size_t)i * hd], hd);
                    sp[i] = attn_state::empty(&op[(size_t)i * hd], hd);
                  }
                  tier.fn(dc, qv, sc.data());
                  tier.fn(dp, qv, sp.data());
                  ++runs;
                  bool same = true;
                  for (int i = 0; i < nq; ++i) same = same && bits(sc[i].m) == bits(sp[i].m) && bits(sc[i].d) == bits(sp[i].d);
                  for (size_t i = 0; i < oc.size(); ++i) same = same && bits(oc[i]) == bits(op[i]) && !std::isnan(op[i]);
                  EXPECT_TRUE(same) << tier.name << " elem " << (int)e << " hd " << hd << " n_pos " << n_pos
                                    << " page_rows " << page_rows << " row0 " << row0 << " window " << w << " cap "
                                    << cap << " tokens " << n_tok << " group " << ng;
                }
              }
          }
      }
  std::printf("[variants] paged dense views: %d layouts, %d tier runs equal to contiguous\n", cases, runs);
}

// A window that ends before the view, or a view wholly before the window: no key, state empty.
TEST(attn_variants, window_outside_the_view_leaves_states_empty) {
  std::mt19937 rng(13);
  const int hd = 64;
  auto kb = make_side(kv_format::q4, 64, hd, 32, rng);
  auto vb = make_side(kv_format::q4, 64, hd, 32, rng);
  kv_quant_view kv;
  kv.k = kb.side;
  kv.v = vb.side;
  kv.pos_begin = 100;
  kv.n_pos = 64;
  kv.head_dim = hd;
  std::vector<float> q(hd, 1.0f), o(hd);
  std::vector<int8_t> q8(hd);
  float s = quantize_q8_ref(q.data(), hd, q8.data());
  attn_query_view qv;
  qv.q = q.data();
  qv.n_tokens = 1;
  qv.n_group = 1;
  qv.head_dim = hd;
  qv.pos0 = 100 + 64 + 16;  // window 16: keys [165, 180], past the view's [100, 164)
  qv.spec.window = 16;
  qv.q8 = q8.data();
  qv.q8_scale = &s;
  for (quant_fn fn : {attn_quant_ref, attn_quant}) {
    attn_state st = attn_state::empty(o.data(), hd);
    fn(kv, qv, &st);
    EXPECT_TRUE(st.is_empty());
  }
  EXPECT_TRUE(qv.rows(0, kv.pos_begin, kv.n_pos).empty());
  // key_range itself: [p - W + 1, p], clamped at 0; 0 = [0, p]
  attn_spec sp;
  sp.window = 17;
  EXPECT_EQ(sp.key_range(100).lo, 84);
  EXPECT_EQ(sp.key_range(100).hi, 101);
  EXPECT_EQ(sp.key_range(5).lo, 0);
  sp.window = 1;
  EXPECT_EQ(sp.key_range(7).lo, 7);
  sp.window = 0;
  EXPECT_EQ(sp.key_range(7).lo, 0);
}

// The certified kernel with windows and soft-cap: every step's bound covers the error of the
// returned output against float64 attention over the originals in the window, whatever the stage
// (tol inf: the compressed tier; 1e-3: partial / exact; 0: always exact, then within 1e-6);
// n_keys is the window's size.
TEST(attn_variants, certified_kernel_bound_covers_windowed_float64) {
  std::mt19937 rng(14);
  const int hd = 64, n = 200, ng = 2, n_tok = 9;
  const rotation rot = rotation::make(rotation_kind::hadamard, hd, 0);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> kx((size_t)n * hd), vx((size_t)n * hd);  // originals, f16-representable
  for (auto& x : kx) x = f16_to_f32(f32_to_f16(nd(rng)));
  for (auto& x : vx) x = f16_to_f32(f32_to_f16(nd(rng) + 1.0f));
  std::vector<uint16_t> host((size_t)n * 2 * hd);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < hd; ++i) {
      host[(size_t)j * 2 * hd + i] = f32_to_f16(kx[(size_t)j * hd + i]);
      host[(size_t)j * 2 * hd + hd + i] = f32_to_f16(vx[(size_t)j * hd + i]);
    }
  // fast tier: rotated q8 K / q4 V with ε per row
  const kv_format fmt[2] = {kv_format::q8, kv_format::q4};
  const double eta = rotation_rounding_bound(rot);
  std::vector<uint8_t> codes[2];
  std::vector<uint16_t> scales[2], err[2];
  cert_segment seg[2];
  for (int side = 0; side < 2; ++side) {
    const std::vector<float>& x = side ? vx : kx;
    const int sc = kv_row_scale_count(fmt[side], hd, 32);
    const size_t cb = kv_code_bytes(fmt[side], hd);
    codes[side].resize(n * cb);
    scales[side].resize((size_t)n * sc);
    err[side].resize(n);
    std::vector<float> r(hd), y(hd);
    for (int j = 0; j < n; ++j) {
      std::copy(&x[(size_t)j * hd], &x[(size_t)(j + 1) * hd], r.begin());
      double xn = 0;
      for (float e : r) xn += (double)e * e;
      rot.forward(r.data());
      quantize_row_ref(fmt[side], r.data(), hd, 32, &codes[side][j * cb], &scales[side][(size_t)j * sc]);
      dequantize_row_ref(fmt[side], &codes[side][j * cb], &scales[side][(size_t)j * sc], hd, 32, y.data());
      err[side][j] = cert_error_bound_f16(r.data(), y.data(), hd, std::sqrt(xn), eta);
    }
    seg[side] = cert_segment{0, fmt[side], codes[side].data(), (int64_t)cb, scales[side].data(), sc, 32, true};
  }
  cert_kv_view kv;
  kv.k = {&seg[0], 1, err[0].data(), &rot};
  kv.v = {&seg[1], 1, err[1].data(), &rot};
  kv.host = {host.data(), host.data() + hd, 2 * hd};
  kv.n_pos = n;
  kv.head_dim = hd;
  std::vector<float> q((size_t)n_tok * ng * hd), q_rot(q.size());
  for (auto& x : q) x = nd(rng);
  q_rot = q;
  for (int i = 0; i < n_tok * ng; ++i) rot.forward(&q_rot[(size_t)i * hd]);
  cert_query_view qv;
  qv.q = q.data();
  qv.q_rot = q_rot.data();
  qv.stride_t = (int64_t)ng * hd;
  qv.n_tokens = n_tok;
  qv.n_group = ng;
  qv.head_dim = hd;
  qv.pos0 = n - n_tok;
  int checked = 0;
  for (float cap : {0.0f, 3.0f})
    for (int w : kWindows)
      for (double tol : {(double)INFINITY, 1e-3, 0.0}) {
        qv.spec.scale = 0.3f;
        qv.spec.window = w;
        qv.spec.softcap = cap;
        cert_options opt;
        opt.tol = tol;
        std::vector<float> out(q.size());
        std::vector<cert_step> steps(n_tok * ng);
        attn_certified_ref(kv, qv, opt, out.data(), steps.data());
        for (int t = 0; t < n_tok; ++t)
          for (int g = 0; g < ng; ++g) {
            const size_t i = (size_t)t * ng + g;
            const std::vector<double> qq(q.begin() + i * hd, q.begin() + (i + 1) * hd);
            const key_span r = qv.spec.key_range(qv.pos0 + t);
            const auto ref = attend_f64(qq.data(), kx, vx, hd, r, qv.spec);
            double e = 0, rn = 0;
            for (int c = 0; c < hd; ++c) {
              e += (out[i * hd + c] - ref[c]) * (out[i * hd + c] - ref[c]);
              rn += ref[c] * ref[c];
            }
            e = std::sqrt(e);
            EXPECT_EQ(steps[i].n_keys, r.hi - r.lo) << "window " << w;
            EXPECT_GE(steps[i].bound, e) << "window " << w << " cap " << cap << " tol " << tol << " token " << t;
            if (tol == 0.0) {
              EXPECT_LE(e, 1e-6 * std::sqrt(rn)) << "exact stage, window " << w << " cap " << cap;
            }
            ++checked;
          }
      }
  std::printf("[variants] certified: %d (query, window, cap, tol) steps bounded\n", checked);
}

}  // namespace
}  // namespace kvq
