// Certified cache on a real model and real text (stories260K, TinyStories validation): every
// measured bound holds, tol 0 reproduces the f16 cache's attention (and its logits up to the
// model's amplification of f32 rounding), and at tol 1e-1 / 1e-2 / 1e-3 every returned attention
// output is within tol of exact attention. (The closing figures of
// issue 6 come from kvq perplexity: docs/certified.md.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kvq/certified.h"
#include "kvq/f16.h"
#include "kvq/model.h"
#include "kvq/perplexity.h"
#include "kvq/tokenizer.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

struct text_run {
  double nll = 0;
  int64_t n = 0;
  std::vector<float> logits;  // of the last chunk, [n_ctx, n_vocab]
};

// llama.cpp's perplexity protocol (see perplexity.h): chunks of n_ctx tokens, BOS first, second
// half scored; forward in batches of n_batch tokens.
text_run run_text(model& m, kv_cache& cache, const std::vector<int32_t>& ids, int32_t bos, int n_ctx, int n_chunks,
                  int n_batch, thread_pool& pool) {
  const int V = m.hparams().n_vocab;
  text_run r;
  r.logits.resize((size_t)n_ctx * V);
  for (int c = 0; c < n_chunks; ++c) {
    std::vector<int32_t> chunk(ids.begin() + (size_t)c * n_ctx, ids.begin() + (size_t)(c + 1) * n_ctx);
    if (bos >= 0) chunk[0] = bos;
    cache.clear(0);
    for (int i = 0; i < n_ctx; i += n_batch) {
      const int nb = std::min(n_batch, n_ctx - i);
      m.forward(std::span<const int32_t>(chunk).subspan(i, nb), i, 0, cache, pool, &r.logits[(size_t)i * V], true);
    }
    for (int i = n_ctx / 2; i < n_ctx - 1; ++i) {
      const float* l = &r.logits[(size_t)i * V];
      double mx = l[0], s = 0;
      for (int j = 1; j < V; ++j) mx = std::max(mx, (double)l[j]);
      for (int j = 0; j < V; ++j) s += std::exp(l[j] - mx);
      r.nll += mx + std::log(s) - l[chunk[i + 1]];
      ++r.n;
    }
  }
  return r;
}

struct fixture {
  std::unique_ptr<model> m;
  std::vector<int32_t> ids;
  int32_t bos = -1;
};

fixture load(const std::string& mp, const std::string& tp, size_t max_bytes) {
  fixture f;
  f.m = model::load(mp);
  auto tok = tokenizer::from_gguf(f.m->gguf());
  std::string text = read_text_file(tp);
  if (text.size() > max_bytes) text.resize(max_bytes);
  f.ids = perplexity_tokenize(*tok, text);
  f.bos = perplexity_bos(*tok);
  return f;
}

// stories260K and the first 20000 bytes of TinyStories, tokenized; skipped when the shared data is
// absent (GTEST_SKIP in SetUp skips the test body).
class CertifiedModel : public ::testing::Test {
 protected:
  void SetUp() override {
    KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
    KVQ_REQUIRE_DATA(tp, "data/tinystories-val-794k/tinystories_val.txt");
    f = load(mp, tp, 20000);
    ASSERT_GE((int)f.ids.size(), n_ctx * n_chunks);
  }
  static constexpr int n_ctx = 128, n_chunks = 2;
  fixture f;
  thread_pool pool{2};
};

