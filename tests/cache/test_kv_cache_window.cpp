// Per-layer cache geometry: sliding-window layers (kv_cache_params::layers). Every cache applies a
// layer's window itself (float64 reference restricted to the window); the dense and compressed
// caches keep a ring of window - 1 + n_ubatch positions for such a layer, so its bytes do not grow
// with n_ctx, and the ring gives the same attention as a cache that keeps every position; appends
// larger than n_ubatch, truncation past the ring and bad geometry are refused with the field named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cache/attn_f64.h"
#include "kvq/certified.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "kvq/kv_cache.h"

namespace kvq {
namespace {

using test::attend_f64;
using test::rel_err;

constexpr int kHd = 64, kKv = 2, kHeads = 4;

kv_cache_params window_params(const std::string& type, int window, int n_ctx, int n_ubatch) {
  kv_cache_params p;
  p.n_layer = 2;  // layer 0 windowed, layer 1 global
  p.n_kv_head = kKv;
  p.head_dim = kHd;
  p.n_ctx = n_ctx;
  p.type_k = p.type_v = parse_kv_cache_type(type);
  p.layers.resize(2);
  p.layers[0].window = window;
  p.n_ubatch = n_ubatch;
  return p;
}

std::vector<float> gauss(std::mt19937& rng, size_t n, float sd, float off = 0.0f) {
  std::normal_distribution<float> nd(off, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

// Appends n positions of k/v ([n, kKv, kHd]) in batches from `sizes` (cycled) to both layers of
// every cache and attends each batch's queries on layer il after it: out[c] holds every query's
// output of cache c, [n, kHeads, kHd].
std::vector<std::vector<float>> run_stream(std::vector<kv_cache*> caches, const std::vector<float>& k,
                                           const std::vector<float>& v, const std::vector<float>& q, int n,
                                           const std::vector<int>& sizes, int il, thread_pool& pool) {
  std::vector<std::vector<float>> out(caches.size(), std::vector<float>((size_t)n * kHeads * kHd));
  int at = 0;
  for (size_t b = 0; at < n; ++b) {
    const int nb = std::min(sizes[b % sizes.size()], n - at);
    for (size_t c = 0; c < caches.size(); ++c) {
      for (int l = 0; l < 2; ++l)
        caches[c]->append(l, 0, nb, &k[(size_t)at * kKv * kHd], &v[(size_t)at * kKv * kHd]);
      caches[c]->attend(il, 0, at, nb, kHeads, &q[(size_t)at * kHeads * kHd], 0.125f,
                        &out[c][(size_t)at * kHeads * kHd], pool);
    }
    at += nb;
  }
  return out;
}

// Ring vs keep-everything (n_ubatch >= n_ctx: no ring) with the same window, and both vs float64
// over the window, for dense and compressed types, windows {1, 17, 97} and an exact sink / recent
// window; the ring wraps many times (n_ubatch 8, 400 positions). The global layer is unaffected.
TEST(KvCacheWindow, RingEqualsFullCacheAndFloat64) {
  thread_pool pool(2);
  struct tcase {
    const char* type;
    int sink, recent;
    double tol;  // vs float64 (max-norm relative): the format's own error
  };
  const tcase cases[] = {{"f16", 0, 0, 1e-3}, {"f32", 0, 0, 1e-6}, {"q8", 0, 0, 0.015}, {"q4", 0, 0, 0.2},
                         {"q4", 4, 8, 0.2},   {"kivi4", 0, 0, 0.15}, {"kivi2", 2, 0, 0.4}};
  const int n = 400, n_ctx = 512;
  std::mt19937 rng(21);
  const auto k = gauss(rng, (size_t)n * kKv * kHd, 1.0f, 0.3f), v = gauss(rng, (size_t)n * kKv * kHd, 1.0f);
  const auto q = gauss(rng, (size_t)n * kHeads * kHd, 1.0f);
  for (const tcase& tc : cases)
    for (int w : {1, 17, 97}) {
      kv_cache_params pr = window_params(tc.type, w, n_ctx, 8), pf = window_params(tc.type, w, n_ctx, n_ctx);
      for (auto* p : {&pr, &pf}) {
        p->sink = tc.sink;
        p->exact_recent = tc.recent;
      }
      auto ring = make_kv_cache(pr), full = make_kv_cache(pf);
      EXPECT_LT(ring->bytes(), full->bytes()) << tc.type << " window " << w;
      for (int il : {0, 1}) {
        ring->clear(0);
        full->clear(0);
        const auto out = run_stream({ring.get(), full.get()}, k, v, q, n, {8, 1, 3, 7}, il, pool);
        const auto ref = attend_f64(k, v, q.data(), kKv, kHd, 0, n, kHeads, 0.125f, il == 0 ? w : 0);
        const std::string what = std::string(tc.type) + " sink " + std::to_string(tc.sink) + " recent " +
                                 std::to_string(tc.recent) + " window " + std::to_string(w) + " layer " +
                                 std::to_string(il);
        const double e = rel_err(out[0], ref);
        EXPECT_LE(rel_err(out[0], out[1]), 1e-5) << what << ": ring vs full";
        EXPECT_LE(e, tc.tol) << what << ": vs float64";
        if (il == 0) {  // the window matters: the output is much closer to windowed than to global attention
          const auto glob = attend_f64(k, v, q.data(), kKv, kHd, 0, n, kHeads, 0.125f, 0);
          EXPECT_LT(e, rel_err(out[0], glob)) << what;
          std::printf("[window] %s: vs float64 %.3g (vs global attention %.3g)\n", what.c_str(), e,
                      rel_err(out[0], glob));
        }
      }
    }
}

// Memory: a windowed layer's bytes are its ring's, whatever n_ctx; the global layer grows.
TEST(KvCacheWindow, WindowedLayerBytesDoNotGrowWithContext) {
  for (const char* type : {"f16", "q4", "kivi4", "q8"}) {
    kv_layer_kind_bytes prev;
    for (int n_ctx : {4096, 32768}) {
      kv_cache_params p = window_params(type, 512, n_ctx, 512);
      p.k_channel_scale = false;  // (its staging rows: a fixed 256 positions per layer, whatever n_ctx)
      const kv_layer_kind_bytes b = kv_bytes_by_layer_kind(p);
      EXPECT_EQ(b.n_global, 1);
      EXPECT_EQ(b.n_windowed, 1);
      EXPECT_EQ(b.global + b.windowed, kv_bytes_at_ctx(p)) << type;
      EXPECT_EQ(make_kv_cache(p)->bytes(), kv_bytes_at_ctx(p)) << type;
      if (n_ctx == 32768) {
        EXPECT_EQ(b.windowed, prev.windowed) << type;
        EXPECT_GT(b.global, 7 * prev.global) << type;
      }
      prev = b;
    }
  }
  // f16 exactly: 1023 positions (window - 1 + n_ubatch) x 2 kv heads x 64 x 2 bytes, K and V
  const kv_layer_kind_bytes f = kv_bytes_by_layer_kind(window_params("f16", 512, 32768, 512));
  EXPECT_EQ(f.windowed, (size_t)1023 * kKv * kHd * 2 * 2);
  EXPECT_EQ(f.global, (size_t)32768 * kKv * kHd * 2 * 2);
  // bytes/token counts the global layer only
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(window_params("f16", 512, 4096, 512)), (double)kKv * kHd * 2 * 2);
  // a window at least n_ctx - n_ubatch + 1 needs no ring: the layer keeps n_ctx positions
  const kv_layer_kind_bytes big = kv_bytes_by_layer_kind(window_params("f16", 4000, 4096, 512));
  EXPECT_EQ(big.windowed, big.global);
}

// attend_batch on a windowed layer equals attending each sequence alone.
TEST(KvCacheWindow, AttendBatchEqualsAlone) {
  thread_pool pool(2);
  std::mt19937 rng(22);
  for (const char* type : {"f16", "q4", "kivi4"}) {
    kv_cache_params p = window_params(type, 33, 256, 64);
    p.n_seq = 3;
    auto c = make_kv_cache(p);
    const int lens[3] = {200, 40, 129};
    for (int s = 0; s < 3; ++s) {
      const auto k = gauss(rng, (size_t)lens[s] * kKv * kHd, 1.0f), v = gauss(rng, (size_t)lens[s] * kKv * kHd, 1.0f);
      for (int at = 0; at < lens[s]; at += 64) {
        const int nb = std::min(64, lens[s] - at);
        for (int l = 0; l < 2; ++l) c->append(l, s, nb, &k[(size_t)at * kKv * kHd], &v[(size_t)at * kKv * kHd]);
      }
    }
    const auto q = gauss(rng, (size_t)3 * 3 * kHeads * kHd, 1.0f);
    std::vector<float> alone((size_t)9 * kHeads * kHd), batch(alone.size());
    std::vector<attend_seq> seqs;
    for (int s = 0; s < 3; ++s) {
      const size_t off = (size_t)s * 3 * kHeads * kHd;
      c->attend(0, s, lens[s] - 3, 3, kHeads, &q[off], 0.125f, &alone[off], pool);
      seqs.push_back(attend_seq{s, lens[s] - 3, 3, &q[off], &batch[off]});
    }
    c->attend_batch(0, seqs.data(), 3, kHeads, 0.125f, pool);
    EXPECT_LE(rel_err(batch, alone), 1e-6) << type;
  }
}

// The certified cache honours the window (it keeps every position in both tiers): bound >= error
// against float64 over the window, and tol 0 is exact.
TEST(KvCacheWindow, CertifiedHonoursWindow) {
  thread_pool pool(2);
  std::mt19937 rng(23);
  const int n = 150;
  auto f16r = [](std::vector<float> x) {
    for (auto& e : x) e = f16_to_f32(f32_to_f16(e));
    return x;
  };
  const auto k = f16r(gauss(rng, (size_t)n * kKv * kHd, 1.0f)), v = f16r(gauss(rng, (size_t)n * kKv * kHd, 1.0f, 1.0f));
  const auto q = gauss(rng, (size_t)5 * kHeads * kHd, 1.0f);
  for (double tol : {1e-2, 0.0}) {
    kv_cache_params p = window_params("certified", 17, 256, 64);
    p.certify = true;
    p.certify_tol = tol;
    auto c = make_kv_cache_certified(p);
    for (int l = 0; l < 2; ++l) c->append(l, 0, n, k.data(), v.data());
    std::vector<float> out((size_t)5 * kHeads * kHd);
    c->attend(0, 0, n - 5, 5, kHeads, q.data(), 0.125f, out.data(), pool);
    const auto ref = attend_f64(k, v, q.data(), kKv, kHd, n - 5, 5, kHeads, 0.125f, 17);
    const auto steps = c->last_steps();
    for (int i = 0; i < 5 * kHeads; ++i) {
      double e = 0;
      for (int x = 0; x < kHd; ++x) e += std::pow(out[(size_t)i * kHd + x] - ref[(size_t)i * kHd + x], 2);
      EXPECT_GE(steps[i].bound, std::sqrt(e)) << "tol " << tol << " query " << i;
      EXPECT_EQ(steps[i].n_keys, 17);
    }
    if (tol == 0.0) {
      EXPECT_LE(rel_err(out, ref), 1e-5);
    }
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvq::error& e) {
    return e.what();
  }
  return "";
}

TEST(KvCacheWindow, RefusalsNameTheField) {
  thread_pool pool(1);
  kv_cache_params p = window_params("f16", 0, 64, 8);
  p.layers.resize(3);
  EXPECT_NE(error_of([&] { make_kv_cache(p); }).find("[kv_cache] layers must be empty or hold n_layer 2"),
            std::string::npos);
  p.layers.resize(2);
  p.layers[0].window = -1;
  EXPECT_NE(error_of([&] { make_kv_cache(p); }).find("layers[0].window must be >= 0"), std::string::npos);
  p.layers[0].window = 0;
  p.layers[1].head_dim = 128;
  EXPECT_NE(error_of([&] { make_kv_cache(p); }).find("layers[1].n_kv_head 0 / head_dim 128"), std::string::npos);
  p.layers[1].head_dim = kHd;  // the cache-wide value: fine
  EXPECT_NO_THROW(make_kv_cache(p));
  p.n_ubatch = 0;
  EXPECT_NE(error_of([&] { make_kv_cache(p); }).find("n_ubatch must be >= 1"), std::string::npos);
  p.n_ubatch = 8;
  p.attn_softcap = -1.0f;
  EXPECT_NE(error_of([&] { make_kv_cache(p); }).find("attn_softcap"), std::string::npos);

  // an append larger than n_ubatch to a ring layer; truncation (and attention) past the ring
  std::mt19937 rng(24);
  for (const char* type : {"f16", "q4", "kivi4"}) {
    kv_cache_params pw = window_params(type, 16, 256, 8);
    pw.channel_calib = 8;  // (q4's K channel scale: else its first 256 positions are all kept exact)
    auto c = make_kv_cache(pw);
    const auto k = gauss(rng, (size_t)200 * kKv * kHd, 1.0f), v = gauss(rng, (size_t)200 * kKv * kHd, 1.0f);
    const std::string big = error_of([&] { c->append(0, 0, 9, k.data(), v.data()); });
    EXPECT_NE(big.find("9 tokens at once to layer 0 (sliding window 16), more than n_ubatch 8"), std::string::npos)
        << type << ": " << big;
    for (int at = 0; at < 200; at += 8)
      for (int l = 0; l < 2; ++l) c->append(l, 0, 8, &k[(size_t)at * kKv * kHd], &v[(size_t)at * kKv * kHd]);
    std::vector<float> q((size_t)kHeads * kHd, 0.5f), out(q.size());
    const bool kivi = std::string(type) == "kivi4";
    if (kivi) {  // keeping 100 needs rows 96..99 of a KIVI group (32 tokens) the ring overwrote
      const std::string tr = error_of([&] { c->truncate(0, 100); });
      EXPECT_NE(tr.find("[kv_cache] truncate: layer 0 (sliding window 16) of seq 0 no longer holds position 96"),
                std::string::npos)
          << tr;
      EXPECT_EQ(c->n_pos(0), 200);  // refused before anything changed
    }
    const int keep = kivi ? 96 : 100;
    c->truncate(0, keep);  // the ring (23 positions, or one 32-token unit) no longer reaches keep - 16
    const std::string att = error_of([&] { c->attend(0, 0, keep - 1, 1, kHeads, q.data(), 0.125f, out.data(), pool); });
    EXPECT_NE(att.find("attend: layer 0 (sliding window 16) of seq 0 no longer holds position " + std::to_string(keep - 16)),
              std::string::npos)
        << type << ": " << att;
    EXPECT_NO_THROW(c->attend(1, 0, keep - 1, 1, kHeads, q.data(), 0.125f, out.data(), pool));  // the global layer
    // appending again refills the window: attention works once it holds the window's positions
    c->truncate(0, 0);
    for (int at = 0; at < 40; at += 8)
      for (int l = 0; l < 2; ++l) c->append(l, 0, 8, &k[(size_t)at * kKv * kHd], &v[(size_t)at * kKv * kHd]);
    EXPECT_NO_THROW(c->attend(0, 0, 39, 1, kHeads, q.data(), 0.125f, out.data(), pool)) << type;
  }
}

}  // namespace
}  // namespace kvq
