// llama / mistral / qwen2 / qwen3 forward passes on tiny random GGUF models written by the test,
// checked against an independent float64 reference of the same architecture; and load errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "kvq/error.h"
#include "kvq/model.h"
#include "kvq/gguf_writer.h"
#include "support/forward_logits.h"

namespace kvq {
namespace {

using test::forward_logits;
using test::max_abs_diff;
using test::max_diff;

struct tiny_cfg {
  std::string arch = "llama";
  int n_vocab = 40, n_embd = 32, n_layer = 2, n_head = 4, n_kv_head = 2, head_dim = 8, n_ff = 48;
  int n_rot = 8;
  bool tied = false;
  float base = 10000.0f;
};

struct tiny_weights {
  std::map<std::string, std::vector<float>> t;
};

std::vector<float> rnd(std::mt19937& g, size_t n, float scale, float offset = 0) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + scale * d(g);
  return v;
}

// Writes the model and returns its weights (as f32 values) for the reference.
tiny_weights write_tiny(const tiny_cfg& c, const std::string& path) {
  std::mt19937 g(1234);
  tiny_weights w;
  gguf_writer wr;
  const std::string a = c.arch + ".";
  wr.set_str("general.architecture", c.arch);
  wr.set_u32(a + "context_length", 256);
  wr.set_u32(a + "embedding_length", c.n_embd);
  wr.set_u32(a + "block_count", c.n_layer);
  wr.set_u32(a + "feed_forward_length", c.n_ff);
  wr.set_u32(a + "attention.head_count", c.n_head);
  wr.set_u32(a + "attention.head_count_kv", c.n_kv_head);
  wr.set_u32(a + "attention.key_length", c.head_dim);
  wr.set_u32(a + "attention.value_length", c.head_dim);
  wr.set_u32(a + "rope.dimension_count", c.n_rot);
  wr.set_f32(a + "rope.freq_base", c.base);
  wr.set_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  auto add = [&](const std::string& name, std::vector<int64_t> ne, float scale, float offset = 0) {
    size_t n = 1;
    for (auto e : ne) n *= e;
    w.t[name] = rnd(g, n, scale, offset);
    wr.add_tensor_f32(name, ne, w.t[name]);
  };
  const int dq = c.n_head * c.head_dim, dkv = c.n_kv_head * c.head_dim;
  add("token_embd.weight", {c.n_embd, c.n_vocab}, 1.0f);
  add("output_norm.weight", {c.n_embd}, 0.1f, 1.0f);
  if (!c.tied) add("output.weight", {c.n_embd, c.n_vocab}, 0.2f);
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    add(b + "attn_norm.weight", {c.n_embd}, 0.1f, 1.0f);
    add(b + "ffn_norm.weight", {c.n_embd}, 0.1f, 1.0f);
    add(b + "attn_q.weight", {c.n_embd, dq}, 0.3f);
    add(b + "attn_k.weight", {c.n_embd, dkv}, 0.3f);
    add(b + "attn_v.weight", {c.n_embd, dkv}, 0.3f);
    add(b + "attn_output.weight", {dq, c.n_embd}, 0.2f);
    add(b + "ffn_gate.weight", {c.n_embd, c.n_ff}, 0.2f);
    add(b + "ffn_up.weight", {c.n_embd, c.n_ff}, 0.2f);
    add(b + "ffn_down.weight", {c.n_ff, c.n_embd}, 0.2f);
    if (c.arch == "qwen2") {
      add(b + "attn_q.bias", {dq}, 0.5f);
      add(b + "attn_k.bias", {dkv}, 0.5f);
      add(b + "attn_v.bias", {dkv}, 0.5f);
    }
    if (c.arch == "qwen3") {
      add(b + "attn_q_norm.weight", {c.head_dim}, 0.2f, 1.0f);
      add(b + "attn_k_norm.weight", {c.head_dim}, 0.2f, 1.0f);
    }
  }
  wr.write(path);
  return w;
}

