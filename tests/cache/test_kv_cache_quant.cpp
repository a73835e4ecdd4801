// Compressed caches: fused == dequantize-then-attend across the matrix, accuracy against float64,
// planted outliers, arrival-order invariance, truncate/clear, NaN policy, exact bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cache/attn_f64.h"
#include "cache/cache_params.h"
#include "cache/kv_cache_impl.h"
#include "kvq/error.h"
#include "kvq/kv_cache.h"

namespace kvq {
namespace {

using test::attend_f64;
using test::rel_err;

struct filled {
  std::unique_ptr<kv_cache> cache;
  std::vector<float> k, v;  // [n_pos, n_kv_head, hd] (layer 0)
};

// Random K/V with per-channel offsets/magnitudes (realistic K), appended in `chunks` to layer 0.
// A cheap approximately normal sample (sum of four uniforms, unit variance): test data only.
struct fast_normal {
  uint64_t s;
  explicit fast_normal(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  template <class R>
  float operator()(R&) {
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      acc += (float)(s >> 40) * (1.0f / 16777216.0f);
    }
    return (acc - 2.0f) * 1.7320508f;
  }
};

std::vector<float> kv_data(std::mt19937& rng, int n, int nh, int hd, bool is_k, float outlier = 0.0f,
                           int n_outlier = 3) {
  fast_normal nd(rng());
  std::vector<float> ch_scale(hd), ch_off(hd);
  for (int c = 0; c < hd; ++c) {
    ch_scale[c] = is_k ? 0.5f + 1.5f * (float)((c * 37) % 11) / 10.0f : 1.0f;
    ch_off[c] = is_k ? 0.8f * nd(rng) : 0.0f;
  }
  // planted outliers: n_outlier (<= 3) channels whose magnitude is `outlier` (x1, x1.5, x2) times
  // the rest, with a fixed sign per channel, as the outlier channels of real keys (KIVI,
  // arXiv:2402.02750, Fig. 2)
  if (outlier > 0) {
    const int chans[] = {3, hd / 2 + 1, hd - 5};
    for (int o = 0; o < n_outlier && o < 3; ++o)
      ch_off[chans[o]] = (o % 2 ? -1.0f : 1.0f) * outlier * (1.0f + 0.5f * o);
  }
  std::vector<float> x((size_t)n * nh * hd);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = (int)(i % hd);
    x[i] = ch_off[c] + ch_scale[c] * nd(rng);
  }
  return x;
}

// n_data: tokens of random data generated (>= the appended ones), so prefixes of one stream match.
filled fill(const kv_cache_params& p, const std::vector<int>& chunks, uint32_t seed, float outlier = 0.0f,
            int n_data = 0, int n_outlier = 3) {
  filled f;
  f.cache = make_kv_cache(p);
  std::mt19937 rng(seed);
  int n = 0;
  for (int c : chunks) n += c;
  n = std::max(n, n_data);
  f.k = kv_data(rng, n, p.n_kv_head, p.head_dim, true, outlier, n_outlier);
  f.v = kv_data(rng, n, p.n_kv_head, p.head_dim, false);
  int at = 0;
  for (int c : chunks) {
    const size_t off = (size_t)at * p.n_kv_head * p.head_dim;
    for (int il = 0; il < p.n_layer; ++il) f.cache->append(il, 0, c, f.k.data() + off, f.v.data() + off);
    at += c;
  }
  return f;
}

std::vector<float> queries(int n_tokens, int n_head, int hd, uint32_t seed, float mag = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, mag);
  std::vector<float> q((size_t)n_tokens * n_head * hd);
  for (auto& x : q) x = nd(rng);
  return q;
}

kv_cache_params base_params(const std::string& tk, const std::string& tv, int hd, int nh, int n_ctx) {
  return test::one_layer_params(tk, tv, hd, nh, n_ctx);
}

std::vector<float> attend(kv_cache& c, int pos0, int n_tokens, int n_head, const std::vector<float>& q,
                          thread_pool& pool) {
  std::vector<float> out(q.size(), NAN);
  c.attend(0, 0, pos0, n_tokens, n_head, q.data(), 1.0f / std::sqrt((float)c.params().head_dim), out.data(), pool);
  return out;
}

// Fused attention equals dequantize-then-attend on the same codes (1e-5 relative) over head_dim x
// GQA x length, every axis value covered, formats and windows rotating through the matrix.
TEST(kv_cache_quant, fused_equals_dequantize_then_attend) {
  const std::pair<const char*, const char*> fmts[] = {
      {"q8", "q8"},   {"q4", "q4"},   {"q3", "q3"},       {"q2", "q2"},       {"q8a", "q8a"},   {"q4a", "q4a"},
      {"q3a", "q3a"}, {"q2a", "q2a"}, {"kivi8", "kivi8"}, {"kivi4", "kivi4"}, {"kivi2", "kivi2"}, {"q8", "q4"},
      {"f16", "q4"},  {"q4", "f16"},  {"kivi2", "q8"},    {"q4nl", "q2nl"},   {"q3nl", "q3nl"}, {"q2nl", "q4nl"}};
  const int n_fmt = sizeof(fmts) / sizeof(fmts[0]);
  thread_pool pool(2);
  int idx = 0, n_group[3] = {0, 0, 0};
  double worst = 0;
  for (int hd : {64, 80, 96, 112, 128, 256})
    for (int gqa : {1, 2, 4, 7, 8})
      for (int len : {1, 17, 97, 1000, 4097}) {
        const auto [tk, tv] = fmts[idx % n_fmt];
        const bool windows = (idx / n_fmt + idx) % 2 == 1;
        ++idx;
        const int nh = hd >= 256 ? 1 : 2;
        auto p = base_params(tk, tv, hd, nh, len + 8);
        if (windows) {  // short lengths keep a compressed body between the windows
          p.sink = std::min(4, len / 8);
          p.exact_recent = std::min(16, len / 4);
        }
        // per-token group size and rotation rotate through the matrix (G must divide head_dim)
        const int groups[] = {0, 64, 128, hd};
        const int G = groups[(idx / 3) % 4];
        p.group_size = hd % (G ? G : 1) == 0 ? G : 0;
        const char* rots[] = {"auto", "srht", "srft"};
        p.rotation = parse_kv_rotation(rots[(idx / 7) % 3]);
        std::vector<int> chunks = {len};
        if (len > 17) chunks = {len / 3, 1, len - len / 3 - 1};
        auto a = fill(p, chunks, 100 + idx);
        p.attn = attn_path::dequant;
        filled b;  // the same tokens, appended the same way
        b.cache = make_kv_cache(p);
        for (int at = 0; int c : chunks) {
          const size_t off = (size_t)at * nh * hd;
          b.cache->append(0, 0, c, a.k.data() + off, a.v.data() + off);
          at += c;
        }
        const int n_head = nh * gqa;
        // decode at the last position, and a causal prefill chunk over the last few positions
        for (int nq : {1, len <= 1000 ? std::min(len, 19) : 1}) {
          const auto q = queries(nq, n_head, hd, 7 + idx);
          const auto oa = attend(*a.cache, len - nq, nq, n_head, q, pool);
          const auto ob = attend(*b.cache, len - nq, nq, n_head, q, pool);
          const double e = rel_err(oa, ob);
          worst = std::max(worst, e);
          EXPECT_LE(e, 1e-5) << tk << "/" << tv << " hd " << hd << " gqa " << gqa << " len " << len << " nq " << nq
                             << " windows " << windows << " (" << a.cache->describe() << ")";
          ++n_group[p.group_size == 64 ? 1 : p.group_size == 128 ? 2 : 0];
        }
      }
  std::printf("[fused vs dequantize-then-attend] %d configurations, worst relative error %.3g\n", idx, worst);
  EXPECT_GT(n_group[1], 0);  // every group size was exercised
  EXPECT_GT(n_group[2], 0);
}

