// Attention kernels: attn_state algebra, scalar vs AVX2 tiers (integer parts bit-exact, float
// parts to f32 rounding) on views built from the reference quantizers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/attn_dense_tiers.h"
#include "kernels/attn_quant_tiers.h"
#include "kvq/attention.h"
#include "kvq/cpu.h"
#include "kvq/f16.h"
#include "kvq/quant.h"
#include "kv_side_util.h"

namespace kvq {
namespace {

// One partition's state from explicit scores and values (float64 accumulation, then f32).
attn_state state_of(const std::vector<float>& s, const std::vector<float>& v, int hd, std::vector<float>& o) {
  o.assign(hd, 0.0f);
  attn_state st = attn_state::empty(o.data(), hd);
  for (size_t j = 0; j < s.size(); ++j) {
    st.rescale_to(s[j]);
    const float w = std::exp(s[j] - st.m);
    st.d += w;
    for (int i = 0; i < hd; ++i) st.o[i] += w * v[j * hd + i];
  }
  return st;
}

TEST(attn_state, merge_is_split_invariant_and_empty_is_weight_zero) {
  const int hd = 8, n = 50;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 4.f);
  std::vector<float> s(n), v((size_t)n * hd);
  for (auto& x : s) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  std::vector<float> o_all, out_all(hd);
  state_of(s, v, hd, o_all).finalize(out_all.data());
  for (int cut1 : {0, 7, 25})
    for (int cut2 : {25, 40, 50}) {
      std::vector<float> oa, ob, oc, out(hd);
      auto part = [&](int a, int b, std::vector<float>& o) {
        return state_of(std::vector<float>(s.begin() + a, s.begin() + b),
                        std::vector<float>(v.begin() + (size_t)a * hd, v.begin() + (size_t)b * hd), hd, o);
      };
      attn_state A = part(0, cut1, oa), B = part(cut1, cut2, ob), C = part(cut2, n, oc);
      C.merge(A);  // any order
      C.merge(B);
      C.finalize(out.data());
      for (int i = 0; i < hd; ++i) EXPECT_NEAR(out[i], out_all[i], 1e-5f * (1 + std::fabs(out_all[i])));
    }
  // empty partitions: never NaN, weight zero
  std::vector<float> e1(hd, 7.0f), e2(hd, 7.0f), o(hd);
  attn_state E1 = attn_state::empty(e1.data(), hd), E2 = attn_state::empty(e2.data(), hd);
  E1.merge(E2);
  E1.finalize(o.data());
  for (float x : o) EXPECT_EQ(x, 0.0f);
  std::vector<float> ox;
  attn_state X = state_of(s, v, hd, ox);
  const float d = X.d, m = X.m;
  X.merge(E2);
  EXPECT_EQ(X.d, d);
  EXPECT_EQ(X.m, m);
  E1.merge(X);
  E1.finalize(o.data());
  for (int i = 0; i < hd; ++i) EXPECT_NEAR(o[i], out_all[i], 1e-5f * (1 + std::fabs(out_all[i])));
}

// The SIMD tiers under test, each skipped (with a message) where best_isa() does not reach it: the
// CPU lacks it (the AVX-512 tier needs AVX-512 VL + VNNI) or KVQ_ISA lowers the tier (KVQ_ISA=scalar
// skips both, KVQ_ISA=avx2 the AVX-512 one).
struct simd_tier {
  const char* name;
  bool available;
  void (*qk)(const kv_quant_side&, int, int, const int8_t*, int, int32_t*);
  void (*engine_dots)(const kv_quant_side&, int, int, const int8_t*, const int16_t*, int, int, float*);
  bool (*supported)(const kv_quant_view&);
  void (*attend)(const kv_quant_view&, const attn_query_view&, attn_state*);
};
std::vector<simd_tier> simd_tiers() {
  return {{"avx2", best_isa() >= isa::avx2, qk_i32_avx2, qk_engine_dots_avx2, attn_quant_supported_avx2,
           attn_quant_avx2},
          {"avx512", best_isa() >= isa::avx512, qk_i32_avx512, qk_engine_dots_avx512, attn_quant_supported_avx512,
           attn_quant_avx512}};
}

void PrintTo(const simd_tier& t, std::ostream* os) { *os << t.name; }  // test names, not raw bytes

class attn_simd_tiers : public ::testing::TestWithParam<simd_tier> {};
INSTANTIATE_TEST_SUITE_P(simd, attn_simd_tiers, ::testing::ValuesIn(simd_tiers()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(attn_simd_tiers, qk_integer_dots_bit_exact_with_scalar) {
  const simd_tier tier = GetParam();
  if (!tier.available) GTEST_SKIP() << "no " << tier.name << " on this CPU (or KVQ_ISA lowers it)";
  std::mt19937 rng(2);
  for (kv_format f : {kv_format::q8, kv_format::q4, kv_format::q3, kv_format::q2, kv_format::q8a, kv_format::q4a,
                      kv_format::q3a, kv_format::q2a, kv_format::q4nl, kv_format::q3nl, kv_format::q2nl})
    for (int hd : {16, 32, 48, 64, 80, 96, 112, 128, 144, 176, 240, 256})
      for (int group : {32, 64, 128, hd}) {
        if (hd % group) continue;
        auto b = make_side(f, 40, hd, group, rng);
        std::vector<int8_t> q8(hd);
        for (int i = 0; i < hd; ++i) q8[i] = (int8_t)((int)(rng() % 255) - 127);
        q8[0] = 127;
        q8[1] = -127;
        const int ng = hd / group;
        std::vector<int32_t> r((size_t)40 * ng), a((size_t)40 * ng, -1);
        qk_i32_ref(b.side, 0, 40, q8.data(), hd, r.data());
        tier.qk(b.side, 0, 40, q8.data(), hd, a.data());
        ASSERT_EQ(r, a) << kv_traits(f).name << " hd " << hd << " group " << group;
      }
}

// The integer scoring the fused engine really runs (qk_engine_dots_*: tile_scores_packed for 4/2-bit
// K, tile_scores_int for 8/3-bit K with an int8 query, tile_scores_i16 for 8-bit K with an int16
// query) equals qk_i32_ref bit for bit. The hook returns each i32 dot as a float through exact
// steps; comparing with (float)reference is comparing the integers when every reference dot is
// below 2^24 in magnitude (a wrong dot then converts to a different float, or is >= 2^24), which is
// checked per case: int8 queries always are (127 * 128 * 256 < 2^24). int16 queries run twice: full
// range values that are multiples of 64 (|q| <= 504 * 64, dots multiples of 64 below 2^30: exact, and
// any error is a multiple of 64 too, so seen) and any values up to (2^24 - 1) / (128 * group).
// Rows [3, 3 + n) of a side whose first and last of them hold all-maximum / all-minimum codes;
// queries all +max / all -max besides random ones; 1, 6 and 7 queries (the packed scorer's batches
// of 1, 4 + 2 and 4 + 3).
TEST_P(attn_simd_tiers, engine_integer_scores_bit_exact_with_scalar) {
  const simd_tier tier = GetParam();
  if (!tier.available) GTEST_SKIP() << "no " << tier.name << " on this CPU (or KVQ_ISA lowers it)";
  std::mt19937 rng(6);
  enum class qkind { i8, i16_hi, i16_lo };
  const int n_qs[] = {7, 6, 1};
  int idx = 0, cases = 0;
  for (kv_format f : {kv_format::q8, kv_format::q4, kv_format::q3, kv_format::q2, kv_format::q8a, kv_format::q4a,
                      kv_format::q3a, kv_format::q2a, kv_format::q4nl, kv_format::q3nl, kv_format::q2nl})
    for (int hd : {64, 128, 96, 256, 80, 112, 48, 176})
      for (int group : {32, 64, 128, 0}) {
        if (group == 0) group = hd;
        else if (group >= hd || hd % group) continue;  // (group == hd runs once, as 0)
        for (int n_rows : {1, 17, 97}) {
          const int r0 = 3, n_q = n_qs[idx++ % 3], ng = hd / group;
          const auto& t = kv_traits(f);
          auto b = make_side(f, r0 + n_rows, hd, group, rng);
          auto fill_row = [&](int row, int code) {
            std::vector<uint8_t> u(hd, (uint8_t)code);  // the stored code (an int8 for 8 bits)
            pack_codes(t.bits, u.data(), hd, &b.codes[(size_t)row * b.side.code_stride]);
          };
          fill_row(r0, t.code_max);
          if (n_rows > 1) fill_row(r0 + n_rows - 1, t.code_min);
          std::vector<qkind> kinds = {qkind::i8};
          if (t.bits == 8) kinds = {qkind::i8, qkind::i16_hi, qkind::i16_lo};
          for (qkind kind : kinds) {
            // query value range: int8 +-127; int16 high: multiples of 64; int16 low: exact dots
            const int lim = kind == qkind::i8       ? 127
                            : kind == qkind::i16_hi ? 504
                                                    : std::min(kq16_max, ((1 << 24) - 1) / (128 * group));
            const int mul = kind == qkind::i16_hi ? 64 : 1;
            std::vector<int8_t> q8((size_t)n_q * hd);
            std::vector<int16_t> q16((size_t)n_q * hd);
            for (int qi = 0; qi < n_q; ++qi)
              for (int i = 0; i < hd; ++i) {
                const int v = (qi == 1 ? lim : qi == 2 ? -lim : (int)(rng() % (2 * lim + 1)) - lim) * mul;
                q8[(size_t)qi * hd + i] = (int8_t)v;
                q16[(size_t)qi * hd + i] = (int16_t)v;
              }
            const size_t per_q = (size_t)n_rows * ng;
            std::vector<int32_t> ref(n_q * per_q);
            for (int qi = 0; qi < n_q; ++qi) {
              if (kind == qkind::i8) qk_i32_ref(b.side, r0, n_rows, &q8[(size_t)qi * hd], hd, &ref[qi * per_q]);
              else qk_i32_ref(b.side, r0, n_rows, &q16[(size_t)qi * hd], hd, &ref[qi * per_q]);
            }
            std::vector<float> got(ref.size(), NAN);
            tier.engine_dots(b.side, r0, n_rows, kind == qkind::i8 ? q8.data() : nullptr,
                             kind == qkind::i8 ? nullptr : q16.data(), n_q, hd, got.data());
            const char* kname = kind == qkind::i8 ? "int8" : kind == qkind::i16_hi ? "int16 high" : "int16 low";
            int bad = 0;
            for (size_t i = 0; i < ref.size(); ++i) {
              // the test's premise: the float of each reference dot stands for exactly that integer
              if (kind == qkind::i16_hi) ASSERT_TRUE(ref[i] % 64 == 0 && std::abs(ref[i]) < (1 << 30));
              else ASSERT_LT(std::abs(ref[i]), 1 << 24);
              if (got[i] == (float)ref[i]) continue;
              if (bad++ == 0)
                ADD_FAILURE() << t.name << " hd " << hd << " group " << group << " rows " << n_rows << " " << kname
                              << " query " << i / per_q << " row " << i % per_q / ng << " group " << i % ng
                              << ": scorer " << got[i] << ", reference " << ref[i];
            }
            ASSERT_EQ(bad, 0) << t.name << " hd " << hd << " group " << group << " rows " << n_rows << " " << kname;
            ++cases;
          }
        }
      }
  std::printf("[tiers] %s engine scorers vs qk_i32_ref: %d cases bit-exact\n", tier.name, cases);
}

// Group i % 4 of {32, 64, 128, head_dim}; head_dim where that one does not divide it.
int group_at(int hd, int i) {
  const int g[] = {32, 64, 128, hd};
  return hd % g[i % 4] == 0 ? g[i % 4] : hd;
}

// The whole fused kernel: each SIMD tier vs the scalar reference on the same views, head_dim 64,
// 128, 256 and the 16-mod-32 ones (80, 112, and 16 / 48 / 144 / 176 / 240 in turn; float parts differ only
// by summation order and the vector exp). Per-token K and V groups cycle through 32, 64, 128 and
// head_dim (checked below: every such group of every head_dim is met, for K with per-head and
// per-group query scales).
TEST_P(attn_simd_tiers, fused_matches_reference) {
  const simd_tier tier = GetParam();
  if (!tier.available) GTEST_SKIP() << "no " << tier.name << " on this CPU (or KVQ_ISA lowers it)";
  std::mt19937 rng(3);
  const kv_format kfmts[] = {kv_format::q8,  kv_format::q4,  kv_format::q3,    kv_format::q2,    kv_format::q8a,
                             kv_format::q4a, kv_format::q2a, kv_format::kivi8, kv_format::kivi4, kv_format::kivi2,
                             kv_format::f16, kv_format::f32, kv_format::bf16, kv_format::q4nl, kv_format::q3nl};
  const kv_format vfmts[] = {kv_format::q4,  kv_format::q8a, kv_format::q3a, kv_format::q2,
                             kv_format::f16, kv_format::f32, kv_format::bf16, kv_format::q2nl};
  int idx = 0, jdx = 0;
  double worst = 0;
  std::set<std::tuple<int, int, bool>> k_met;  // (head_dim, K group, per-group query scales)
  std::set<std::pair<int, int>> v_met;         // (head_dim, V group)
  for (kv_format fk : kfmts)
    for (kv_format fv : vfmts)
      for (int hd0 : {64, 128, 256, 80, 112, 0}) {
        // head_dim 16 mod 32 (80, 112 every time, the others in turn): the engine's 16-element
        // tails, with their own case counter (the groups met at 64 / 128 / 256 are checked below)
        const int odd_hds[] = {16, 48, 144, 176, 240};
        const bool odd = hd0 == 0 || hd0 % 32 != 0;
        const int hd = hd0 ? hd0 : odd_hds[jdx % 5];
        const int ix = odd ? ++jdx : ++idx;
        const int n_pos = 50 + (ix * 37) % 300, ng = 1 + ix % 8, n_tok = ix % 3 == 0 ? 5 : 1;
        const bool k_chan = kv_traits(fk).layout == kv_layout::per_channel;
        const int kg = k_chan ? (ix % 2 ? 32 : 16) : group_at(hd, ix / 2);  // (KIVI: tokens per group)
        const int vg = group_at(hd, ix / 8);
        auto kb = make_side(fk, n_pos, hd, kg, rng);
        auto vb = make_side(fv, n_pos, hd, vg, rng);
        if (kv_traits(fv).layout == kv_layout::per_token) v_met.insert({hd, vg});
        kv_quant_view kv;
        kv.k = kb.side;
        kv.v = vb.side;
        kv.pos_begin = 3;
        kv.n_pos = n_pos;
        kv.head_dim = hd;
        std::normal_distribution<float> nd(0.f, 1.f);
        std::vector<float> q((size_t)n_tok * ng * hd);
        for (auto& x : q) x = nd(rng);
        // the query the cache builds: int16 for 8-bit K, int8 otherwise; one scale per K group in
        // every other view, one per head in the rest
        const bool k8 = kv_traits(fk).layout == kv_layout::per_token && kv_traits(fk).bits == 8;
        const int qg = kv_traits(fk).layout == kv_layout::per_token && ix % 2 ? kg : hd, nqg = hd / qg;
        std::vector<int8_t> q8(q.size());
        std::vector<int16_t> q16(q.size());
        std::vector<float> q8s((size_t)n_tok * ng * nqg);
        for (size_t i = 0; i < (size_t)n_tok * ng; ++i)
          for (int gi = 0; gi < nqg; ++gi) {
            const size_t at = i * hd + (size_t)gi * qg;
            q8s[i * nqg + gi] = k8 ? quantize_q16_ref(&q[at], qg, &q16[at]) : quantize_q8_ref(&q[at], qg, &q8[at]);
          }
        attn_query_view qv;
        qv.q = q.data();
        qv.stride_t = (int64_t)ng * hd;
        qv.n_tokens = n_tok;
        qv.n_group = ng;
        qv.head_dim = hd;
        qv.pos0 = 3 + n_pos - n_tok - (ix % 5);  // causal: the last rows are masked for some queries
        qv.spec.scale = 1.0f / std::sqrt((float)hd);
        if (k8) qv.q16 = q16.data();
        else qv.q8 = q8.data();
        qv.q8_scale = q8s.data();
        qv.q8_scale_stride_t = (int64_t)ng * nqg;
        qv.q8_group = qg == hd ? 0 : qg;
        if (kv_traits(fk).layout == kv_layout::per_token) k_met.insert({hd, kg, qv.q8_group != 0});
        const int nq = n_tok * ng;
        std::vector<float> o_ref((size_t)nq * hd), o_avx((size_t)nq * hd), f_ref(o_ref.size()), f_avx(o_ref.size());
        std::vector<attn_state> s_ref(nq), s_avx(nq);
        for (int i = 0; i < nq; ++i) {
          s_ref[i] = attn_state::empty(&o_ref[(size_t)i * hd], hd);
          s_avx[i] = attn_state::empty(&o_avx[(size_t)i * hd], hd);
        }
        ASSERT_TRUE(tier.supported(kv));
        attn_quant_ref(kv, qv, s_ref.data());
        tier.attend(kv, qv, s_avx.data());
        double e = 0, m = 1e-30;
        for (int i = 0; i < nq; ++i) {
          s_ref[i].finalize(&f_ref[(size_t)i * hd]);
          s_avx[i].finalize(&f_avx[(size_t)i * hd]);
          EXPECT_NEAR(s_ref[i].m, s_avx[i].m, 1e-5f * (1 + std::fabs(s_ref[i].m)));
        }
        for (size_t i = 0; i < f_ref.size(); ++i) {
          e = std::max(e, (double)std::fabs(f_ref[i] - f_avx[i]));
          m = std::max(m, (double)std::fabs(f_ref[i]));
        }
        worst = std::max(worst, e / m);
        // 3e-5: the worst view, q4a/q4 at head_dim 80 (one K group of 80 elements), differs by 2.6e-5;
        // its scores are within 2e-6 relative of float64 in both tiers (the tier's rounding of the
        // cancelling scale and zero terms, 1.2e-5 absolute, vs the reference's 7.6e-6), amplified
        // in the output whose largest element is 1.5
        EXPECT_LE(e / m, 3e-5) << kv_traits(fk).name << "/" << kv_traits(fv).name << " hd " << hd << " K group " << kg
                               << " V group " << vg << " query scale group " << qg;
      }
  for (int hd : {64, 128, 256})
    for (int g : {32, 64, 128, 256}) {
      if (g > hd) continue;
      EXPECT_TRUE(k_met.count({hd, g, false})) << "hd " << hd << " K group " << g << " (per-head query scale)";
      if (g < hd) {
        EXPECT_TRUE(k_met.count({hd, g, true})) << "hd " << hd << " K group " << g << " (per-group query scales)";
      }
      EXPECT_TRUE(v_met.count({hd, g})) << "hd " << hd << " V group " << g;
    }
  std::printf(
      "[tiers] fused %s vs scalar reference: %d views (%d at head_dim 16 mod 32), worst relative difference %.3g\n",
      tier.name, idx + jdx, jdx, worst);
}

// The int16 query of 8-bit K removes the query's rounding from the scores: against float64 scores
// over the same dequantized keys, q16 must be at least 50x closer than q8 (expected ~250x: its
// step is 254x finer) with per-head and per-group scales, in the reference and the best tier.
TEST(attn_tiers, int16_query_scores_match_float64) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (kv_format f : {kv_format::q8, kv_format::q8a})
    for (int group : {32, 128}) {
      const int hd = 128, n = 96;
      auto kb = make_side(f, n, hd, group, rng);
      std::vector<float> kf((size_t)n * hd), q(hd);
      for (int j = 0; j < n; ++j) load_v_row_ref(kb.side, j, hd, &kf[(size_t)j * hd]);  // dequantized K rows
      for (auto& x : q) x = nd(rng);
      // scores through a 1-key view each: the log-sum-exp of one score is the score itself
      auto scores = [&](bool use16, bool best) {
        std::vector<int8_t> q8(hd);
        std::vector<int16_t> q16(hd);
        std::vector<float> qs(hd / group);
        for (int gi = 0; gi < hd / group; ++gi)
          qs[gi] = use16 ? quantize_q16_ref(&q[gi * group], group, &q16[gi * group])
                         : quantize_q8_ref(&q[gi * group], group, &q8[gi * group]);
        std::vector<double> out(n);
        for (int j = 0; j < n; ++j) {
          kv_quant_view kv;
          kv.k = kb.side;
          kv.k.codes += (int64_t)j * kv.k.code_stride;
          kv.k.scales += (int64_t)j * kv.k.scale_stride;
          kv.v = kb.side;
          kv.pos_begin = 0;
          kv.n_pos = 1;
          kv.head_dim = hd;
          attn_query_view qv;
          qv.q = q.data();
          qv.n_tokens = 1;
          qv.n_group = 1;
          qv.head_dim = hd;
          qv.pos0 = 0;
          if (use16) qv.q16 = q16.data();
          else qv.q8 = q8.data();
          qv.q8_scale = qs.data();
          qv.q8_group = group == hd ? 0 : group;
          std::vector<float> o(hd);
          attn_state st = attn_state::empty(o.data(), hd);
          best ? attn_quant(kv, qv, &st) : attn_quant_ref(kv, qv, &st);
          out[j] = st.m;
        }
        return out;
      };
      for (bool best : {false, true}) {
        const auto s8 = scores(false, best), s16 = scores(true, best);
        double e8 = 0, e16 = 0;
        for (int j = 0; j < n; ++j) {
          double exact = 0;
          for (int i = 0; i < hd; ++i) exact += (double)q[i] * kf[(size_t)j * hd + i];
          e8 = std::max(e8, std::fabs(s8[j] - exact));
          e16 = std::max(e16, std::fabs(s16[j] - exact));
        }
        std::printf("[q16] %s group %d %s: max |score - float64| int8 query %.3g, int16 query %.3g\n",
                    kv_traits(f).name, group, best ? "best tier" : "reference", e8, e16);
        EXPECT_LT(e16 * 50, e8) << kv_traits(f).name << " group " << group;
      }
    }
}

TEST(attn_tiers, fully_masked_view_leaves_states_empty) {
  std::mt19937 rng(4);
  auto kb = make_side(kv_format::q4, 64, 64, 32, rng);
  auto vb = make_side(kv_format::q4, 64, 64, 32, rng);
  kv_quant_view kv;
  kv.k = kb.side;
  kv.v = vb.side;
  kv.pos_begin = 100;
  kv.n_pos = 64;
  kv.head_dim = 64;
  std::vector<float> q(64, 1.0f), o(64, 0.0f);
  std::vector<int8_t> q8(64);
  float s = quantize_q8_ref(q.data(), 64, q8.data());
  attn_query_view qv;
  qv.q = q.data();
  qv.n_tokens = 1;
  qv.n_group = 1;
  qv.head_dim = 64;
  qv.pos0 = 99;  // before the view
  qv.q8 = q8.data();
  qv.q8_scale = &s;
  attn_state st = attn_state::empty(o.data(), 64);
  attn_quant(kv, qv, &st);
  EXPECT_TRUE(st.is_empty());
  std::vector<float> out(64, 1.0f);
  st.finalize(out.data());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace kvq