// Float64 reference forward (all logits), written independently of src/model.
std::vector<double> reference_logits(const tiny_cfg& c, tiny_weights& w, const std::vector<int32_t>& toks) {
  const int n = (int)toks.size(), E = c.n_embd, D = c.head_dim, H = c.n_head, KV = c.n_kv_head;
  const bool neox = c.arch == "qwen2" || c.arch == "qwen3";
  auto W = [&](const std::string& name) -> const std::vector<float>& { return w.t.at(name); };
  auto rms = [&](std::vector<double> x, const std::vector<float>& g) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / x.size() + 1e-6);
    for (size_t i = 0; i < x.size(); ++i) x[i] *= r * g[i];
    return x;
  };
  auto mv = [&](const std::vector<float>& m, const std::vector<double>& x, int n_out) {
    std::vector<double> y(n_out, 0.0);
    for (int r = 0; r < n_out; ++r)
      for (size_t i = 0; i < x.size(); ++i) y[r] += (double)m[r * x.size() + i] * x[i];
    return y;
  };
  auto rope = [&](double* x, int pos) {
    for (int i = 0; i < c.n_rot / 2; ++i) {
      const double th = pos * std::pow((double)c.base, -2.0 * i / c.n_rot);
      const int p0 = neox ? i : 2 * i, p1 = neox ? i + c.n_rot / 2 : 2 * i + 1;
      const double a = x[p0], b = x[p1];
      x[p0] = a * std::cos(th) - b * std::sin(th);
      x[p1] = a * std::sin(th) + b * std::cos(th);
    }
  };
  std::vector<std::vector<double>> xs(n, std::vector<double>(E));
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < E; ++i) xs[t][i] = W("token_embd.weight")[toks[t] * E + i];
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (int t = 0; t < n; ++t) {
      auto h = rms(xs[t], W(b + "attn_norm.weight"));
      q[t] = mv(W(b + "attn_q.weight"), h, H * D);
      k[t] = mv(W(b + "attn_k.weight"), h, KV * D);
      v[t] = mv(W(b + "attn_v.weight"), h, KV * D);
      if (c.arch == "qwen2") {
        for (int i = 0; i < H * D; ++i) q[t][i] += W(b + "attn_q.bias")[i];
        for (int i = 0; i < KV * D; ++i) k[t][i] += W(b + "attn_k.bias")[i], v[t][i] += W(b + "attn_v.bias")[i];
      }
      // per head: RMSNorm (qwen3's q/k norm), then RoPE
      auto norm_rope = [&](std::vector<double>& x, int n_heads, const std::string& norm) {
        for (int hh = 0; hh < n_heads; ++hh) {
          if (c.arch == "qwen3") {
            std::vector<double> s(x.begin() + hh * D, x.begin() + (hh + 1) * D);
            s = rms(s, W(b + norm));
            std::copy(s.begin(), s.end(), x.begin() + hh * D);
          }
          rope(&x[hh * D], t);
        }
      };
      norm_rope(q[t], H, "attn_q_norm.weight");
      norm_rope(k[t], KV, "attn_k_norm.weight");
    }
    for (int t = 0; t < n; ++t) {
      std::vector<double> att(H * D, 0.0);
      for (int hh = 0; hh < H; ++hh) {
        const int kh = hh / (H / KV);
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double d = 0;
          for (int i = 0; i < D; ++i) d += q[t][hh * D + i] * k[j][kh * D + i];
          s[j] = d / std::sqrt((double)D);
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (auto& x : s) z += x = std::exp(x - mx);
        for (int j = 0; j <= t; ++j)
          for (int i = 0; i < D; ++i) att[hh * D + i] += s[j] / z * v[j][kh * D + i];
      }
      auto o = mv(W(b + "attn_output.weight"), att, E);
      for (int i = 0; i < E; ++i) xs[t][i] += o[i];
      auto h = rms(xs[t], W(b + "ffn_norm.weight"));
      auto gt = mv(W(b + "ffn_gate.weight"), h, c.n_ff), up = mv(W(b + "ffn_up.weight"), h, c.n_ff);
      for (int i = 0; i < c.n_ff; ++i) gt[i] = gt[i] / (1 + std::exp(-gt[i])) * up[i];
      auto d = mv(W(b + "ffn_down.weight"), gt, E);
      for (int i = 0; i < E; ++i) xs[t][i] += d[i];
    }
  }
  std::vector<double> out;
  const auto& ow = c.tied ? W("token_embd.weight") : W("output.weight");
  for (int t = 0; t < n; ++t) {
    auto y = mv(ow, rms(xs[t], W("output_norm.weight")), c.n_vocab);
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvq_test_" + name + ".gguf")).string();
}

class ArchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ArchTest, ForwardMatchesFloat64Reference) {
  tiny_cfg c;
  c.arch = GetParam();
  c.tied = c.arch == "qwen3";  // exercise both output layouts
  if (c.arch == "mistral") c.n_rot = 4;  // partial rotary
  const std::string path = tmp_path(c.arch);
  tiny_weights w = write_tiny(c, path);
  auto m = model::load(path);
  const model_hparams& hp = m->hparams();
  EXPECT_EQ(hp.arch, c.arch);
  EXPECT_EQ(hp.n_head, c.n_head);
  EXPECT_EQ(hp.n_kv_head, c.n_kv_head);
  EXPECT_EQ(hp.head_dim, c.head_dim);
  EXPECT_EQ(hp.n_vocab, c.n_vocab);
  EXPECT_EQ(hp.tied_output, c.tied);
  EXPECT_EQ(hp.qkv_bias, c.arch == "qwen2");
  EXPECT_EQ(hp.qk_norm, c.arch == "qwen3");
  EXPECT_EQ(hp.rope, (c.arch == "qwen2" || c.arch == "qwen3") ? rope_type::neox : rope_type::norm);