// Every format against float64 attention on the original values, with a named tolerance on the
// norm-wise relative error ||out - ref|| / ||ref|| over 16 decode queries x 8 heads, beside the
// error of uniform attention (every key weighted alike, V exact: what a cache that lost K would
// give), which every useful format must beat. srht / srft rows check the V un-rotation, which
// fused == dequantize-then-attend cannot (both paths share it). The 4097-token rows split the body
// into chunks (split-K) merged through attn_state.
TEST(kv_cache_quant, accuracy_against_float64) {
  struct tol {
    const char* type;
    const char* rotation;
    int group, len;
    double max_rel;
  };
  // Tolerances are about 1.3x the measured values (random keys with per-channel offsets and
  // spreads). q2 (ternary levels -s, 0, s) and q2a are worse than uniform attention on this data
  // (measured 1.40 and 0.96 against 0.92): their rows guard against regressions only; their
  // correctness is checked by fused == dequantize-then-attend and the per-element bounds. Prefer kivi2.
  // The non-uniform formats measured 0.140 / 0.288 / 0.543 (q4nl / q3nl / q2nl) against q4 / q3 / q2's
  // 0.152 / 0.341 / 1.037.
  const tol tols[] = {{"q8", "auto", 0, 1000, 0.018},   {"q8a", "auto", 0, 1000, 0.017},  {"q4", "auto", 0, 1000, 0.24},
                      {"q4a", "auto", 0, 1000, 0.20},   {"q3", "auto", 0, 1000, 0.60},    {"q3a", "auto", 0, 1000, 0.44},
                      {"q2", "auto", 0, 1000, 1.6},     {"q2a", "auto", 0, 1000, 1.1},    {"kivi8", "auto", 0, 1000, 0.010},
                      {"kivi4", "auto", 0, 1000, 0.16}, {"kivi2", "auto", 0, 1000, 0.70}, {"q4", "srht", 0, 1000, 0.24},
                      {"q4", "srft", 0, 1000, 0.24},    {"q8", "srft", 0, 1000, 0.018},   {"q8", "srht", 0, 1000, 0.018},
                      {"q4", "auto", 64, 1000, 0.26},   {"q4", "auto", 128, 1000, 0.28}, {"q4", "auto", 0, 4097, 0.24},
                      {"kivi4", "auto", 0, 4097, 0.16}, {"q8", "srft", 128, 4097, 0.018}, {"q4nl", "auto", 0, 1000, 0.19},
                      {"q3nl", "auto", 0, 1000, 0.38},  {"q2nl", "auto", 0, 1000, 0.72}};
  thread_pool pool(2);
  const int hd = 128, nh = 2, gqa = 4, n_q = 16;
  for (const auto& t : tols) {
    auto p = base_params(t.type, t.type, hd, nh, t.len);
    p.rotation = parse_kv_rotation(t.rotation);
    p.group_size = t.group;
    auto f = fill(p, {t.len}, 5);
    double num = 0, den = 0, unum = 0;
    for (int i = 0; i < n_q; ++i) {
      const auto q = queries(1, nh * gqa, hd, 9 + i, 1.0f);
      const auto out = attend(*f.cache, t.len - 1, 1, nh * gqa, q, pool);
      const auto ref = attend_f64(f.k, f.v, q.data(), nh, hd, t.len - 1, 1, nh * gqa, 1.0f / std::sqrt((float)hd));
      const auto uni = attend_f64(f.k, f.v, q.data(), nh, hd, t.len - 1, 1, nh * gqa, 0.0f);
      for (size_t j = 0; j < out.size(); ++j) {
        num += (out[j] - ref[j]) * (out[j] - ref[j]);
        den += ref[j] * ref[j];
        unum += (uni[j] - ref[j]) * (uni[j] - ref[j]);
      }
    }
    const double e = std::sqrt(num / den), eu = std::sqrt(unum / den);
    std::printf("[accuracy] %-6s len %4d %s: relative error %.4f (tolerance %.3f; uniform attention %.3f)\n", t.type,
                t.len, f.cache->describe().c_str(), e, t.max_rel, eu);
    EXPECT_LE(e, t.max_rel) << t.type << " " << t.rotation << " G " << t.group << " len " << t.len;
    if (std::string(t.type).rfind("q2", 0) != 0) {
      EXPECT_LE(e, 0.6 * eu) << t.type << " " << t.rotation << " G " << t.group << " len " << t.len;
    }
  }
}

