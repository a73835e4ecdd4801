// kvq kv-error: per-head attention-output error and attention-probability TV distance, checked
// against a float64 attention computed here from the same captured Q/K/V.
#include <gtest/gtest.h>

#include <cmath>

#include "kvq/error.h"
#include "kvq/f16.h"
#include "kvq/kv_error.h"
#include "kvq/perplexity.h"
#include "support/data_dir.h"
#include "support/model_text.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

kv_cache_params fmt(const std::string& k, const std::string& v) {
  kv_cache_params c;
  c.type_k = parse_kv_cache_type(k);
  c.type_v = parse_kv_cache_type(v, "V");
  c.channel_calib = 8;  // (the default 256 would keep these short texts in the exact staging rows)
  return c;
}

// Float64 causal attention of one head; kq: K as the cache stores it (rounded or not).
void attend64(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, int n, int H,
              int G, int D, int h, int t, double scale, std::vector<double>& p, std::vector<double>& o) {
  const int g = h / (H / G);
  p.assign(t + 1, 0.0);
  double mx = -1e300;
  for (int j = 0; j <= t; ++j) {
    double s = 0;
    for (int d = 0; d < D; ++d) s += (double)q[((size_t)t * H + h) * D + d] * k[((size_t)j * G + g) * D + d];
    p[j] = s * scale;
    mx = std::max(mx, p[j]);
  }
  double z = 0;
  for (int j = 0; j <= t; ++j) z += (p[j] = std::exp(p[j] - mx));
  o.assign(D, 0.0);
  for (int j = 0; j <= t; ++j) {
    p[j] /= z;
    for (int d = 0; d < D; ++d) o[d] += p[j] * v[((size_t)j * G + g) * D + d];
  }
}

TEST(KvError, F16EqualsFloat64ReferenceAndF32IsExact) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(tp, "data/tinystories-val-794k/tinystories_val.txt");
  test::model_text s = test::load_model_text(mp, tp);
  const auto& hp = s.m->hparams();
  const int n = 48, L = hp.n_layer, H = hp.n_head, G = hp.n_kv_head, D = hp.head_dim;

  kv_error_params p;
  p.n_ctx = n;
  p.n_threads = 2;
  p.formats = {fmt("f32", "f32"), fmt("f16", "f16"), fmt("q8", "q8"), fmt("q2", "q2")};
  const kv_error_result r = kv_error(*s.m, s.ids, perplexity_bos(*s.tok), p);
  ASSERT_EQ(r.formats.size(), 4u);
  EXPECT_EQ(r.n_queries, n);
  EXPECT_EQ(r.formats[0].max_rel_err, 0.0);  // the same kernel on the same data
  EXPECT_EQ(r.formats[0].max_tv, 0.0);

  // Capture Q/K/V independently (f32 cache) and compute the f16 errors in float64.
  std::vector<std::vector<float>> cq(L), ck(L), cv(L);
  s.m->set_attn_observer([&](int il, int, int nt, const float* q, const float* k, const float* v) {
    cq[il].assign(q, q + (size_t)nt * H * D);
    ck[il].assign(k, k + (size_t)nt * G * D);
    cv[il].assign(v, v + (size_t)nt * G * D);
  });
  std::vector<int32_t> chunk(s.ids.begin(), s.ids.begin() + n);
  chunk[0] = s.tok->bos();
  auto cp = s.m->cache_params(n);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(2);
  std::vector<float> logits(hp.n_vocab);
  s.m->forward(chunk, 0, 0, *cache, pool, logits.data(), false);
  s.m->set_attn_observer({});

  const kv_error_format& f16 = r.formats[1];
  std::vector<double> p32, p16, o32, o16;
  for (int il = 0; il < L; ++il) {
    std::vector<float> k16 = ck[il], v16 = cv[il];
    for (auto& x : k16) x = f16_to_f32(f32_to_f16(x));
    for (auto& x : v16) x = f16_to_f32(f32_to_f16(x));
    for (int h = 0; h < H; ++h) {
      double e2 = 0, r2 = 0, tv = 0;
      for (int t = 0; t < n; ++t) {
        attend64(cq[il], ck[il], cv[il], n, H, G, D, h, t, hp.attn_scale, p32, o32);
        attend64(cq[il], k16, v16, n, H, G, D, h, t, hp.attn_scale, p16, o16);
        for (int d = 0; d < D; ++d) {
          e2 += (o16[d] - o32[d]) * (o16[d] - o32[d]);
          r2 += o32[d] * o32[d];
        }
        double s1 = 0;
        for (int j = 0; j <= t; ++j) s1 += std::fabs(p16[j] - p32[j]);
        tv += 0.5 * s1 / n;
      }
      const double rel = std::sqrt(e2 / r2);
      ASSERT_GT(rel, 0.0);
      EXPECT_NEAR(f16.rel_err[(size_t)il * H + h], rel, 0.02 * rel + 1e-6) << "layer " << il << " head " << h;
      EXPECT_NEAR(f16.tv[(size_t)il * H + h], tv, 0.02 * tv + 1e-6) << "layer " << il << " head " << h;
    }
  }
  // Aggregates are the means/maxima of the per-head values.
  double mean = 0;
  for (double x : f16.rel_err) mean += x / f16.rel_err.size();
  EXPECT_NEAR(f16.mean_rel_err, mean, 1e-12);
  EXPECT_EQ(f16.worst.size(), 5u);
  EXPECT_EQ(f16.worst[0].rel_err, f16.max_rel_err);
  // Fewer bits, more error: q2 well above q8, q8 above f16 (measured, not assumed equal).
  EXPECT_GT(r.formats[3].mean_rel_err, 4 * r.formats[2].mean_rel_err);
  EXPECT_GT(r.formats[2].mean_rel_err, f16.mean_rel_err);
  EXPECT_GT(r.formats[3].mean_tv, r.formats[2].mean_tv);
}

