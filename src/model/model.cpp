#include "kvq/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvq/error.h"
#include "kvq/f16.h"
#include "model/ops.h"

namespace kvq {

struct model::layer {
  std::vector<float> attn_norm, ffn_norm;   // [n_embd]
  std::vector<float> q_norm, k_norm;        // [head_dim] (qwen3)
  std::vector<float> bq, bk, bv;            // [n_head*head_dim], [n_kv_head*head_dim] (qwen2)
  weight_view wq, wk, wv, wo, w_gate, w_up, w_down;
};

// Activations for one forward pass, grown to the largest batch seen (no allocation once warm).
struct model::scratch {
  int64_t cap = 0;
  std::vector<float> x, h, q, k, v, attn, o, gate, up, act;
  void reserve(int64_t n, const model_hparams& hp) {
    if (n <= cap) return;
    cap = n;
    x.resize(n * hp.n_embd);
    h.resize(n * hp.n_embd);
    q.resize(n * hp.n_head * hp.head_dim);
    k.resize(n * hp.n_kv_head * hp.head_dim);
    v.resize(n * hp.n_kv_head * hp.head_dim);
    attn.resize(n * hp.n_head * hp.head_dim);
    o.resize(n * hp.n_embd);
    gate.resize(n * hp.n_ff);
    up.resize(n * hp.n_ff);
    act.resize(n * hp.n_ff);
  }
};

model::~model() = default;

std::vector<std::string> supported_architectures() { return {"llama", "mistral", "qwen2", "qwen3"}; }

namespace {

// Reads a 1-D f32/f16/bf16 vector tensor of exactly n elements.
std::vector<float> load_vector(const gguf_file& f, const std::string& name, int64_t n) {
  const gguf_tensor_info& t = f.tensor(name);
  if (t.n_elements() != n)
    fail_input("[model] " + f.path() + ": tensor '" + name + "' has " + std::to_string(t.n_elements()) +
               " elements, expected " + std::to_string(n));
  std::vector<float> out(n);
  switch (t.type) {
    case ggml_type::f32: std::memcpy(out.data(), t.data, n * 4); break;
    case ggml_type::f16:
      for (int64_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); out[i] = f16_to_f32(h); }
      break;
    case ggml_type::bf16:
      for (int64_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); out[i] = bf16_to_f32(h); }
      break;
    default:
      fail_unsupported("[model] " + f.path() + ": tensor '" + name + "' has type " + ggml_type_name(t.type) +
                       "; norm and bias vectors must be f32, f16 or bf16");
  }
  return out;
}

weight_view load_matrix(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out) {
  const gguf_tensor_info& t = f.tensor(name);
  weight_view w = make_weight_view(t);
  if (w.n_in != n_in || w.n_out != n_out)
    fail_input("[model] " + f.path() + ": tensor '" + name + "' has shape [" + std::to_string(w.n_in) + ", " +
               std::to_string(w.n_out) + "], expected [" + std::to_string(n_in) + ", " + std::to_string(n_out) + "]");
  return w;
}

int positive_int(const gguf_file& f, const std::string& key, int64_t v) {
  if (v <= 0 || v > (1 << 30))
    fail_input("[model] " + f.path() + ": metadata '" + key + "' = " + std::to_string(v) + " is out of range");
  return (int)v;
}

}  // namespace