// Exact windows hold f16 rows from the very first forward pass: a prompt that fits in sink +
// recent (one append) attends at f16 accuracy, far below the same format without windows, and
// after more tokens the compressed body is exactly the positions between the windows (whole KIVI
// groups), the exact tail never longer than min_tail + U - 1 (for KIVI: its residual R).
TEST(kv_cache_quant, windows_are_exact) {
  thread_pool pool(1);
  const int hd = 64, nh = 2;
  for (const char* t : {"q4", "q2a", "kivi4", "kivi2"}) {
    SCOPED_TRACE(t);
    const bool kivi = std::string(t).rfind("kivi", 0) == 0;
    auto p = base_params(t, t, hd, nh, 400);
    p.k_channel_scale = false;  // (its first 256 positions would be exact: they are the windows here)
    p.sink = 4;
    p.exact_recent = 16;
    p.kivi_group = 16;
    p.kivi_residual = 24;
    auto none = p;
    none.sink = none.exact_recent = 0;
    none.kivi_residual = 0;
    auto w = fill(p, {20}, 31);
    auto c = fill(none, {20}, 31);
    const auto q = queries(1, nh * 4, hd, 3, 1.0f);
    const auto ref = attend_f64(w.k, w.v, q.data(), nh, hd, 19, 1, nh * 4, 0.125f);
    const double ew = rel_err(attend(*w.cache, 19, 1, nh * 4, q, pool), ref);
    const double ec = rel_err(attend(*c.cache, 19, 1, nh * 4, q, pool), ref);
    std::printf("[windows] %-5s 20 tokens in sink 4 + recent 16: error %.3g (without windows %.3g)\n", t, ew, ec);
    EXPECT_LE(ew, 2e-3);  // f16 rounding of the rotated rows
    EXPECT_GE(ec, 10 * ew);
    // one token at a time up to 300: the body is [sink, sink + n_comp), n_comp in whole units; with
    // a recent window the tail is that window plus the part of a unit not yet whole, without one
    // (recent 0) the KIVI tail is at most its residual R
    for (int recent : {16, 0}) {
      auto pr = p;
      pr.exact_recent = recent;
      const int unit = kivi ? pr.kivi_group : 1;
      const int min_tail = kivi ? std::max(pr.exact_recent, pr.kivi_residual - pr.kivi_group + 1) : pr.exact_recent;
      auto g = make_kv_cache(pr);
      std::mt19937 rng(8);
      const auto k = kv_data(rng, 300, nh, hd, true), v = kv_data(rng, 300, nh, hd, false);
      int last = 0;
      for (int n = 1; n <= 300; ++n) {
        g->append(0, 0, 1, k.data() + (size_t)(n - 1) * nh * hd, v.data() + (size_t)(n - 1) * nh * hd);
        const auto b = kv_cache_stored_bytes(*g, 0, 0);
        int n_pos = 0, n_comp = 0;
        std::memcpy(&n_pos, b.data(), sizeof n_pos);
        std::memcpy(&n_comp, b.data() + sizeof n_pos, sizeof n_comp);
        const int tail = n - std::min(n, pr.sink) - n_comp;
        ASSERT_EQ(n_pos, n);
        ASSERT_EQ(n_comp, unit * (std::max(0, n - pr.sink - min_tail) / unit)) << "n " << n << " recent " << recent;
        ASSERT_GE(n_comp, last);
        ASSERT_GE(tail, std::min(n - std::min(n, pr.sink), pr.exact_recent)) << "n " << n;  // the recent window is exact
        ASSERT_LE(tail, min_tail + unit - 1) << "n " << n << " recent " << recent;
        if (kivi && recent == 0) {
          ASSERT_LE(tail, pr.kivi_residual) << "n " << n;
        }
        last = n_comp;
      }
    }
  }
}

// The per-channel scale λ (and μ) is calibrated once, on the first channel_calib positions of a
// layer (here 64, the prompt), then frozen: how the later tokens arrive does not change any stored
// byte, even when they are scaled 10x (a recalibration would re-derive λ from them).
TEST(kv_cache_quant, channel_scale_is_frozen_after_the_prompt) {
  for (const char* t : {"q4", "kivi4"}) {
    SCOPED_TRACE(t);
    auto p = base_params(t, t, 64, 2, 256);
    p.channel_scale = true;
    p.channel_calib = 64;
    p.kivi_group = 16;
    auto a = fill(p, {64}, 12, 0.0f, 200);
    for (size_t i = (size_t)64 * 2 * 64; i < a.k.size(); ++i) a.k[i] *= 10.0f, a.v[i] *= 10.0f;
    auto b = make_kv_cache(p);
    b->append(0, 0, 64, a.k.data(), a.v.data());
    for (int j = 64; j < 200; ++j)
      a.cache->append(0, 0, 1, a.k.data() + (size_t)j * 128, a.v.data() + (size_t)j * 128);
    b->append(0, 0, 136, a.k.data() + (size_t)64 * 128, a.v.data() + (size_t)64 * 128);
    EXPECT_EQ(kv_cache_stored_bytes(*a.cache, 0, 0), kv_cache_stored_bytes(*b, 0, 0));
    // and the first 64 tokens' codes are those of a cache that never saw the scaled tokens
    auto c = make_kv_cache(p);
    c->append(0, 0, 64, a.k.data(), a.v.data());
    const auto full = kv_cache_stored_bytes(*b, 0, 0), prompt = kv_cache_stored_bytes(*c, 0, 0);
    EXPECT_NE(full.size(), prompt.size());
    if (std::string(t) == "q4") {  // per-token: the prompt's rows are stored alike (KIVI's exact residual is not)
      thread_pool pool(1);
      const auto q = queries(1, 8, 64, 4, 1.0f);
      std::vector<float> oc(q.size()), ob(q.size());
      c->attend(0, 0, 63, 1, 8, q.data(), 0.125f, oc.data(), pool);
      b->attend(0, 0, 63, 1, 8, q.data(), 0.125f, ob.data(), pool);  // query at position 63: the prompt only
      EXPECT_EQ(oc, ob);
    }
  }
}

// Planted outlier channels (1, 2 or 3 channels at 50x or 100x the rest, x1 / x1.5 / x2 for the
// second and third, fixed sign), 4-bit K (V exact, to isolate the K error), attention output against
// float64. Rotation spreads a channel of magnitude M over every rotated coordinate as +-M / sqrt(d)
// (8.8x the rest for M = 100, d = 128), and several fixed-sign channels add up in some coordinates
// (sum |M| / sqrt(d): 19.9x for 50 + 75 + 100), so rotation alone pays while that sum stays within a
// few times the rest: asserted >= 2x at 50x with one or two channels. Fixed-sign channels are a
// per-channel mean, which prompt-calibrated centering (--kv-channel-scale: mu and lambda, then the
// rotation; softmax ignores q . mu) removes before quantizing: asserted >= 2x everywhere.
TEST(kv_cache_quant, rotation_beats_planted_outliers) {
  thread_pool pool(2);
  const int hd = 128, nh = 2, gqa = 4, len = 512;
  struct arm {
    const char* name;
    const char* rotation;
    bool channel_scale;
  };
  const arm arms[] = {{"unrotated", "none", false},
                      {"hadamard", "hadamard", false},
                      {"srht", "srht", false},
                      {"channel scale + hadamard", "hadamard", true}};
  for (float mag : {50.0f, 100.0f})
    for (int n_out = 1; n_out <= 3; ++n_out) {
      double err[4] = {0, 0, 0, 0};
      for (int a = 0; a < 4; ++a)
        for (int trial = 0; trial < 4; ++trial) {
          auto p = base_params("q4", "f16", hd, nh, len);
          p.rotation = parse_kv_rotation(arms[a].rotation);
          p.channel_scale = arms[a].channel_scale;
          p.k_channel_scale = arms[a].channel_scale;  // rotation alone: K channel scale (the default) off
          auto f = fill(p, {len}, 40 + trial, mag, 0, n_out);
          const auto q = queries(1, nh * gqa, hd, 70 + trial, 1.0f);
          const auto out = attend(*f.cache, len - 1, 1, nh * gqa, q, pool);
          const auto ref = attend_f64(f.k, f.v, q.data(), nh, hd, len - 1, 1, nh * gqa, 1.0f / std::sqrt((float)hd));
          err[a] += rel_err(out, ref) / 4;
        }
      for (int a = 0; a < 4; ++a)
        std::printf("[outliers] %d x %3.0fx, q4 %-26s attention-output relative error %.4f (%.2fx lower than unrotated)\n",
                    n_out, mag, arms[a].name, err[a], err[0] / err[a]);
      if (mag == 50.0f && n_out <= 2) {
        EXPECT_GE(err[0] / err[1], 2.0) << n_out << " channels at " << mag << "x, hadamard";
      }
      EXPECT_GE(err[0] / err[3], 2.0) << n_out << " channels at " << mag << "x, channel scale + hadamard";
    }
}