TEST(KvError, BadInput) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(tp, "data/tinystories-val-794k/tinystories_val.txt");
  test::model_text s = test::load_model_text(mp, tp);
  auto msg = [&](kv_error_params p, std::span<const int32_t> ids) -> std::string {
    try {
      kv_error(*s.m, ids, 1, p);
    } catch (const error& e) {
      return e.what();
    }
    return "";
  };
  kv_error_params p;
  p.n_ctx = 32;
  EXPECT_NE(msg(p, s.ids).find("no KV formats"), std::string::npos);
  try {
    fmt("q4", "nope");  // names are parsed at the edge
    ADD_FAILURE() << "no error for 'nope'";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown V cache type 'nope'"), std::string::npos) << e.what();
  }
  p.formats = {fmt("q4", "q4")};
  p.formats[0].type_v = (kv_cache_type)200;
  EXPECT_NE(msg(p, s.ids).find("type_v 200"), std::string::npos);
  p.formats = {fmt("q4", "q4")};
  EXPECT_NE(msg(p, std::span<const int32_t>(s.ids.data(), 10)).find("fewer than one chunk"), std::string::npos);
  p.n_ctx = s.m->hparams().n_ctx_train + 1;
  EXPECT_NE(msg(p, s.ids).find("model's context"), std::string::npos);
  // The same checks without any text; their messages name kv_error, not perplexity.
  std::string e;
  try {
    kv_error_check(*s.m, p);
  } catch (const error& x) {
    e = x.what();
  }
  EXPECT_EQ(e.rfind("[kv_error] context size -c", 0), 0u) << e;
}

// With tv off the result says so (has_tv), and rel_err is unchanged by it.
TEST(KvError, NoTvIsMarkedAndLeavesRelErrUnchanged) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(tp, "data/tinystories-val-794k/tinystories_val.txt");
  test::model_text s = test::load_model_text(mp, tp);
  kv_error_params p;
  p.n_ctx = 32;
  p.n_threads = 1;
  p.formats = {fmt("q4", "q4")};
  const kv_error_result with = kv_error(*s.m, s.ids, perplexity_bos(*s.tok), p);
  p.tv = false;
  const kv_error_result without = kv_error(*s.m, s.ids, perplexity_bos(*s.tok), p);
  EXPECT_TRUE(with.has_tv);
  EXPECT_FALSE(without.has_tv);
  EXPECT_GT(with.formats[0].mean_tv, 0.0);
  EXPECT_EQ(without.formats[0].rel_err, with.formats[0].rel_err);
}

// --plot into a missing directory is refused before the (long) run, naming the flag and the directory
// (it used to fail after the run, on the plotter's temp file: "[io] cannot open '...p.png.tmp.json.tmp'").
TEST(KvError, CliRefusesAPlotIntoAMissingDirectoryUpFront) {
  KVQ_REQUIRE_DATA(mp, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(tp, "data/tinystories-val-794k/tinystories_val.txt");
  const std::string dir = "/nonexistent_kvq_test_dir/sub";
  const auto r = test::run_cmd({test::kvq_bin(), "kv-error", "-m", mp, "-f", tp, "-c", "32", "--types", "q4", "--plot",
                                dir + "/p.png", "--no-progress"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(r.err.rfind("error: [kv_error] --plot '" + dir + "/p.png'", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("directory '" + dir + "' does not exist"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
}

}  // namespace
}  // namespace kvq