std::unique_ptr<model> model::load(const std::string& path) {
  std::unique_ptr<model> m(new model());
  m->file_ = gguf_file::open(path);
  const gguf_file& f = *m->file_;
  model_hparams& hp = m->hp_;

  hp.arch = f.get_string("general.architecture");
  const auto archs = supported_architectures();
  if (std::find(archs.begin(), archs.end(), hp.arch) == archs.end())
    fail_unsupported("[model] " + path + ": general.architecture '" + hp.arch +
                     "' is not supported (supported: llama, mistral, qwen2, qwen3)");
  hp.name = f.try_string("general.name").value_or("");
  const std::string a = hp.arch + ".";
  hp.n_embd = positive_int(f, a + "embedding_length", f.get_int(a + "embedding_length"));
  hp.n_layer = positive_int(f, a + "block_count", f.get_int(a + "block_count"));
  hp.n_head = positive_int(f, a + "attention.head_count", f.get_int(a + "attention.head_count"));
  hp.n_kv_head = positive_int(f, a + "attention.head_count_kv",
                              f.try_int(a + "attention.head_count_kv").value_or(hp.n_head));
  hp.n_ff = positive_int(f, a + "feed_forward_length", f.get_int(a + "feed_forward_length"));
  hp.n_ctx_train = positive_int(f, a + "context_length", f.try_int(a + "context_length").value_or(2048));
  if (hp.n_head % hp.n_kv_head != 0)
    fail_input("[model] " + path + ": attention.head_count " + std::to_string(hp.n_head) +
               " is not a multiple of attention.head_count_kv " + std::to_string(hp.n_kv_head));
  if (!f.has(a + "attention.key_length") && hp.n_embd % hp.n_head != 0)
    fail_input("[model] " + path + ": embedding_length " + std::to_string(hp.n_embd) +
               " is not a multiple of attention.head_count " + std::to_string(hp.n_head));
  hp.head_dim = positive_int(f, a + "attention.key_length",
                             f.try_int(a + "attention.key_length").value_or(hp.n_embd / hp.n_head));
  const int64_t v_len = f.try_int(a + "attention.value_length").value_or(hp.head_dim);
  if (v_len != hp.head_dim)
    fail_unsupported("[model] " + path + ": attention.value_length " + std::to_string(v_len) +
                     " differs from key_length " + std::to_string(hp.head_dim) + " (not supported)");
  hp.n_rot = positive_int(f, a + "rope.dimension_count", f.try_int(a + "rope.dimension_count").value_or(hp.head_dim));
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0)
    fail_input("[model] " + path + ": rope.dimension_count " + std::to_string(hp.n_rot) +
               " must be even and <= head_dim " + std::to_string(hp.head_dim));
  hp.rope_freq_base = (float)f.try_float(a + "rope.freq_base").value_or(10000.0);
  if (!(hp.rope_freq_base > 0))
    fail_input("[model] " + path + ": rope.freq_base " + std::to_string(hp.rope_freq_base) + " must be > 0");
  if (auto st = f.try_string(a + "rope.scaling.type"); st && *st != "none") {
    if (*st != "linear")
      fail_unsupported("[model] " + path + ": rope.scaling.type '" + *st + "' is not supported (supported: none, linear)");
    const double factor = f.try_float(a + "rope.scaling.factor").value_or(1.0);
    if (!(factor > 0)) fail_input("[model] " + path + ": rope.scaling.factor " + std::to_string(factor) + " must be > 0");
    hp.rope_freq_scale = (float)(1.0 / factor);
  }
  // llama.cpp: llama/mistral use the NORM ordering, qwen2/qwen3 NEOX.
  hp.rope = (hp.arch == "qwen2" || hp.arch == "qwen3") ? rope_type::neox : rope_type::norm;
  hp.rms_eps = (float)f.try_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5);
  hp.attn_scale = (float)f.try_float(a + "attention.scale").value_or(1.0 / std::sqrt((double)hp.head_dim));
  hp.qkv_bias = hp.arch == "qwen2";
  hp.qk_norm = hp.arch == "qwen3";

  const gguf_tensor_info& emb = f.tensor("token_embd.weight");
  if (emb.ne.size() != 2 || emb.ne[0] != hp.n_embd)
    fail_input("[model] " + path + ": tensor 'token_embd.weight' must be [" + std::to_string(hp.n_embd) + ", n_vocab]");
  hp.n_vocab = (int)emb.ne[1];
  if (auto nv = f.try_int(a + "vocab_size"); nv && *nv != hp.n_vocab)
    fail_input("[model] " + path + ": " + a + "vocab_size " + std::to_string(*nv) +
               " differs from token_embd.weight rows " + std::to_string(hp.n_vocab));
  m->tok_embd_ = make_weight_view(emb);
  m->output_norm_ = load_vector(f, "output_norm.weight", hp.n_embd);
  if (f.find_tensor("output.weight")) {
    m->output_ = load_matrix(f, "output.weight", hp.n_embd, hp.n_vocab);
  } else {
    hp.tied_output = true;
    m->output_ = m->tok_embd_;
  }

  const int64_t dq = (int64_t)hp.n_head * hp.head_dim, dkv = (int64_t)hp.n_kv_head * hp.head_dim;
  m->layers_.resize(hp.n_layer);
  for (int il = 0; il < hp.n_layer; ++il) {
    layer& L = m->layers_[il];
    const std::string b = "blk." + std::to_string(il) + ".";
    L.attn_norm = load_vector(f, b + "attn_norm.weight", hp.n_embd);
    L.ffn_norm = load_vector(f, b + "ffn_norm.weight", hp.n_embd);
    L.wq = load_matrix(f, b + "attn_q.weight", hp.n_embd, dq);
    L.wk = load_matrix(f, b + "attn_k.weight", hp.n_embd, dkv);
    L.wv = load_matrix(f, b + "attn_v.weight", hp.n_embd, dkv);
    L.wo = load_matrix(f, b + "attn_output.weight", dq, hp.n_embd);
    L.w_gate = load_matrix(f, b + "ffn_gate.weight", hp.n_embd, hp.n_ff);
    L.w_up = load_matrix(f, b + "ffn_up.weight", hp.n_embd, hp.n_ff);
    L.w_down = load_matrix(f, b + "ffn_down.weight", hp.n_ff, hp.n_embd);
    if (hp.qkv_bias) {
      L.bq = load_vector(f, b + "attn_q.bias", dq);
      L.bk = load_vector(f, b + "attn_k.bias", dkv);
      L.bv = load_vector(f, b + "attn_v.bias", dkv);
    }
    if (hp.qk_norm) {
      L.q_norm = load_vector(f, b + "attn_q_norm.weight", hp.head_dim);
      L.k_norm = load_vector(f, b + "attn_k_norm.weight", hp.head_dim);
    }
  }
  for (const auto& t : f.tensors()) hp.n_params += t.n_elements();

  // RoPE inverse frequencies, as ggml computes them: theta_scale^i accumulated in float.
  const int half = hp.n_rot / 2;
  m->rope_freqs_.resize(half);
  std::vector<float> factors;
  if (f.find_tensor("rope_freqs.weight")) factors = load_vector(f, "rope_freqs.weight", half);
  const float theta_scale = std::pow(hp.rope_freq_base, -2.0f / (float)hp.n_rot);
  float th = hp.rope_freq_scale;
  for (int i = 0; i < half; ++i) {
    m->rope_freqs_[i] = factors.empty() ? th : th / factors[i];
    th *= theta_scale;
  }
  m->scratch_ = std::make_unique<scratch>();
  return m;
}