// Qwen2.5-like K: the K projection bias puts a large, nearly constant offset on a few channels (the
// lowest RoPE frequencies, which barely rotate). Measured on Qwen2.5-Coder-0.5B-Instruct, layer 0,
// wikitext-2: channels 29-31 and 61-63 at |mean| 72-145 with a spread (std) of 0.3-2.3, the other
// channels' std ~0.4-1.4 (docs/quality.md). A per-token scale then spends its range on the offset
// and 4-bit K turns the model's output into garbage (llama.cpp q4_0: KLD 1.59). The default
// configuration (k_channel_scale auto: K minus its per-channel prompt mean μ_K, which softmax
// ignores, and scaled by λ_K) must give the error of the same data without the offset; with it off
// the error must be much larger (so this test fails if the default regresses). Prompt lengths 300 and 5 (a short
// generate prompt calibrates μ on 5 tokens, the rest arrive one at a time), windows on and off.
TEST(kv_cache_quant, default_k_survives_a_qwen_like_channel_offset) {
  thread_pool pool(2);
  const int hd = 64, nh = 2, gqa = 7, len = 300;
  const int chans[] = {29, 30, 31, 61, 62, 63};
  const float offs[] = {120.0f, -90.0f, 135.0f, 70.0f, -145.0f, -130.0f};
  struct cfg {
    const char* type;
    int sink, recent, prompt;
    double max_ratio_off;  // the offset's error / the clean data's error, at most
    double min_ratio_no_centering;  // centering off / default, at least
  };
  // measured (4 seeds): see the printed lines; bounds leave room for seeds, none for garbage
  for (const cfg& c : {cfg{"q4", 0, 0, len, 1.3, 5.0}, cfg{"q4", 4, 16, 5, 1.3, 5.0}, cfg{"q3", 0, 0, len, 1.3, 5.0},
                       cfg{"q4a", 0, 0, 5, 1.3, 5.0}, cfg{"q8", 0, 0, len, 1.3, 5.0},
                       cfg{"q8a", 4, 16, 5, 1.3, 5.0}}) {
    double err[3] = {0, 0, 0};  // clean (default), offset (default), offset (centering off)
    for (int trial = 0; trial < 4; ++trial)
      for (int arm = 0; arm < 3; ++arm) {
        auto p = base_params(c.type, c.type, hd, nh, len);
        p.sink = c.sink;
        p.exact_recent = c.recent;
        if (arm == 2) p.k_channel_scale = false;
        std::mt19937 rng(90 + trial);
        auto k = kv_data(rng, len, nh, hd, true), v = kv_data(rng, len, nh, hd, false);
        if (arm > 0)
          for (int t = 0; t < len; ++t)
            for (int h = 0; h < nh; ++h)
              for (int o = 0; o < 6; ++o) k[((size_t)t * nh + h) * hd + chans[o]] += (h ? -0.7f : 1.0f) * offs[o];
        auto cache = make_kv_cache(p);
        cache->append(0, 0, c.prompt, k.data(), v.data());
        for (int t = c.prompt; t < len; ++t)
          cache->append(0, 0, 1, k.data() + (size_t)t * nh * hd, v.data() + (size_t)t * nh * hd);
        const auto q = queries(1, nh * gqa, hd, 50 + trial, 1.0f);
        const auto out = attend(*cache, len - 1, 1, nh * gqa, q, pool);
        const auto ref = attend_f64(k, v, q.data(), nh, hd, len - 1, 1, nh * gqa, 1.0f / std::sqrt((float)hd));
        err[arm] += rel_err(out, ref) / 4;
      }
    std::printf("[qwen-like K offset] %-3s sink %d recent %2d prompt %3d: error clean %.4f, offset %.4f (%.2fx), "
                "offset without the K channel scale %.4f (%.1fx)\n",
                c.type, c.sink, c.recent, c.prompt, err[0], err[1], err[1] / err[0], err[2], err[2] / err[1]);
    EXPECT_LE(err[1], c.max_ratio_off * err[0]) << c.type << " sink " << c.sink << " prompt " << c.prompt;
    EXPECT_GE(err[2], c.min_ratio_no_centering * err[1]) << c.type << " sink " << c.sink << " prompt " << c.prompt;
  }
}

// The stored codes do not depend on how the tokens arrived (200x1 == 1x200 == 7+13+180). The K channel scale
// (k_channel_scale, on by default for per-token K) calibrates μ_K, λ_K on the first append, so it is
// off in the first pass; with it on, the codes depend on the first append only: 50+150 == 50+150x1 == 50+7+13+130.
TEST(kv_cache_quant, arrival_order_invariance) {
  struct cfg {
    const char *tk, *tv;
    int sink, recent;
  };
  for (bool center : {false, true})
  for (const cfg& c : {cfg{"kivi2", "kivi2", 0, 0}, cfg{"kivi4", "q4", 3, 5}, cfg{"q4", "q8a", 4, 16},
                       cfg{"q2", "q3", 0, 0}, cfg{"kivi8", "f16", 1, 40}}) {
    auto p = base_params(c.tk, c.tv, 64, 2, 256);
    p.n_layer = 2;
    p.sink = c.sink;
    p.exact_recent = c.recent;
    p.kivi_group = 16;
    p.kivi_residual = 24;
    p.k_channel_scale = center;
    std::vector<int> ones(center ? 150 : 200, 1);
    if (center) ones.insert(ones.begin(), 50);
    auto one = fill(p, center ? std::vector<int>{50, 150} : std::vector<int>{200}, 3);
    auto many = fill(p, ones, 3);
    auto mixed = fill(p, center ? std::vector<int>{50, 7, 13, 130} : std::vector<int>{7, 13, 180}, 3);
    for (int il = 0; il < 2; ++il) {
      const auto a = kv_cache_stored_bytes(*one.cache, il, 0);
      EXPECT_EQ(a, kv_cache_stored_bytes(*many.cache, il, 0)) << c.tk << "/" << c.tv << " layer " << il;
      EXPECT_EQ(a, kv_cache_stored_bytes(*mixed.cache, il, 0)) << c.tk << "/" << c.tv << " layer " << il;
    }
    EXPECT_EQ(one.cache->bytes_used(), many.cache->bytes_used());
  }
}

