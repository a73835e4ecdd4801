// Certified cache behaviour: tol 0 is exact attention over the originals, a huge tol is the plain
// compressed result, each stage of the fallback ladder, a constructed input where plain 4-bit
// attention is badly wrong and certified mode recovers the exact output, adaptive precision, the
// file-backed host tier, bytes per tier, sequence ops, statistics and errors.
#include <gtest/gtest.h>

#include <dirent.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cache/test_certified_util.h"
#include "kvq/error.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq {
namespace {

using namespace cert_test;

struct small_case {
  int n = 73, nkv = 2, ng = 3, hd = 32;
  std::vector<float> k, v, q;
  explicit small_case(uint32_t seed, int n_ = 73) : n(n_) {
    std::mt19937 rng(seed);
    k = gauss(rng, (size_t)n * nkv * hd, 1.0f);
    v = gauss(rng, (size_t)n * nkv * hd, 1.0f);
    q = gauss(rng, (size_t)n * nkv * ng * hd, 1.0f);
  }
  int n_head() const { return nkv * ng; }
};

TEST(CertifiedCache, TolZeroIsExactAttentionOverOriginals) {
  thread_pool pool(2);
  small_case d(1);
  auto c = make_kv_cache_certified(cert_params(d.nkv, d.hd, d.n, 0.0));
  c->append(0, 0, d.n, d.k.data(), d.v.data());
  checked r = attend_and_check(*c, d.k, d.v, d.q, 0, d.n, d.n_head(), 0.17f, pool);
  EXPECT_EQ(r.violations, 0);
  for (size_t i = 0; i < r.err.size(); ++i) {
    EXPECT_EQ(r.steps[i].stage, cert_stage::exact);
    // f32 rounding of a float64 result: <= 2^-24 per element, relative
    EXPECT_LE(r.err[i], 0x1p-24 * norm_of(&r.ref[i * d.hd], d.hd) * 1.0001 + 1e-30) << i;
  }
  // and the same as the dense f16 cache (its own f32 kernel)
  kv_cache_params pf = cert_params(d.nkv, d.hd, d.n, 0.0, "f16", "f16");
  pf.certify = false;
  auto f16 = make_kv_cache(pf);
  f16->append(0, 0, d.n, d.k.data(), d.v.data());
  std::vector<float> o16(r.out.size());
  f16->attend(0, 0, 0, d.n, d.n_head(), d.q.data(), 0.17f, o16.data(), pool);
  EXPECT_LT(test::rel_err(r.out, o16), 2e-6);
}

// A huge tolerance returns the compressed-tier result: here recomputed independently from the
// public quantizers (f16 of the rotated row, per-token int8 K / int4 V, group 32) in float64.
TEST(CertifiedCache, HugeTolIsThePlainCompressedResult) {
  thread_pool pool(2);
  small_case d(2);
  auto c = make_kv_cache_certified(cert_params(d.nkv, d.hd, d.n, 1e30));
  c->append(0, 0, 30, d.k.data(), d.v.data());
  c->append(0, 0, d.n - 30, d.k.data() + (size_t)30 * d.nkv * d.hd, d.v.data() + (size_t)30 * d.nkv * d.hd);
  const float scale = 0.17f;
  checked r = attend_and_check(*c, d.k, d.v, d.q, 0, d.n, d.n_head(), scale, pool);
  EXPECT_EQ(r.violations, 0);
  for (const auto& s : r.steps) EXPECT_EQ(s.stage, cert_stage::certified);
  const rotation rot = rotation::make(rotation_kind::hadamard, d.hd, kv_cache_params{}.seed);
  auto compress = [&](std::vector<float> x, kv_format f) {  // -> dequantized rows, rotated basis
    const size_t rows = x.size() / d.hd;
    rot.forward_n(x.data(), (int64_t)rows);
    std::vector<uint8_t> codes(kv_code_bytes(f, d.hd));
    std::vector<uint16_t> sc(kv_row_scale_count(f, d.hd, 32));
    for (size_t j = 0; j < rows; ++j) {
      float* row = &x[j * d.hd];
      for (int i = 0; i < d.hd; ++i) row[i] = f16r(row[i]);
      quantize_row_ref(f, row, d.hd, 32, codes.data(), sc.data());
      dequantize_row_ref(f, codes.data(), sc.data(), d.hd, 32, row);
    }
    return x;
  };
  const std::vector<float> kh = compress(d.k, kv_format::q8), vh = compress(d.v, kv_format::q4);
  std::vector<float> qr = d.q;
  rot.forward_n(qr.data(), (int64_t)(qr.size() / d.hd));
  std::vector<double> plain = test::attend_f64(kh, vh, qr.data(), d.nkv, d.hd, 0, d.n, d.n_head(), scale);
  std::vector<float> back(plain.begin(), plain.end());
  rot.inverse_n(back.data(), (int64_t)(back.size() / d.hd));
  EXPECT_LT(test::rel_err(r.out, back), 2e-6);
  // and it is not the exact result: the compression error is visible
  EXPECT_GT(test::rel_err(r.out, r.ref), 1e-3);
}

// The ladder through the kernel with controlled error norms: the output rows equal the originals
// (so the true error is 0), only ε differs.
struct ladder_case {
  static constexpr int n = 100, hd = 16;
  std::vector<float> kf, vf;        // [n, hd] fast tier rows (dense f32, identity rotation)
  std::vector<uint16_t> host;       // [n, 2, hd]
  std::vector<uint16_t> ek, ev;     // [n] ε
  std::vector<float> q;             // [hd]
  rotation rot = rotation::make(rotation_kind::none, hd, 0);
  cert_segment sk, sv;
  ladder_case() : kf(n * hd), vf(n * hd), host(n * 2 * hd), ek(n, 0), ev(n, 0), q(hd) {
    std::mt19937 rng(3);
    auto x = gauss(rng, (size_t)2 * n * hd, 1.0f);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < hd; ++i) {
        kf[j * hd + i] = x[(size_t)j * hd + i];
        vf[j * hd + i] = f16r(x[(size_t)(n + j) * hd + i] + 2.0f);  // ||o|| well away from 0
        host[(size_t)j * 2 * hd + i] = f32_to_f16(kf[j * hd + i]);
        host[(size_t)j * 2 * hd + hd + i] = f32_to_f16(vf[j * hd + i]);
      }
    q = gauss(rng, hd, 1.0f);
    for (auto* s : {&sk, &sv}) {
      s->format = kv_format::f32;
      s->code_stride = hd * 4;
    }
    sk.codes = reinterpret_cast<const uint8_t*>(kf.data());
    sv.codes = reinterpret_cast<const uint8_t*>(vf.data());
  }
  cert_step run(double tol, float* out) {
    cert_kv_view kv;
    kv.k = {&sk, 1, ek.data(), &rot};
    kv.v = {&sv, 1, ev.data(), &rot};
    kv.host = {host.data(), host.data() + hd, 2 * hd};
    kv.n_pos = n;
    kv.head_dim = hd;
    cert_query_view qv;
    qv.q = qv.q_rot = q.data();
    qv.stride_t = hd;
    qv.n_tokens = 1;
    qv.n_group = 1;
    qv.head_dim = hd;
    qv.pos0 = n - 1;
    qv.spec.scale = 0.25f;
    cert_options opt;
    opt.tol = tol;
    opt.measure = true;
    cert_step st;
    attn_certified_ref(kv, qv, opt, out, &st);
    return st;
  }
};