kv_cache_params model::cache_params(int n_ctx, const kv_cache_params& options) const {
  kv_cache_params p = options;
  p.n_layer = hp_.n_layer;
  p.n_kv_head = hp_.n_kv_head;
  p.head_dim = hp_.head_dim;
  p.n_ctx = n_ctx;
  p.n_seq = 1;
  return p;
}

static void check_finite(const float* x, int64_t n, const char* what, int il, int pos0) {
  if (!ops::all_finite(x, n))
    fail_input(std::string("[model] non-finite activation (NaN/Inf) in ") + what + " of layer " +
               std::to_string(il) + " for the batch starting at position " + std::to_string(pos0));
}

void model::forward(std::span<const int32_t> tokens, int pos0, int seq_id, kv_cache& cache,
                    thread_pool& pool, float* logits, bool all_logits) {
  const model_hparams& hp = hp_;
  const int64_t n = (int64_t)tokens.size();
  if (n == 0) fail_input("[model] forward called with no tokens");
  if (cache.n_pos(seq_id) != pos0)
    fail_input("[model] cache holds " + std::to_string(cache.n_pos(seq_id)) + " positions of sequence " +
               std::to_string(seq_id) + " but the batch starts at position " + std::to_string(pos0));
  for (int64_t t = 0; t < n; ++t)
    if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
      fail_input("[model] token id " + std::to_string(tokens[t]) + " at batch index " + std::to_string(t) +
                 " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
  scratch& s = *scratch_;
  s.reserve(n, hp);
  const int64_t E = hp.n_embd, D = hp.head_dim, dq = (int64_t)hp.n_head * D, dkv = (int64_t)hp.n_kv_head * D;
  const bool neox = hp.rope == rope_type::neox;

  // x: [n, n_embd]
  for (int64_t t = 0; t < n; ++t) weight_row_to_f32(tok_embd_, tokens[t], &s.x[t * E]);

  for (int il = 0; il < hp.n_layer; ++il) {
    const layer& L = layers_[il];
    for (int64_t t = 0; t < n; ++t) ops::rms_norm(&s.x[t * E], L.attn_norm.data(), E, hp.rms_eps, &s.h[t * E]);
    matmul(L.wq, s.h.data(), n, s.q.data(), pool);  // [n, n_head*head_dim]
    matmul(L.wk, s.h.data(), n, s.k.data(), pool);  // [n, n_kv_head*head_dim]
    matmul(L.wv, s.h.data(), n, s.v.data(), pool);
    for (int64_t t = 0; t < n; ++t) {
      float* q = &s.q[t * dq];
      float* k = &s.k[t * dkv];
      if (hp.qkv_bias) {
        for (int64_t i = 0; i < dq; ++i) q[i] += L.bq[i];
        for (int64_t i = 0; i < dkv; ++i) k[i] += L.bk[i];
        float* v = &s.v[t * dkv];
        for (int64_t i = 0; i < dkv; ++i) v[i] += L.bv[i];
      }
      const int pos = pos0 + (int)t;
      for (int h = 0; h < hp.n_head; ++h) {
        if (hp.qk_norm) ops::rms_norm(q + h * D, L.q_norm.data(), D, hp.rms_eps, q + h * D);
        ops::rope(q + h * D, hp.n_rot, rope_freqs_.data(), pos, neox);
      }
      for (int h = 0; h < hp.n_kv_head; ++h) {
        if (hp.qk_norm) ops::rms_norm(k + h * D, L.k_norm.data(), D, hp.rms_eps, k + h * D);
        ops::rope(k + h * D, hp.n_rot, rope_freqs_.data(), pos, neox);
      }
    }
    check_finite(s.k.data(), n * dkv, "K", il, pos0);
    check_finite(s.v.data(), n * dkv, "V", il, pos0);
    check_finite(s.q.data(), n * dq, "Q", il, pos0);
    if (observer_) observer_(il, pos0, (int)n, s.q.data(), s.k.data(), s.v.data());
    cache.append(il, seq_id, (int)n, s.k.data(), s.v.data());
    cache.attend(il, seq_id, pos0, (int)n, hp.n_head, s.q.data(), hp.attn_scale, s.attn.data(), pool);
    matmul(L.wo, s.attn.data(), n, s.o.data(), pool);
    for (int64_t i = 0; i < n * E; ++i) s.x[i] += s.o[i];

    for (int64_t t = 0; t < n; ++t) ops::rms_norm(&s.x[t * E], L.ffn_norm.data(), E, hp.rms_eps, &s.h[t * E]);
    matmul(L.w_gate, s.h.data(), n, s.gate.data(), pool);
    matmul(L.w_up, s.h.data(), n, s.up.data(), pool);
    ops::swiglu(s.gate.data(), s.up.data(), n * hp.n_ff, s.act.data());
    matmul(L.w_down, s.act.data(), n, s.o.data(), pool);
    for (int64_t i = 0; i < n * E; ++i) s.x[i] += s.o[i];
    check_finite(s.x.data(), n * E, "the residual stream", il, pos0);
  }

  const int64_t first = all_logits ? 0 : n - 1, n_out = n - first;
  for (int64_t t = first; t < n; ++t)
    ops::rms_norm(&s.x[t * E], output_norm_.data(), E, hp.rms_eps, &s.h[(t - first) * E]);
  matmul(output_, s.h.data(), n_out, logits, pool);
}

}  // namespace kvq