// With exact windows the compressed body holds only n_ctx - sink - recent rows (whole KIVI groups):
// filling to n_ctx, truncating and refilling to n_ctx stays in bounds, and for per-token formats
// equals never having appended the dropped tokens.
TEST(kv_cache_quant, windows_fill_to_capacity_after_truncate) {
  thread_pool pool(1);
  for (const char* t : {"q4", "kivi4"}) {
    SCOPED_TRACE(t);
    auto p = base_params(t, t, 64, 2, 200);
    p.sink = 4;
    p.exact_recent = 16;
    p.kivi_group = 32;
    p.kivi_residual = 32;
    auto f = fill(p, {90, 110}, 21, 0.0f, 310);  // first append 90: the one g below makes too (K channel scale)
    EXPECT_THROW(f.cache->append(0, 0, 1, f.k.data(), f.v.data()), error);  // full
    f.cache->truncate(0, 90);
    const size_t off = (size_t)200 * 2 * 64;  // 110 more tokens of the same stream
    f.cache->append(0, 0, 110, f.k.data() + off, f.v.data() + off);
    ASSERT_EQ(f.cache->n_pos(0), 200);
    std::vector<float> k(f.k.begin(), f.k.begin() + 90 * 2 * 64), v(f.v.begin(), f.v.begin() + 90 * 2 * 64);
    k.insert(k.end(), f.k.begin() + off, f.k.begin() + off + 110 * 2 * 64);
    v.insert(v.end(), f.v.begin() + off, f.v.begin() + off + 110 * 2 * 64);
    const auto q = queries(1, 4, 64, 5);
    const auto out = attend(*f.cache, 199, 1, 4, q, pool);
    // (max-norm error of 4-bit K/V on this random data: q4 0.129, kivi4 0.099; a misplaced row gives O(1))
    const double e = rel_err(out, attend_f64(k, v, q.data(), 2, 64, 199, 1, 4, 0.125f));
    std::printf("[windows at capacity] %s max-norm relative error %.3g\n", t, e);
    EXPECT_LE(e, 0.2);
    if (std::string(t) == "q4") {  // per-token: the same codes as a cache that never saw the dropped tokens
      auto g = make_kv_cache(p);
      g->append(0, 0, 90, k.data(), v.data());
      g->append(0, 0, 110, k.data() + (size_t)90 * 2 * 64, v.data() + (size_t)90 * 2 * 64);
      EXPECT_EQ(kv_cache_stored_bytes(*f.cache, 0, 0), kv_cache_stored_bytes(*g, 0, 0));
    }
  }
}

TEST(kv_cache_quant, truncate_and_clear) {
  thread_pool pool(1);
  // per-token without windows: truncating equals never having appended the rest
  {
    auto p = base_params("q4", "q4", 64, 2, 300);
    auto full = fill(p, {120, 130}, 11);  // the same first append (K centering calibrates μ, λ on it)
    full.cache->truncate(0, 120);
    EXPECT_EQ(full.cache->n_pos(0), 120);
    auto part = fill(p, {120}, 11, 0.0f, 250);
    EXPECT_EQ(kv_cache_stored_bytes(*full.cache, 0, 0), kv_cache_stored_bytes(*part.cache, 0, 0));
    EXPECT_EQ(full.cache->bytes_used(), part.cache->bytes_used());
    full.cache->clear(0);
    EXPECT_EQ(full.cache->n_pos(0), 0);
    EXPECT_EQ(full.cache->bytes_used(), 0u);  // μ_K / λ_K too: the next append calibrates again
    EXPECT_THROW(full.cache->truncate(0, -1), error);
  }
  // KIVI: truncating inside a quantized group moves its kept rows back to the exact tail
  {
    auto p = base_params("kivi4", "kivi4", 64, 1, 300);
    p.kivi_group = 32;
    p.kivi_residual = 32;
    auto f = fill(p, {200}, 12);
    f.cache->truncate(0, 150);  // body 160 -> 128, rows 128..149 dequantized into the tail
    EXPECT_EQ(f.cache->n_pos(0), 150);
    const auto q = queries(1, 2, 64, 3);
    const auto out = attend(*f.cache, 149, 1, 2, q, pool);
    std::vector<float> k(f.k.begin(), f.k.begin() + 150 * 64), v(f.v.begin(), f.v.begin() + 150 * 64);
    const auto ref = attend_f64(k, v, q.data(), 1, 64, 149, 1, 2, 0.125f);
    EXPECT_LE(rel_err(out, ref), 0.12);
    // appending continues the sequence (the partial group is requantized once it is whole)
    std::vector<float> kk(60 * 64, 0.5f), vv(60 * 64, -0.25f);
    f.cache->append(0, 0, 60, kk.data(), vv.data());
    EXPECT_EQ(f.cache->n_pos(0), 210);
    const auto out2 = attend(*f.cache, 209, 1, 2, q, pool);
    for (float x : out2) ASSERT_TRUE(std::isfinite(x));
    f.cache->clear(0);
    EXPECT_EQ(f.cache->bytes_used(), 0u);
    auto fresh = fill(p, {200}, 12);
    f.cache->append(0, 0, 200, fresh.k.data(), fresh.v.data());
    EXPECT_EQ(kv_cache_stored_bytes(*f.cache, 0, 0), kv_cache_stored_bytes(*fresh.cache, 0, 0));
  }
}

