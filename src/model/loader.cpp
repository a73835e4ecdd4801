#include <cmath>
#include <cstring>

#include "kvq/error.h"
#include "kvq/f16.h"
#include "model/arch.h"

namespace kvq::load {

std::vector<float> vector_f32(const gguf_file& f, const std::string& name, int64_t n) {
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

weight_view matrix(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out) {
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

void common_hparams(const gguf_file& f, model_hparams& hp) {
  const std::string& path = f.path();
  const std::string a = hp.arch + ".";
  hp.name = f.try_string("general.name").value_or("");
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
  hp.rms_eps = (float)f.try_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5);
  hp.attn_scale = (float)f.try_float(a + "attention.scale").value_or(1.0 / std::sqrt((double)hp.head_dim));

  const gguf_tensor_info& emb = f.tensor("token_embd.weight");
  if (emb.ne.size() != 2 || emb.ne[0] != hp.n_embd)
    fail_input("[model] " + path + ": tensor 'token_embd.weight' must be [" + std::to_string(hp.n_embd) + ", n_vocab]");
  hp.n_vocab = (int)emb.ne[1];
  if (auto nv = f.try_int(a + "vocab_size"); nv && *nv != hp.n_vocab)
    fail_input("[model] " + path + ": " + a + "vocab_size " + std::to_string(*nv) +
               " differs from token_embd.weight rows " + std::to_string(hp.n_vocab));
  hp.layers.assign(hp.n_layer, layer_hparams{0, hp.rope_freq_base, hp.rope_freq_scale});
}

io_weights io(const gguf_file& f, model_hparams& hp) {
  io_weights w;
  w.tok_embd = make_weight_view(f.tensor("token_embd.weight"));
  w.output_norm = vector_f32(f, "output_norm.weight", hp.n_embd);
  if (f.find_tensor("output.weight")) {
    w.output = matrix(f, "output.weight", hp.n_embd, hp.n_vocab);
  } else {
    hp.tied_output = true;
    w.output = w.tok_embd;
  }
  return w;
}

std::vector<float> rope_factors(const gguf_file& f, const model_hparams& hp) {
  if (!f.find_tensor("rope_freqs.weight")) return {};
  return vector_f32(f, "rope_freqs.weight", hp.n_rot / 2);
}

}  // namespace kvq::load