TEST(CertifiedLadder, EachStageThroughTheKernel) {
  ladder_case lc;
  float out[16];
  // stage 0: every ε is 0 -> only rounding terms, certified at 1e-5
  cert_step s0 = lc.run(1e-5, out);
  EXPECT_EQ(s0.stage, cert_stage::certified);
  EXPECT_LT(s0.bound, 1e-5 * s0.norm);
  EXPECT_GE(s0.bound, s0.error);
  // stage 1: two tokens carry almost all of the bound -> exactly those are recomputed
  lc.ek[17] = f32_to_f16(2.0f);
  lc.ev[60] = f32_to_f16(5.0f);
  cert_step s1 = lc.run(1e-4, out);
  EXPECT_GT(s1.bound_fast, 1e-4 * s1.norm_fast);
  EXPECT_EQ(s1.stage, cert_stage::partial);
  EXPECT_EQ(s1.n_recomputed, 2);
  EXPECT_LE(s1.bound, 1e-4 * s1.norm);
  EXPECT_GE(s1.bound, s1.error);
  EXPECT_LT(s1.error, 1e-6 * s1.norm);
  // stage 2: the bound is spread over every token -> the head is recomputed exactly
  for (int j = 0; j < ladder_case::n; ++j) lc.ev[j] = f32_to_f16(0.5f);
  cert_step s2 = lc.run(1e-4, out);
  EXPECT_EQ(s2.stage, cert_stage::exact);
  EXPECT_EQ(s2.n_recomputed, ladder_case::n);
  EXPECT_LT(s2.error, 1e-6 * s2.norm);
  EXPECT_GE(s2.bound, s2.error);
  // a huge tolerance keeps the compressed result whatever the bound
  cert_step s3 = lc.run(INFINITY, out);
  EXPECT_EQ(s3.stage, cert_stage::certified);
}