// NaN/Inf policy: compressed caches reject non-finite K/V (and values beyond f16 after rotation)
// with an error naming layer/seq/position/head/channel, leaving the cache unchanged.
TEST(kv_cache_quant, non_finite_input_is_rejected) {
  auto p = base_params("q4", "q4", 64, 2, 64);
  auto f = fill(p, {10}, 1);
  const auto before = kv_cache_stored_bytes(*f.cache, 0, 0);
  std::vector<float> k(5 * 2 * 64, 0.1f), v(5 * 2 * 64, 0.2f);
  k[(3 * 2 + 1) * 64 + 5] = NAN;
  try {
    f.cache->append(0, 0, 5, k.data(), v.data());
    FAIL() << "NaN accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_input);
    EXPECT_NE(std::string(e.what()).find("non-finite K value nan at layer 0, seq 0, position 13, kv head 1, channel 5"),
              std::string::npos)
        << e.what();
  }
  k[(3 * 2 + 1) * 64 + 5] = 0.1f;
  v[7] = INFINITY;
  EXPECT_THROW(f.cache->append(0, 0, 5, k.data(), v.data()), error);
  v[7] = 1e6f;  // finite, but beyond f16 after rotation
  EXPECT_THROW(f.cache->append(0, 0, 5, k.data(), v.data()), error);
  EXPECT_EQ(f.cache->n_pos(0), 10);
  EXPECT_EQ(kv_cache_stored_bytes(*f.cache, 0, 0), before);
  // all-zero K/V: scale 0, no NaN anywhere
  auto z = base_params("q4a", "q2", 64, 1, 64);
  auto c = make_kv_cache(z);
  std::vector<float> zero(40 * 64, 0.0f);
  c->append(0, 0, 40, zero.data(), zero.data());
  thread_pool pool(1);
  const auto q = queries(1, 1, 64, 1);
  for (float x : attend(*c, 39, 1, 1, q, pool)) ASSERT_EQ(x, 0.0f);
}

TEST(kv_cache_quant, bytes_are_exact) {
  auto p = base_params("q4", "q4", 128, 8, 1024);
  p.n_layer = 2;
  p.n_seq = 3;
  auto c = make_kv_cache(p);
  // K channel scale (on by default for per-token K): μ_K and λ_K, f32 per layer, sequence, kv head
  // and channel, the staging rows of the first min(channel_calib, n_ctx) positions (f16 K and V and
  // their int16 residuals) and the staging references (position 0 of K and V, f32)
  auto centring = [](const kv_cache_params& q) {
    return (size_t)2 * q.n_layer * q.n_seq * q.n_kv_head * q.head_dim * 4 +
           (size_t)2 * q.n_layer * q.n_seq * std::min(q.channel_calib, q.n_ctx) * q.n_kv_head * q.head_dim * 4 +
           (size_t)2 * q.n_layer * q.n_seq * q.n_kv_head * q.head_dim * 4;
  };
  // q4, g32, head_dim 128: 64 code bytes + 4 f16 scales = 72 bytes per token per kv head per side
  EXPECT_EQ(c->bytes(), (size_t)2 * 3 * 8 * 1024 * 72 * 2 + centring(p));
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(p), 2.0 * 8 * 72 * 2);
  // before the 256 calibration positions: their staging rows only (4 bytes an element, K and V) and
  // the references (f32 K and V), per layer
  std::vector<float> k(300 * 8 * 128, 0.3f);
  for (int il = 0; il < 2; ++il) c->append(il, 1, 100, k.data(), k.data());
  EXPECT_EQ(c->bytes_used(), (size_t)2 * (100 * 8 * 128 * 4 * 2 + 8 * 128 * 4 * 2));
  // then per layer the stored rows, μ_K, λ_K of seq 1, its 256 staging rows and their references
  for (int il = 0; il < 2; ++il) c->append(il, 1, 200, k.data(), k.data());
  EXPECT_EQ(c->bytes_used(), (size_t)2 * (300 * 8 * 72 * 2 + (size_t)2 * 8 * 128 * 4 + (size_t)256 * 8 * 128 * 4 * 2 +
                                          (size_t)8 * 128 * 4 * 2));
  // KIVI-4: K 64 codes + 2*2*128/32 per token; V q4a g32 64 + 8 * 2
  auto pk = base_params("kivi4", "kivi4", 128, 8, 1024);
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(pk), 8.0 * (80 + 80));
  // exact windows are allocated up front: sink + (recent) rows of f16 per side, and the compressed
  // body only for the positions that can leave them (100 - 4 - 8)
  auto pw = base_params("q8", "q8", 64, 1, 100);
  pw.sink = 4;
  pw.exact_recent = 8;
  auto w = make_kv_cache(pw);
  const size_t row = 64 + 2 * 2;  // q8 g32: 64 codes + 2 scales
  EXPECT_EQ(w->bytes(), 2 * ((size_t)88 * row + (size_t)(4 + 8) * 64 * 2) + centring(pw));
  // kv_bytes_at_ctx: the same figures without allocating, windows included
  EXPECT_EQ(kv_bytes_at_ctx(p), (size_t)2 * 3 * 8 * 1024 * 72 * 2 + centring(p));
  EXPECT_EQ(kv_bytes_at_ctx(pw), 2 * ((size_t)88 * row + (size_t)(4 + 8) * 64 * 2) + centring(pw));
  // a window longer than the context keeps everything exact: no overflow, no body
  for (const char* t : {"q4", "kivi4"}) {
    auto pl = base_params(t, t, 64, 1, 64);
    pl.exact_recent = std::numeric_limits<int>::max();
    auto l = make_kv_cache(pl);
    // 64 exact f16 rows per side (+ μ_K / λ_K for q4; KIVI has its own per-channel scales)
    EXPECT_EQ(l->bytes(), (size_t)2 * 64 * 64 * 2 + (std::string(t) == "q4" ? centring(pl) : 0)) << t;
    EXPECT_EQ(kv_bytes_at_ctx(pl), l->bytes()) << t;
    std::vector<float> x(64 * 64, 0.25f);
    l->append(0, 0, 64, x.data(), x.data());
    EXPECT_EQ(l->n_pos(0), 64) << t;
  }
  EXPECT_GT(kv_bytes_at_ctx(pw), (size_t)std::llround(kv_bytes_per_token(pw) * pw.n_ctx));
}

// kv_bytes_at_ctx equals what make_kv_cache allocates for every non-certified type, with and
// without exact windows, per-channel scales and KIVI residuals, over several sequences.
TEST(kv_cache_quant, bytes_at_ctx_equal_the_allocation) {
  int n = 0;
  for (const auto& t : kv_type_names()) {
    if (t.find("certified") != std::string::npos) continue;
    for (int variant = 0; variant < 4; ++variant) {
      auto p = base_params(t, variant == 3 ? "q4" : t, 64, 2, 300);
      p.n_layer = 3;
      p.n_seq = 2;
      if (variant >= 1) {
        p.sink = 4;
        p.exact_recent = 24;
      }
      p.channel_scale = variant == 2 && t != "f32" && t != "f16" && t != "bf16";
      p.kivi_residual = variant == 1 ? 40 : p.kivi_residual;
      EXPECT_EQ(kv_bytes_at_ctx(p), make_kv_cache(p)->bytes()) << t << " variant " << variant;
      ++n;
    }
  }
  EXPECT_GE(n, 40);
}