// Two caches in lock step: both receive every append and attend (the same K, V and queries), the
// model goes on with the reference cache's outputs, and every (token, query head) output of the
// other cache is compared with the reference's, row by row, against an f32 rounding allowance.
// The allowance is that of the f16 cache's f32 online softmax over f16 K/V (the other side, exact
// f64 attention rounded to f32, adds one f32 rounding): scores carry a relative rounding of at
// most (hd + 2) u of scale * sum_i |q_i k_i| (delta below), moving the softmax weights by at most
// e^(2 delta) - 1 in l1; exp, the running sums, the rescales and the final division add (2n + 24) u
// of max |v|. u = 2^-24, n keys.
class lockstep final : public kv_cache {
 public:
  lockstep(kv_cache& ref, kv_cache& other) : ref_(ref), other_(other) {}
  const kv_cache_params& params() const override { return ref_.params(); }
  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override {
    ref_.append(il, seq_id, n_tokens, k, v);
    other_.append(il, seq_id, n_tokens, k, v);
    const size_t m = (size_t)n_tokens * params().n_kv_head * params().head_dim;
    k16_.resize(params().n_layer);
    v16_.resize(params().n_layer);
    for (size_t i = 0; i < m; ++i) {
      k16_[il].push_back(f16_to_f32(f32_to_f16(k[i])));
      v16_[il].push_back(f16_to_f32(f32_to_f16(v[i])));
    }
  }
  void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale, float* out,
              thread_pool& pool) override {
    const int hd = params().head_dim, nkv = params().n_kv_head, ng = n_head / nkv;
    std::vector<float> o((size_t)n_tokens * n_head * hd);
    ref_.attend(il, seq_id, pos0, n_tokens, n_head, q, scale, out, pool);
    other_.attend(il, seq_id, pos0, n_tokens, n_head, q, scale, o.data(), pool);
    constexpr double u = 0x1p-24;
    for (int t = 0; t < n_tokens; ++t)
      for (int h = 0; h < n_head; ++h) {
        const float* qh = q + ((size_t)t * n_head + h) * hd;
        const int n = pos0 + t + 1, kh = h / ng;
        double smax = 0, vmax = 0;
        for (int j = 0; j < n; ++j) {
          const float* kj = &k16_[il][((size_t)j * nkv + kh) * hd];
          const float* vj = &v16_[il][((size_t)j * nkv + kh) * hd];
          double a = 0;
          for (int i = 0; i < hd; ++i) {
            a += std::fabs((double)qh[i] * kj[i]);
            vmax = std::max(vmax, (double)std::fabs(vj[i]));
          }
          smax = std::max(smax, a * scale);
        }
        const double delta = (hd + 2) * u * smax;
        const double allow = (std::expm1(2 * delta) + (2.0 * n + 24) * u) * vmax * 1.01;
        double d = 0;
        for (int i = 0; i < hd; ++i) {
          const size_t x = ((size_t)t * n_head + h) * hd + i;
          d = std::max(d, (double)std::fabs(o[x] - out[x]));
        }
        ++rows;
        if (!(d <= allow)) ++over;
        max_ratio = std::max(max_ratio, d / allow);
        max_rel = std::max(max_rel, d / vmax);
      }
  }
  int n_pos(int seq_id) const override { return ref_.n_pos(seq_id); }
  void clear(int seq_id) override {
    ref_.clear(seq_id);
    other_.clear(seq_id);
    for (auto* s : {&k16_, &v16_})
      for (auto& l : *s) l.clear();
  }
  void truncate(int, int) override { FAIL() << "not used"; }
  size_t bytes() const override { return ref_.bytes(); }
  size_t bytes_used() const override { return ref_.bytes_used(); }
  std::string describe() const override { return ref_.describe(); }

  uint64_t rows = 0, over = 0;
  double max_ratio = 0, max_rel = 0;

 private:
  kv_cache& ref_;
  kv_cache& other_;
  std::vector<std::vector<float>> k16_, v16_;  // [n_layer][pos, kv head, hd] f16-rounded, seq 0
};

TEST_F(CertifiedModel, Stories260KBoundsHoldAndTolZeroIsF16) {
  kv_cache_params p = f.m->cache_params(n_ctx);
  p.type_k = p.type_v = kv_cache_type::certified;
  p.certify_tol = 1e-2;
  p.certify_measure = true;
  auto c = make_kv_cache_certified(p);
  // batches of 24: prefill-like blocks at positions > 0, and the ragged last one
  text_run rc = run_text(*f.m, *c, f.ids, f.bos, n_ctx, n_chunks, 24, pool);
  const certified_stats s = c->certified_statistics();
  const auto& hp = f.m->hparams();
  EXPECT_EQ(s.steps, (uint64_t)n_chunks * n_ctx * hp.n_layer * hp.n_head);
  EXPECT_EQ(s.certified + s.partial + s.exact, s.steps);
  EXPECT_GT(s.measured, s.steps / 2);
  EXPECT_EQ(s.violations, 0u) << s.measured << " steps measured";
  EXPECT_GE(s.ratio_min, 1.0);
  std::printf("[certified] %s: steps %llu: certified %llu, partly recomputed %llu, fully recomputed %llu; "
              "bound / actual error median %.3g, p99 %.3g, min %.3g\n",
              c->describe().c_str(), (unsigned long long)s.steps, (unsigned long long)s.certified,
              (unsigned long long)s.partial, (unsigned long long)s.exact, s.ratio_median, s.ratio_p99, s.ratio_min);
  // tol 0: exact attention over the f16 originals, i.e. the f16 cache up to f32 rounding. Checked
  // in lock step, where it is a local claim: every output row of c1 is within the f32 rounding
  // allowance of the f16 cache's row for the same K, V and query (measured: at most 0.03 of the
  // allowance, 1.9e-6 of max |v|; an f32 cache, which skips the f16 rounding, exceeds it in 94% of
  // the rows, by up to 91x).
  p.certify_tol = 0;
  p.certify_measure = false;
  kv_cache_params pf = f.m->cache_params(n_ctx);
  pf.type_k = pf.type_v = kv_cache_type::f16;
  {
    auto c1 = make_kv_cache(p);
    auto f1 = make_kv_cache(pf);
    lockstep ls(*f1, *c1);
    run_text(*f.m, ls, f.ids, f.bos, n_ctx, n_chunks, n_ctx, pool);
    EXPECT_EQ(ls.rows, s.steps);
    EXPECT_EQ(ls.over, 0u) << "max |difference| / allowance " << ls.max_ratio;
    EXPECT_EQ(c1->stats().heads_exact, s.steps);
  }
  // End to end, each cache running the model on its own outputs: the logits cannot agree to f32
  // rounding. stories260K amplifies a 1-ulp change of the attention outputs (layers 0-1) to up to
  // 4.0e-4 of max |logit| (200 random +-1 ulp perturbations: 3.96e-4 with the AVX-512 kernels,
  // 3.11e-4 with KVQ_ISA=scalar; the f16 cache alone, scalar vs AVX-512 matmul: 3.7e-4), because
  // |q|, |k| reach 35 and 27 in 8 dims (scores up to 200) and each upstream difference flips the
  // f16 rounding of some K/V elements of the next layers, a 2^-11 relative step each (one 1-ulp
  // perturbation of layer 0: 9 flipped K/V elements in layer 1, 345 in layer 4). Measured here:
  // 5.3e-5 (AVX-512) and 3.0e-4 (scalar); the bound leaves 2.5x over the largest such effect seen.
  auto c0 = make_kv_cache(p);
  auto f16 = make_kv_cache(pf);
  text_run r0 = run_text(*f.m, *c0, f.ids, f.bos, n_ctx, n_chunks, n_ctx, pool);
  text_run rf = run_text(*f.m, *f16, f.ids, f.bos, n_ctx, n_chunks, n_ctx, pool);
  double md = 0, mx = 0;
  for (size_t i = 0; i < rf.logits.size(); ++i) {
    md = std::max(md, (double)std::fabs(r0.logits[i] - rf.logits[i]));
    mx = std::max(mx, (double)std::fabs(rf.logits[i]));
  }
  EXPECT_LT(md, 1e-3 * mx);
  EXPECT_NEAR(r0.nll / r0.n, rf.nll / rf.n, 1e-5);
  EXPECT_EQ(c0->stats().heads_exact, s.steps);
}