// Every stage also happens through the cache on real quantization (outlier keys), with the
// certified / partial outputs within tol and the bounds valid.
TEST(CertifiedLadder, EachStageThroughTheCache) {
  thread_pool pool(2);
  small_case d(4, 160);
  std::mt19937 rng(8);
  for (int j = 0; j < d.n; j += 23)  // a few keys 20x larger: large ε_k, few tokens
    for (int i = 0; i < d.nkv * d.hd; ++i) d.k[(size_t)j * d.nkv * d.hd + i] = f16r(d.k[(size_t)j * d.nkv * d.hd + i] * 20);
  for (auto& x : d.v) x = f16r(x + 1.5f);
  const double tol = 2e-2;
  auto c = make_kv_cache_certified(cert_params(d.nkv, d.hd, d.n, tol, "q8", "q8"));
  c->append(0, 0, d.n, d.k.data(), d.v.data());
  checked r = attend_and_check(*c, d.k, d.v, d.q, 0, d.n, d.n_head(), 0.18f, pool);
  EXPECT_EQ(r.violations, 0);
  int count[3] = {0, 0, 0};
  for (size_t i = 0; i < r.steps.size(); ++i) {
    const cert_step& s = r.steps[i];
    ++count[(int)s.stage];
    if (s.stage != cert_stage::exact) {
      EXPECT_LE(s.bound, tol * s.norm * (1 + 1e-6));
    } else {
      EXPECT_LT(r.err[i], 1e-6 * s.norm);
    }
  }
  std::printf("[certified] stages: %d certified, %d partial, %d exact\n", count[0], count[1], count[2]);
  EXPECT_GT(count[0], 0);
  EXPECT_GT(count[1], 0);
  EXPECT_GT(count[2], 0);
  const kv_cache_stats st = c->stats();
  EXPECT_EQ(st.heads_certified, (uint64_t)count[0]);
  EXPECT_EQ(st.heads_partial, (uint64_t)count[1]);
  EXPECT_EQ(st.heads_exact, (uint64_t)count[2]);
  EXPECT_EQ(st.attend_calls, 1u);
}