// attend_batch threads over (sequence, kv head, query tile, key chunk) through one planner for every
// cache: a batch of sequences of different lengths (decode and prefill chunks, windows, one long
// enough to split, placed second) gives each the output of attending it alone, bit for bit (a
// sequence's chunks do not depend on the batch); every output against float64 with the format's
// tolerance. Bad batches are refused before any output is written.
TEST(kv_cache_quant, attend_batch_equals_one_sequence_at_a_time) {
  thread_pool pool(2);
  const int hd = 64, nh = 2, n_head = 8;
  for (const char* t : {"q4", "kivi4", "q8", "f16", "certified"}) {
    SCOPED_TRACE(t);
    const bool certified = std::string(t) == "certified";
    auto p = base_params(t, t, hd, nh, 4200);
    p.n_seq = 4;
    p.sink = certified ? 0 : 4;  // (the certified cache keeps every token exact in its host tier)
    p.exact_recent = certified ? 0 : 16;
    auto c = make_kv_cache(p);
    const int lens[4] = {4097, 1, 300, 37};
    const int nq[4] = {1, 1, 5, 37};  // decode, decode, a prefill chunk, a whole prefill
    std::vector<std::vector<float>> k(4), v(4), q(4);
    for (int b = 0; b < 4; ++b) {
      std::mt19937 rng(50 + b);
      k[b] = kv_data(rng, lens[b], nh, hd, true);
      v[b] = kv_data(rng, lens[b], nh, hd, false);
      c->append(0, b, lens[b], k[b].data(), v[b].data());
      q[b] = queries(nq[b], n_head, hd, 60 + b, 1.0f);
    }
    std::vector<std::vector<float>> batched(4), alone(4);
    std::vector<attend_seq> seqs;
    for (int b : {2, 0, 3, 1}) {  // any order
      batched[b].assign(q[b].size(), NAN);
      seqs.push_back({b, lens[b] - nq[b], nq[b], q[b].data(), batched[b].data()});
    }
    c->attend_batch(0, seqs.data(), (int)seqs.size(), n_head, 0.125f, pool);  // seq 0 (split) is second
    for (int b = 0; b < 4; ++b) {
      alone[b].assign(q[b].size(), NAN);
      c->attend(0, b, lens[b] - nq[b], nq[b], n_head, q[b].data(), 0.125f, alone[b].data(), pool);
      const auto ref = attend_f64(k[b], v[b], q[b].data(), nh, hd, lens[b] - nq[b], nq[b], n_head, 0.125f);
      const double e = rel_err(batched[b], alone[b]), ef = rel_err(batched[b], ref);
      std::printf("[attend_batch] %-5s seq %d (%4d tokens, %2d queries): vs alone %.3g, vs float64 %.3g\n", t, b, lens[b],
                  nq[b], e, ef);
      EXPECT_EQ(batched[b], alone[b]) << "seq " << b << " (vs alone " << e << ")";
      // max-norm error of this random data: q4 0.24, kivi4 0.15, q8 0.012, f16 6.2e-4 at most
      const std::string ts = t;
      EXPECT_LE(ef, ts == "q4" ? 0.3 : ts == "kivi4" ? 0.2 : ts == "f16" ? 1e-3 : 0.02) << "seq " << b;
    }
    // refused, naming the op, before any output is written: a seq_id twice, out of range, queries
    // past the appended positions (the first sequence of each batch is valid)
    std::vector<float> o(q[1].size(), NAN), o0(q[0].size(), NAN);
    auto refused = [&](std::vector<attend_seq> b, const std::string& want) {
      try {
        c->attend_batch(0, b.data(), (int)b.size(), n_head, 0.125f, pool);
        ADD_FAILURE() << "no error for " << want;
      } catch (const error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      for (float x : o0) ASSERT_TRUE(std::isnan(x)) << want << ": output written before the error";
    };
    refused({{0, 4096, 1, q[0].data(), o0.data()}, {1, 0, 1, q[1].data(), o.data()}, {1, 0, 1, q[1].data(), o.data()}},
            "[kv_cache] attend_batch: seq_id 1 appears twice in one call");
    refused({{0, 4096, 1, q[0].data(), o0.data()}, {4, 0, 1, q[1].data(), o.data()}},
            "[kv_cache] attend_batch: seq_id 4 out of range [0, 4)");
    refused({{0, 4096, 1, q[0].data(), o0.data()}, {1, 1, 1, q[1].data(), o.data()}},
            "[kv_cache] attend_batch: queries at positions [1, 2) need appended positions, layer 0 of seq 1 holds 1");
    try {  // attend names itself
      c->attend(0, 7, 0, 1, n_head, q[1].data(), 0.125f, o.data(), pool);
      ADD_FAILURE() << "no error for seq 7";
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find("[kv_cache] attend: seq_id 7 out of range"), std::string::npos) << e.what();
    }
  }
}

// A long sequence batched with short ones is split as if attended alone (the split follows the
// batch's work, not its item count), so it does not become the batch's critical path: its output is
// bit-identical to attending it alone (a batch that did not split it would differ in rounding).
TEST(kv_cache_quant, attend_batch_splits_a_long_sequence_among_short_ones) {
  thread_pool pool(2);
  const int hd = 64, n_head = 4;
  auto p = base_params("q4", "q4", hd, 1, 8192);
  p.n_seq = 8;
  auto c = make_kv_cache(p);
  std::vector<std::vector<float>> q(8), batched(8), alone(8);
  std::vector<attend_seq> seqs;
  for (int b = 0; b < 8; ++b) {
    const int len = b == 0 ? 8192 : 16;
    std::mt19937 rng(90 + b);
    const auto k = kv_data(rng, len, 1, hd, true), v = kv_data(rng, len, 1, hd, false);
    c->append(0, b, len, k.data(), v.data());
    q[b] = queries(1, n_head, hd, 95 + b, 1.0f);
    batched[b].assign(q[b].size(), NAN);
    seqs.push_back({b, len - 1, 1, q[b].data(), batched[b].data()});
  }
  c->attend_batch(0, seqs.data(), 8, n_head, 0.125f, pool);
  for (int b = 0; b < 8; ++b) {
    alone[b].assign(q[b].size(), NAN);
    c->attend(0, b, seqs[b].pos0, 1, n_head, q[b].data(), 0.125f, alone[b].data(), pool);
    EXPECT_EQ(batched[b], alone[b]) << "seq " << b;
  }
}