// Forwards every call to a certified cache and checks, after each attend (every layer), the
// guarantee of every returned (query head, token): its actual error against exact attention is
// at most its bound, and the bound is within tol * ||output|| unless the step was recomputed
// exactly (then the bound is f32 rounding).
class guarantee_checker final : public kv_cache {
 public:
  guarantee_checker(kv_cache_certified& c, double tol) : c_(c), tol_(tol) {}
  const kv_cache_params& params() const override { return c_.params(); }
  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override {
    c_.append(il, seq_id, n_tokens, k, v);
  }
  void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale, float* out,
              thread_pool& pool) override {
    c_.attend(il, seq_id, pos0, n_tokens, n_head, q, scale, out, pool);
    for (const cert_step& s : c_.last_steps()) {
      ++steps;
      ++stages[(int)s.stage];
      ASSERT_GE(s.error, 0.0);  // measuring
      if (!(s.error <= s.bound)) ++over_bound;
      const double norm = std::max(s.norm, s.norm_fast) * (1 + 1e-6);
      if (s.stage != cert_stage::exact && !(s.bound <= tol_ * norm)) ++bound_over_tol;
      if (s.stage != cert_stage::exact && !(s.error <= tol_ * norm)) ++error_over_tol;
      if (s.stage == cert_stage::exact && !(s.error <= 1e-6 * s.norm + 1e-30)) ++exact_not_exact;
    }
  }
  int n_pos(int seq_id) const override { return c_.n_pos(seq_id); }
  void clear(int seq_id) override { c_.clear(seq_id); }
  void truncate(int seq_id, int n) override { c_.truncate(seq_id, n); }
  size_t bytes() const override { return c_.bytes(); }
  size_t bytes_used() const override { return c_.bytes_used(); }
  std::string describe() const override { return c_.describe(); }

  uint64_t steps = 0, stages[3] = {0, 0, 0};
  uint64_t over_bound = 0, bound_over_tol = 0, error_over_tol = 0, exact_not_exact = 0;

 private:
  kv_cache_certified& c_;
  double tol_;
};

// The end-to-end guarantee on real text, for each tolerance of the closing figures and
// with and without adaptive precision: every returned attention output of every layer, head and
// token is within tol * ||output|| of exact attention over the originals (or exact), and all
// three stages of the ladder occur. (The figures themselves: docs/certified.md, from kvq
// perplexity.)
TEST_F(CertifiedModel, Stories260KEveryReturnedOutputWithinTolerance) {
  const auto& hp = f.m->hparams();
  uint64_t stages[3] = {0, 0, 0};
  for (double tol : {1e-1, 1e-2, 1e-3})
    for (bool adapt : {false, true}) {
      SCOPED_TRACE("tol " + std::to_string(tol) + " adapt " + std::to_string(adapt));
      kv_cache_params p = f.m->cache_params(n_ctx);
      p.type_k = p.type_v = kv_cache_type::certified;
      p.certify_tol = tol;
      p.certify_adapt = adapt;
      p.certify_measure = true;
      auto c = make_kv_cache_certified(p);
      guarantee_checker g(*c, tol);
      run_text(*f.m, g, f.ids, f.bos, n_ctx, n_chunks, 32, pool);
      EXPECT_EQ(g.steps, (uint64_t)n_chunks * n_ctx * hp.n_layer * hp.n_head);
      EXPECT_EQ(g.over_bound, 0u);
      EXPECT_EQ(g.bound_over_tol, 0u);
      EXPECT_EQ(g.error_over_tol, 0u);
      EXPECT_EQ(g.exact_not_exact, 0u);
      EXPECT_EQ(c->certified_statistics().violations, 0u);
      for (int i = 0; i < 3; ++i) stages[i] += g.stages[i];
    }
  for (int i = 0; i < 3; ++i) EXPECT_GT(stages[i], 0u) << "stage " << i << " never happened";
}

}  // namespace
}  // namespace kvq