// Keys whose decisive channel is small next to a large one: per-token 4-bit codes (no rotation)
// round the decisive channel to 0, so plain 4-bit attention is uniform where the exact one is
// one-hot, and the output has the wrong sign. Certified mode sees it and recovers the exact output.
TEST(CertifiedLadder, RecoversWherePlain4BitIsBadlyWrong) {
  thread_pool pool(2);
  const int n = 64, hd = 32;
  std::vector<float> k((size_t)n * hd, 0.f), v((size_t)n * hd, 0.f), q(hd, 0.f);
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> small(-0.5f, 0.5f);
  for (int j = 0; j < n; ++j) {
    k[(size_t)j * hd] = 100.f;
    for (int i = 2; i < hd; ++i) k[(size_t)j * hd + i] = f16r(small(rng));
    k[(size_t)j * hd + 1] = j == 5 ? 6.f : 0.f;
    v[(size_t)j * hd + 2] = j == 5 ? 10.f : -10.f;
  }
  q[1] = 10.f;
  const std::vector<double> ref = test::attend_f64(k, v, q.data(), 1, hd, n - 1, 1, 1, 1.0f);
  const double ref_norm = norm_of(ref.data(), hd);
  std::vector<float> out(hd);
  // plain 4-bit: the compressed cache of the same formats, and the certified cache at a huge tol
  // (without the K channel scale: the constant 100 of channel 0 is the offset that it, on by default
  // for per-token K, removes; the certified cache does not use it)
  kv_cache_params pp = cert_params(1, hd, n, 0, "q4", "q4");
  pp.certify = false;
  pp.rotation = rotation_kind::none;
  pp.k_channel_scale = false;
  auto plain = make_kv_cache(pp);
  plain->append(0, 0, n, k.data(), v.data());
  plain->attend(0, 0, n - 1, 1, 1, q.data(), 1.0f, out.data(), pool);
  EXPECT_GT(l2(out.data(), ref.data(), hd), 0.5 * ref_norm);
  // the default (K channel scale) gets this one right without any fallback
  pp.k_channel_scale.reset();
  auto centred = make_kv_cache(pp);
  centred->append(0, 0, n, k.data(), v.data());
  centred->attend(0, 0, n - 1, 1, 1, q.data(), 1.0f, out.data(), pool);
  EXPECT_LT(l2(out.data(), ref.data(), hd), 0.05 * ref_norm);
  for (double tol : {(double)INFINITY, 1e-3}) {
    kv_cache_params p = cert_params(1, hd, n, tol, "q4", "q4");
    p.rotation = rotation_kind::none;
    auto c = make_kv_cache_certified(p);
    c->append(0, 0, n, k.data(), v.data());
    c->attend(0, 0, n - 1, 1, 1, q.data(), 1.0f, out.data(), pool);
    const cert_step& s = c->last_steps()[0];
    const double err = l2(out.data(), ref.data(), hd);
    EXPECT_GE(s.bound, err);
    if (std::isinf(tol)) {
      EXPECT_GT(err, 0.5 * ref_norm);         // the compressed result is badly wrong ...
      EXPECT_GT(s.bound_fast, s.norm_fast);   // ... and the bound says so
    } else {
      EXPECT_NE(s.stage, cert_stage::certified);
      EXPECT_LT(err, 1e-6 * ref_norm);        // recovered exactly
    }
  }
}

// A head whose bound keeps failing is stored at higher precision for new tokens, and falls back
// less afterwards (the precision of a head outlives clear(), as across perplexity chunks).
TEST(CertifiedCache, AdaptivePrecisionUpgradesAFailingHead) {
  thread_pool pool(2);
  const int n = 128, hd = 32;
  std::mt19937 rng(11);
  std::vector<float> k = gauss(rng, (size_t)n * hd, 1.0f), v = gauss(rng, (size_t)n * hd, 1.0f);
  for (auto& x : v) x = f16r(x + 1.0f);
  std::vector<float> q = gauss(rng, (size_t)n * hd, 1.0f);
  kv_cache_params p = cert_params(1, hd, n, 0.1, "q8", "q2");
  p.certify_adapt = true;
  auto c = make_kv_cache_certified(p);
  std::vector<float> out(hd);
  int fell[2] = {0, 0};
  size_t bytes[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    c->clear(0);
    for (int t = 0; t < n; ++t) {
      const size_t before = c->tier_bytes().fast_used;
      c->append(0, 0, 1, &k[(size_t)t * hd], &v[(size_t)t * hd]);
      if (t == 0) bytes[run] = c->tier_bytes().fast_used - before;
      c->attend(0, 0, t, 1, 1, &q[(size_t)t * hd], 0.18f, out.data(), pool);
      if (t < 64) fell[run] += c->last_steps()[0].stage != cert_stage::certified;
    }
  }
  const auto h = c->heads();
  ASSERT_EQ(h.size(), 1u);
  std::printf("[certified] adaptive: K %s V %s, %d upgrade(s), bytes/token %zu -> %zu, fallbacks %d -> %d of 64\n",
              kv_traits(h[0].k_format).name, kv_traits(h[0].v_format).name, c->certified_statistics().heads_upgraded,
              bytes[0], bytes[1], fell[0], fell[1]);
  EXPECT_EQ(c->certified_statistics().heads_upgraded, 1);
  EXPECT_EQ(h[0].v_format, kv_format::q8);
  EXPECT_EQ(h[0].k_format, kv_format::q8);
  EXPECT_EQ(bytes[0], 32u + 2 + 2 + 8 + 2 + 2);   // q8 K + q2 V (+ scales and ε)
  EXPECT_EQ(bytes[1], 32u + 2 + 2 + 32 + 2 + 2);  // q8 K + q8 V
  EXPECT_GE(fell[0], 48);
  EXPECT_LE(fell[1], 16);
  const std::vector<std::string> up = c->report().upgrades;
  ASSERT_EQ(up.size(), 1u);
  EXPECT_EQ(up[0], "layer 0 kv head 0 V q2->q8");
}

int count_entries(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

TEST(CertifiedCache, FileBackedHostTierGivesTheSameResults) {
  thread_pool pool(2);
  small_case d(5);
  char tmpl[] = "/tmp/kvq-cert-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<float> a((size_t)d.n * d.n_head() * d.hd), b(a.size());
  for (int file = 0; file < 2; ++file) {
    kv_cache_params p = cert_params(d.nkv, d.hd, d.n, 1e-3);
    if (file) p.host_dir = dir;
    auto c = make_kv_cache_certified(p);
    EXPECT_EQ(c->tier_bytes().host_file_backed, file == 1);
    EXPECT_EQ(count_entries(dir), 0);  // the file is unlinked at once
    c->append(0, 0, d.n, d.k.data(), d.v.data());
    c->attend(0, 0, 0, d.n, d.n_head(), d.q.data(), 0.2f, (file ? b : a).data(), pool);
    if (file) {
      EXPECT_NE(c->describe().find(dir), std::string::npos);
    }
  }
  EXPECT_EQ(a, b);
  rmdir(dir.c_str());
  kv_cache_params p = cert_params(d.nkv, d.hd, d.n, 1e-3);
  p.host_dir = dir + "/no/such/dir";
  try {
    make_kv_cache_certified(p);
    ADD_FAILURE() << "no error";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::io);
    EXPECT_NE(std::string(e.what()).find("no/such/dir"), std::string::npos) << e.what();
  }
}

TEST(CertifiedCache, BytesOfEachTier) {
  kv_cache_params p = cert_params(2, 64, 100, 1e-2);
  auto generic = make_kv_cache(p);  // the registration hook of make_kv_cache
  ASSERT_NE(as_certified(*generic), nullptr);
  EXPECT_NE(generic->describe().find("certified: K q8 (hadamard, g32) / V q4 (hadamard, g32)"), std::string::npos)
      << generic->describe();
  auto c = make_kv_cache_certified(p);
  std::mt19937 rng(1);
  auto x = gauss(rng, (size_t)10 * 2 * 64, 1.0f);
  c->append(0, 0, 10, x.data(), x.data());
  const certified_tier_bytes t = c->tier_bytes();
  // per token and kv head: q8 K 64 codes + 2 f16 scales + 2 f16 ε (one per 32 elements) = 72;
  // q4 V 32 + 4 + one f16 ε = 38
  EXPECT_EQ(t.fast_used, (size_t)10 * 2 * (72 + 38));
  EXPECT_EQ(t.host_used, (size_t)10 * 2 * 2 * 64 * 2);
  EXPECT_EQ(t.host, (size_t)100 * 2 * 2 * 64 * 2);
  EXPECT_FALSE(t.host_file_backed);
  EXPECT_EQ(c->bytes(), t.fast + t.host);
  EXPECT_EQ(c->bytes_used(), t.fast_used + t.host_used);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(p), 2.0 * (72 + 38 + 256));
  kv_cache_params q4 = p;  // certify = true on a compressed format
  q4.type_k = q4.type_v = kv_cache_type::q4;
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(q4), 2.0 * (40 + 38 + 256));
  kv_cache_params f16 = p;  // certify on dense/dense: the plain dense cache (a tool's f16 reference)
  f16.type_k = f16.type_v = kv_cache_type::f16;
  EXPECT_FALSE(is_certified(f16));
  EXPECT_EQ(as_certified(*make_kv_cache(f16)), nullptr);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(f16), 2.0 * 2 * 64 * 2);
}

TEST(CertifiedCache, SequencesTruncateAndClear) {
  thread_pool pool(2);
  small_case a(7), b(8);
  kv_cache_params p = cert_params(a.nkv, a.hd, a.n, 1e-2);
  p.n_seq = 2;
  auto c = make_kv_cache_certified(p);
  c->append(0, 0, a.n, a.k.data(), a.v.data());
  c->append(0, 1, b.n, b.k.data(), b.v.data());
  const int nh = a.n_head();
  std::vector<float> oa((size_t)a.n * nh * a.hd), ob(oa.size()), oc(oa.size());
  c->attend(0, 0, 0, a.n, nh, a.q.data(), 0.2f, oa.data(), pool);
  c->attend(0, 1, 0, b.n, nh, a.q.data(), 0.2f, ob.data(), pool);
  EXPECT_LT(test::rel_err(oa, test::attend_f64(a.k, a.v, a.q.data(), a.nkv, a.hd, 0, a.n, nh, 0.2f)), 0.05);
  EXPECT_LT(test::rel_err(ob, test::attend_f64(b.k, b.v, a.q.data(), a.nkv, a.hd, 0, b.n, nh, 0.2f)), 0.05);
  // truncate seq 0 and append its tail again: identical outputs
  c->truncate(0, 29);
  EXPECT_EQ(c->n_pos(0), 29);
  EXPECT_EQ(c->n_pos(1), b.n);
  const size_t off = (size_t)29 * a.nkv * a.hd;
  c->append(0, 0, a.n - 29, a.k.data() + off, a.v.data() + off);
  c->attend(0, 0, 0, a.n, nh, a.q.data(), 0.2f, oc.data(), pool);
  EXPECT_EQ(oa, oc);
  c->clear(1);
  EXPECT_EQ(c->n_pos(1), 0);
  c->append(0, 1, b.n, b.k.data(), b.v.data());
  c->attend(0, 1, 0, b.n, nh, a.q.data(), 0.2f, oc.data(), pool);
  EXPECT_EQ(ob, oc);
}

// The text of the report is formatted by the tools: tests/tools/test_certified_report.cpp.
TEST(CertifiedCache, Statistics) {
  thread_pool pool(2);
  small_case d(9);
  kv_cache_params p = cert_params(d.nkv, d.hd, d.n, 1e-2);
  p.certify_measure = true;
  auto c = make_kv_cache_certified(p);
  c->append(0, 0, d.n, d.k.data(), d.v.data());
  c->attend(0, 0, 0, d.n, d.n_head(), d.q.data(), 0.2f, std::vector<float>((size_t)d.n * d.n_head() * d.hd).data(),
            pool);
  const certified_stats s = c->certified_statistics();
  EXPECT_EQ(s.steps, (uint64_t)d.n * d.n_head());
  EXPECT_EQ(s.certified + s.partial + s.exact, s.steps);
  EXPECT_EQ(s.violations, 0u);
  EXPECT_GT(s.rel_bound_median, 0.0);
  EXPECT_GE(s.rel_bound_p99, s.rel_bound_median);
}

// value_share_mean, the value term's share of the fast tier's bound: near 1 when only V is
// quantized (K in f16: its scores move by f16 rounding only) and near 0 when only K is (V in f16).
TEST(CertifiedCache, ValueShareFollowsTheQuantizedSide) {
  thread_pool pool(2);
  small_case d(21);
  std::vector<float> out((size_t)d.n * d.n_head() * d.hd);
  double share[2] = {0, 0};
  const char* sides[2][2] = {{"f16", "q4"}, {"q4", "f16"}};
  for (int i = 0; i < 2; ++i) {
    kv_cache_params p = cert_params(d.nkv, d.hd, d.n, 1e-2, sides[i][0], sides[i][1]);
    auto c = make_kv_cache_certified(p);
    c->append(0, 0, d.n, d.k.data(), d.v.data());
    c->attend(0, 0, 0, d.n, d.n_head(), d.q.data(), 0.2f, out.data(), pool);
    share[i] = c->certified_statistics().value_share_mean;
  }
  EXPECT_GT(share[0], 0.95) << "K f16 / V q4";
  EXPECT_LT(share[1], 0.05) << "K q4 / V f16";
}

// The report perplexity() / generate() / bench() return for each certified cache they create
// (append_certified_report): live statistics, tier bytes and peaks after a clear; a cache that
// never stored a token and a non-certified cache add nothing. The runtime calls themselves:
// tests/runtime/test_certified_results.cpp.
TEST(CertifiedCache, AppendReportSnapshotsStoredCachesOnly) {
  thread_pool pool(1);
  small_case d(11, 41);
  const kv_cache_params p = cert_params(d.nkv, d.hd, d.n, 1e-2);
  const int nh = d.n_head();
  std::vector<float> out((size_t)d.n * nh * d.hd);
  auto run = [&](kv_cache& c, int n_tokens) {
    c.append(0, 0, n_tokens, d.k.data(), d.v.data());
    c.attend(0, 0, 0, n_tokens, nh, d.q.data(), 0.2f, out.data(), pool);
  };
  std::vector<certified_report> rs;
  kv_cache_params pd = cert_params(d.nkv, d.hd, d.n, 1e-2, "f16", "f16");
  pd.certify = false;
  auto dense = make_kv_cache(pd);
  run(*dense, 5);
  append_certified_report(*dense, rs);  // not certified
  auto validation_only = make_kv_cache_certified(p);
  append_certified_report(*validation_only, rs);  // stores nothing
  EXPECT_TRUE(rs.empty());

  auto c = make_kv_cache(p);
  run(*c, d.n);
  const certified_stats st = as_certified(*c)->certified_statistics();
  append_certified_report(*c, rs);
  ASSERT_EQ(rs.size(), 1u);
  EXPECT_EQ(rs[0].stats.steps, (uint64_t)d.n * nh);  // every (query head, token) of the one layer
  EXPECT_EQ(rs[0].stats.steps, st.steps);
  EXPECT_EQ(rs[0].stats.partial, st.partial);
  EXPECT_EQ(rs[0].stats.certified + rs[0].stats.partial + rs[0].stats.exact, rs[0].stats.steps);
  c->clear(0);  // tiers empty now; the peaks remain, and the cache is still reported
  append_certified_report(*c, rs);
  ASSERT_EQ(rs.size(), 2u);
  const certified_report& r = rs[1];
  EXPECT_EQ(r.stats.steps, st.steps);
  EXPECT_EQ(r.tiers.host_used, 0u);
  EXPECT_EQ(r.tiers.host_used_peak, (size_t)d.n * d.nkv * d.hd * 2 * 2);
  // q8 K: 32 codes + 1 scale + ε; q4 V: 16 codes + 1 scale + ε (bytes, per kv head)
  EXPECT_EQ(r.tiers.fast_used_peak, (size_t)d.n * d.nkv * ((32 + 2 + 2) + (16 + 2 + 2)));
  EXPECT_DOUBLE_EQ(r.fast_bytes_per_token, d.nkv * ((32 + 2 + 2) + (16 + 2 + 2)));
  EXPECT_DOUBLE_EQ(r.host_bytes_per_token, d.nkv * d.hd * 2 * 2);
  EXPECT_EQ(r.type_k, "certified");
  EXPECT_DOUBLE_EQ(r.tol, 1e-2);
}

TEST(CertifiedCache, Errors) {
  auto expect_err = [](kv_cache_params p, errc code, const char* needle) {
    try {
      make_kv_cache(p);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const kv_cache_params ok = cert_params(2, 32, 16, 1e-2);
  kv_cache_params p = ok;
  p.certify_tol = -1;
  expect_err(p, errc::invalid_input, "certify_tol");
  p.certify_tol = NAN;
  expect_err(p, errc::invalid_input, "certify_tol");
  p = ok;
  p.k_channel_scale = true;  // the bound is for K, not K - mu: refused, not ignored
  expect_err(p, errc::unsupported, "k_channel_scale");
  p = ok;
  p.certify_budget = -0.5;
  expect_err(p, errc::invalid_input, "certify_budget");
  p.certify_budget = 0.3;  // q8 K + q4 V need 0.42 of f16 at head_dim 32
  expect_err(p, errc::invalid_input, "certify_budget");
  p = ok;
  p.type_v = (kv_cache_type)99;
  expect_err(p, errc::invalid_input, "type_v 99");
  EXPECT_THROW(parse_kv_cache_type("q5", "V"), error);
  p = ok;
  p.exact_recent = 4;  // (a sink window is supported: f16 rows in the fast tier)
  expect_err(p, errc::unsupported, "exact recent");
  p = ok;
  p.head_dim = 12;
  expect_err(p, errc::unsupported, "head_dim");
  p = ok;
  p.n_layer = 0;
  expect_err(p, errc::invalid_input, "n_layer");
  // bad data and calls
  auto c = make_kv_cache(ok);
  std::vector<float> x((size_t)2 * 32, 0.5f);
  x[7] = NAN;
  EXPECT_THROW(c->append(0, 0, 1, x.data(), x.data()), error);
  x[7] = 1e6f;
  EXPECT_THROW(c->append(0, 0, 1, x.data(), x.data()), error);
  EXPECT_EQ(c->n_pos(0), 0);
  x[7] = 0.5f;
  c->append(0, 0, 1, x.data(), x.data());
  thread_pool pool(1);
  std::vector<float> q((size_t)2 * 2 * 32, 0.1f), o(q.size());
  EXPECT_THROW(c->attend(0, 0, 1, 1, 2, q.data(), 0.1f, o.data(), pool), error);  // position 1 not appended
  EXPECT_THROW(c->attend(0, 0, 0, 1, 3, q.data(), 0.1f, o.data(), pool), error);  // 3 heads on 2 kv heads
  std::vector<float> big((size_t)16 * 2 * 32, 0.1f);
  EXPECT_THROW(c->append(0, 0, 16, big.data(), big.data()), error);               // past n_ctx
}

}  // namespace
}  // namespace kvq