TEST(kv_cache_quant, invalid_params_are_named) {
  auto expect_error = [](kv_cache_params p, const char* needle) {
    try {
      make_kv_cache(p);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto p = base_params("q4", "q4", 6, 1, 16);
  expect_error(p, "[kv_cache] K cache type 'q4' needs head_dim divisible by 8, got 6");
  p = base_params("q4", "q4", 96, 1, 16);
  p.group_size = 64;
  expect_error(p, "[kv_cache] group_size 64 must be 32, 64, 128 or head_dim");
  p = base_params("kivi2", "q4", 64, 1, 16);
  p.kivi_group = 0;
  expect_error(p, "[kv_cache] kivi_group must be in [1, 4096], got 0");
  auto expect_parse_error = [](auto parse, const char* name, const char* needle) {
    try {
      parse(name);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_input);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_parse_error(parse_kv_rotation, "spin", "unknown rotation 'spin'");
  expect_parse_error(parse_attn_path, "magic", "unknown attn_impl 'magic'");
  EXPECT_FALSE(parse_kv_rotation("auto").has_value());
  EXPECT_EQ(parse_attn_path("dequant"), attn_path::dequant);
  p = base_params("q4", "q4", 64, 1, 16);
  p.rotation = (rotation_kind)9;
  expect_error(p, "[kv_cache] rotation 9 is not a rotation_kind");
  p.rotation.reset();
  p.attn = (attn_path)7;
  expect_error(p, "[kv_cache] attn 7 is not an attn_path");
  // head_dim 8 (stories260K) works for every format: against float64, 8-bit and dense far below
  // the error of uniform attention (what a cache that lost K would give), 4- and 3-bit below it;
  // 2-bit is a regression guard only (kivi2 measured 1.25 against uniform 1.03 on these 40 tokens,
  // its K groups of 32 tokens at 4 levels)
  for (const auto& t : kv_type_names()) {
    if (t == "certified") continue;  // its own tests (test_certified_*)
    auto s = base_params(t, t, 8, 1, 40);
    // one 40-token draw, bounds set without the K channel scale; it moves such single-draw errors
    // both ways (q4 0.130 -> 0.278, q4a 0.190 -> 0.126, q3a 0.262 -> 0.354, q2a 0.549 -> 1.148):
    // the default's accuracy is asserted over seeds in default_k_survives_a_qwen_like_channel_offset
    s.k_channel_scale = false;
    auto f = fill(s, {40}, 2);
    thread_pool pool(1);
    const auto q = queries(1, 4, 8, 2);
    const auto out = attend(*f.cache, 39, 1, 4, q, pool);
    const auto ref = attend_f64(f.k, f.v, q.data(), 1, 8, 39, 1, 4, 1.0f / std::sqrt(8.0f));
    const auto uni = attend_f64(f.k, f.v, q.data(), 1, 8, 39, 1, 4, 0.0f);
    const double e = rel_err(out, ref), eu = rel_err(uni, ref);
    std::printf("[head_dim 8] %-9s error %.4f (uniform attention %.4f)\n", t.c_str(), e, eu);
    const bool wide = t == "f32" || t == "f16" || t == "bf16" || t.find('8') != std::string::npos;
    const bool two = t.find('2') != std::string::npos;
    if (t.find("nl") == std::string::npos) {
      EXPECT_LE(e, wide ? 0.05 * eu : two ? 1.5 * eu : 0.3 * eu) << t;
      continue;
    }
    // non-uniform levels (added after the bounds above were set on seed 2): the mean ratio over seeds
    // 2..8, as single draws vary 4x (q3 0.20-0.65, q3nl 0.13-0.75 against uniform attention ~1.0)
    double ratio = e / eu;
    for (int seed = 3; seed <= 8; ++seed) {
      auto f2 = fill(s, {40}, seed);
      const auto q2 = queries(1, 4, 8, seed);
      const auto o2 = attend(*f2.cache, 39, 1, 4, q2, pool);
      ratio += rel_err(o2, attend_f64(f2.k, f2.v, q2.data(), 1, 8, 39, 1, 4, 1.0f / std::sqrt(8.0f))) /
               rel_err(attend_f64(f2.k, f2.v, q2.data(), 1, 8, 39, 1, 4, 0.0f),
                       attend_f64(f2.k, f2.v, q2.data(), 1, 8, 39, 1, 4, 1.0f / std::sqrt(8.0f)));
    }
    ratio /= 7;
    std::printf("[head_dim 8] %-9s mean error / uniform attention over 7 seeds %.4f\n", t.c_str(), ratio);
    EXPECT_LE(ratio, two ? 1.0 : 0.45) << t;
  }
}

// The windows `-ctk q4 -ctv q4` gets when none are named (kv_auto_windows, the tools' "auto"): 4 sink
// and 32 recent exact positions wherever a side is per-token compressed and neither side is KIVI or
// certified; none otherwise. The expected table is written out by type name, not from kv_traits.
TEST(KvCacheQuant, AutoWindowsRule) {
  const std::set<std::string> per_token = {"q8", "q4", "q3", "q2", "q8a", "q4a", "q3a", "q2a", "q4nl", "q3nl", "q2nl"};
  const std::set<std::string> kivi = {"kivi8", "kivi4", "kivi2"};
  EXPECT_EQ(kv_auto_sink, 4);
  EXPECT_EQ(kv_auto_exact_recent, 32);
  int n_on = 0;
  for (const std::string& k : kv_type_names())
    for (const std::string& v : kv_type_names()) {
      kv_cache_params p;
      p.type_k = parse_kv_cache_type(k, "K");
      p.type_v = parse_kv_cache_type(v, "V");
      const bool on = (per_token.count(k) || per_token.count(v)) && !kivi.count(k) && !kivi.count(v) &&
                      k != "certified" && v != "certified";
      const kv_windows w = kv_auto_windows(p);
      EXPECT_EQ(w.sink, on ? 4 : 0) << k << "/" << v;
      EXPECT_EQ(w.exact_recent, on ? 32 : 0) << k << "/" << v;
      n_on += on;
      p.certify = true;  // certified attention refuses windows
      EXPECT_EQ(kv_auto_windows(p).sink, 0) << k << "/" << v;
      EXPECT_EQ(kv_auto_windows(p).exact_recent, 0) << k << "/" << v;
    }
  EXPECT_EQ(n_on, 11 * 11 + 2 * 11 * 3);  // per-token x per-token, and per-token beside f32 / f16 / bf16
}

}  // namespace
}  // namespace kvq