  const std::vector<int32_t> toks = {3, 17, 5, 39, 0, 22, 8};
  const auto ref = reference_logits(c, w, toks);
  // Prefill in two batches (4 + 3) with all logits: exercises batching and the cache.
  kv_cache_params cp = m->cache_params(64);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(2);
  const max_diff d = max_abs_diff(ref, forward_logits(*m, *cache, pool, toks, {4, 3}));
  EXPECT_LT(d.err, 2e-4 * std::max(1.0, d.ref)) << c.arch << ": max |dlogit| " << d.err;
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Archs, ArchTest, ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

// A batch holding several sequences (prefill of different lengths, then one decode token each in
// another order) gives every sequence the float64 logits of that sequence alone.
TEST(ModelForward, BatchOfSequencesMatchesEachAloneInFloat64) {
  tiny_cfg c;
  c.arch = "qwen2";
  const std::string path = tmp_path("batch");
  tiny_weights w = write_tiny(c, path);
  auto m = model::load(path);
  const std::vector<std::vector<int32_t>> seqs = {{3, 17, 5, 39, 0, 22}, {8, 1, 30}, {12}};
  const std::vector<int32_t> next = {7, 25, 2};  // decode tokens of sequences 0, 1, 2
  kv_cache_params cp = m->cache_params(32, {}, 3);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(2);
  // Prefill: sequence 1, then 0, then 2; logits of every token.
  std::vector<int32_t> tok, pos, sid;
  for (int s : {1, 0, 2})
    for (size_t t = 0; t < seqs[s].size(); ++t) tok.push_back(seqs[s][t]), pos.push_back((int)t), sid.push_back(s);
  std::vector<uint8_t> out(tok.size(), 1);
  std::vector<float> logits(tok.size() * c.n_vocab);
  ASSERT_EQ(m->forward(model_batch{tok, pos, sid, out}, *cache, pool, logits.data()), (int)tok.size());
  auto expect_rows = [&](int s, const std::vector<int32_t>& ids, int first_pos, const float* got, int n_rows) {
    const auto ref = reference_logits(c, w, ids);
    double max_err = 0, max_ref = 0;
    for (int r = 0; r < n_rows; ++r)
      for (int i = 0; i < c.n_vocab; ++i) {
        const double want = ref[(size_t)(first_pos + r) * c.n_vocab + i];
        max_err = std::max(max_err, std::fabs(want - got[(size_t)r * c.n_vocab + i]));
        max_ref = std::max(max_ref, std::fabs(want));
      }
    EXPECT_LT(max_err, 2e-4 * std::max(1.0, max_ref)) << "sequence " << s << ": max |dlogit| " << max_err;
  };
  int row = 0;
  for (int s : {1, 0, 2}) {
    expect_rows(s, seqs[s], 0, &logits[(size_t)row * c.n_vocab], (int)seqs[s].size());
    row += (int)seqs[s].size();
  }
  for (int s = 0; s < 3; ++s) EXPECT_EQ(cache->n_pos(s), (int)seqs[s].size());
  // Decode one token each, in the order 2, 0, 1; default outputs (the last token of each sequence).
  tok.clear(), pos.clear(), sid.clear();
  for (int s : {2, 0, 1}) tok.push_back(next[s]), pos.push_back((int)seqs[s].size()), sid.push_back(s);
  ASSERT_EQ(m->forward(model_batch{tok, pos, sid, {}}, *cache, pool, logits.data()), 3);
  row = 0;
  for (int s : {2, 0, 1}) {
    std::vector<int32_t> ids = seqs[s];
    ids.push_back(next[s]);
    expect_rows(s, ids, (int)seqs[s].size(), &logits[(size_t)row++ * c.n_vocab], 1);
  }
  std::filesystem::remove(path);
}

// Malformed batches are refused before anything is appended to the cache.
TEST(ModelForward, BadBatchesAreRefusedBeforeAppending) {
  tiny_cfg c;
  const std::string path = tmp_path("badbatch");
  write_tiny(c, path);
  auto m = model::load(path);
  kv_cache_params cp = m->cache_params(8, {}, 2);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(1);
  std::vector<float> logits(8 * c.n_vocab);
  auto expect_refused = [&](std::vector<int32_t> tok, std::vector<int32_t> pos, std::vector<int32_t> sid,
                            std::vector<uint8_t> out, const std::string& needle) {
    try {
      m->forward(model_batch{tok, pos, sid, out}, *cache, pool, logits.data());
      ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const kvq::error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(e.code(), errc::invalid_input) << e.what();
    }
    EXPECT_EQ(cache->n_pos(0), 0);
    EXPECT_EQ(cache->n_pos(1), 0);
  };
  expect_refused({}, {}, {}, {}, "no tokens");
  expect_refused({1, 2}, {0}, {0, 0}, {}, "1 positions");
  expect_refused({1, 2}, {0, 1}, {0, 0}, {1}, "1 output flags");
  expect_refused({1, c.n_vocab}, {0, 1}, {0, 0}, {}, "token id 40");
  expect_refused({1, 2}, {0, 1}, {0, 2}, {}, "sequence id 2");
  expect_refused({1, 2}, {0, 2}, {0, 0}, {}, "consecutive positions");
  expect_refused({1, 2, 3}, {0, 0, 1}, {0, 1, 0}, {}, "two runs");
  expect_refused({1}, {1}, {1}, {}, "batch starts at position 1");
  expect_refused({1, 2, 3, 4, 5, 6, 7, 8, 9}, {0, 1, 2, 3, 4, 5, 6, 7, 8}, {0, 0, 0, 0, 0, 0, 0, 0, 0}, {},
                 "more than the cache's n_ctx 8");
  std::filesystem::remove(path);
}

void expect_load_error(const std::string& path, const std::string& needle) {
  try {
    model::load(path);
    FAIL() << "expected a load error containing '" << needle << "'";
  } catch (const kvq::error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(e.code(), errc::internal);
  }
}

TEST(ModelLoad, Errors) {
  tiny_cfg c;
  const std::string path = tmp_path("errors");
  {  // unsupported architecture
    gguf_writer wr;
    wr.set_str("general.architecture", "mamba");
    wr.write(path);
    expect_load_error(path, "mamba");
  }
  // a llama header with shapes and no tensors, plus head_count_kv when > 0
  auto header_only = [&](int head_count_kv) {
    gguf_writer wr;
    wr.set_str("general.architecture", "llama");
    wr.set_u32("llama.embedding_length", 32);
    wr.set_u32("llama.block_count", 1);
    wr.set_u32("llama.feed_forward_length", 48);
    wr.set_u32("llama.attention.head_count", 4);
    if (head_count_kv > 0) wr.set_u32("llama.attention.head_count_kv", head_count_kv);
    wr.write(path);
  };
  header_only(0);  // missing tensor
  expect_load_error(path, "token_embd.weight");
  header_only(3);  // head_count not a multiple of head_count_kv
  expect_load_error(path, "head_count_kv");
  {  // wrong shape of a weight
    tiny_cfg bad = c;
    write_tiny(bad, path);
    // Rewrite with attn_q of the wrong width by changing the declared head count.
    gguf_writer wr;
    std::mt19937 g(1);
    wr.set_str("general.architecture", "llama");
    wr.set_u32("llama.embedding_length", 32);
    wr.set_u32("llama.block_count", 1);
    wr.set_u32("llama.feed_forward_length", 48);
    wr.set_u32("llama.attention.head_count", 4);
    wr.add_tensor_f32("token_embd.weight", {32, 40}, rnd(g, 32 * 40, 1));
    wr.add_tensor_f32("output_norm.weight", {32}, rnd(g, 32, 1));
    wr.add_tensor_f32("blk.0.attn_norm.weight", {32}, rnd(g, 32, 1));
    wr.add_tensor_f32("blk.0.ffn_norm.weight", {32}, rnd(g, 32, 1));
    wr.add_tensor_f32("blk.0.attn_q.weight", {32, 16}, rnd(g, 32 * 16, 1));
    wr.write(path);
    expect_load_error(path, "attn_q.weight");
  }
  std::filesystem::remove(path);
  expect_load_error("/nonexistent/model.gguf", "/nonexistent/model.gguf");
}

TEST(ModelForward, RejectsBadTokensAndPositions) {
  tiny_cfg c;
  const std::string path = tmp_path("badtok");
  write_tiny(c, path);
  auto m = model::load(path);
  kv_cache_params cp = m->cache_params(16);
  cp.type_k = cp.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(cp);
  thread_pool pool(1);
  std::vector<float> logits(c.n_vocab);
  const int32_t bad[] = {c.n_vocab};
  EXPECT_THROW(m->forward(bad, 0, 0, *cache, pool, logits.data(), false), kvq::error);
  const int32_t ok[] = {1};
  EXPECT_THROW(m->forward(ok, 5, 0, *cache, pool, logits.data(), false), kvq::error);  // cache holds 0
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvq
