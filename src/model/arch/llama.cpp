// llama, mistral, qwen2, qwen3: pre-norm blocks x += attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)).
// The four differ only in data: qwen2 has q/k/v bias, qwen3 per-head q/k RMSNorm, and both use
// the NEOX RoPE pair order (llama.cpp's llama_model_rope_type); llama/mistral use the NORM order.
// (llama.cpp src/models/llama.cpp, qwen2.cpp, qwen3.cpp.)
#include <string>
#include <vector>

#include "model/arch.h"

namespace kvq {
namespace {

class arch_llama final : public model_arch {
 public:
  void load(const gguf_file& f, model_hparams& hp) override {
    hp.rope = (hp.arch == "qwen2" || hp.arch == "qwen3") ? rope_type::neox : rope_type::norm;
    hp.qkv_bias = hp.arch == "qwen2";
    hp.qk_norm = hp.arch == "qwen3";
    io_ = load::io(f, hp);
    const int64_t E = hp.n_embd, dq = (int64_t)hp.n_head * hp.head_dim, dkv = (int64_t)hp.n_kv_head * hp.head_dim;
    layers_.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
      layer& L = layers_[il];
      const std::string b = "blk." + std::to_string(il) + ".";
      L.attn_norm = load::vector_f32(f, b + "attn_norm.weight", E);
      L.ffn_norm = load::vector_f32(f, b + "ffn_norm.weight", E);
      L.wq = load::matrix(f, b + "attn_q.weight", E, dq);
      L.wk = load::matrix(f, b + "attn_k.weight", E, dkv);
      L.wv = load::matrix(f, b + "attn_v.weight", E, dkv);
      L.wo = load::matrix(f, b + "attn_output.weight", dq, E);
      L.w_gate = load::matrix(f, b + "ffn_gate.weight", E, hp.n_ff);
      L.w_up = load::matrix(f, b + "ffn_up.weight", E, hp.n_ff);
      L.w_down = load::matrix(f, b + "ffn_down.weight", hp.n_ff, E);
      if (hp.qkv_bias) {
        L.bq = load::vector_f32(f, b + "attn_q.bias", dq);
        L.bk = load::vector_f32(f, b + "attn_k.bias", dkv);
        L.bv = load::vector_f32(f, b + "attn_v.bias", dkv);
      }
      if (hp.qk_norm) {
        L.q_norm = load::vector_f32(f, b + "attn_q_norm.weight", hp.head_dim);
        L.k_norm = load::vector_f32(f, b + "attn_k_norm.weight", hp.head_dim);
      }
    }
    rope_ = build::make_rope(hp, hp.layers[0], load::rope_factors(f, hp));
  }

  void forward(const graph_ctx& g, float* logits) const override {
    const model_hparams& hp = g.hp;
    graph_scratch& s = g.s;
    const int64_t n = g.n_tokens(), E = hp.n_embd;
    build::embed(g, io_.tok_embd, 1.0f, s.x.data());  // x: [n, n_embd]
    for (int il = 0; il < hp.n_layer; ++il) {
      const layer& L = layers_[il];
      build::norm(g.pool, s.x.data(), L.attn_norm.data(), n, E, hp.rms_eps, s.h.data());
      build::attention(g, il, attn_of(L), s.h.data(), s.o.data());
      build::add(g.pool, s.x.data(), s.o.data(), n * E);
      build::norm(g.pool, s.x.data(), L.ffn_norm.data(), n, E, hp.rms_eps, s.h.data());
      build::ffn(g, {&L.w_gate, &L.w_up, &L.w_down, ffn_type::swiglu}, s.h.data(), s.o.data());
      build::add(g.pool, s.x.data(), s.o.data(), n * E);
      build::check_finite(g, s.x.data(), n * E, "the residual stream", il);
    }
    build::output(g, s.x.data(), io_.output_norm.data(), io_.output, logits);
  }

 private:
  struct layer {
    std::vector<float> attn_norm, ffn_norm;  // [n_embd]
    std::vector<float> q_norm, k_norm;       // [head_dim] (qwen3)
    std::vector<float> bq, bk, bv;           // [n_head * head_dim], [n_kv_head * head_dim] (qwen2)
    weight_view wq, wk, wv, wo, w_gate, w_up, w_down;
  };

  build::attn_weights attn_of(const layer& L) const {
    build::attn_weights w;
    w.wq = &L.wq, w.wk = &L.wk, w.wv = &L.wv, w.wo = &L.wo;
    if (!L.bq.empty()) w.bq = L.bq.data(), w.bk = L.bk.data(), w.bv = L.bv.data();
    if (!L.q_norm.empty()) w.q_norm = L.q_norm.data(), w.k_norm = L.k_norm.data();
    w.rope = &rope_;
    return w;
  }

  load::io_weights io_;
  std::vector<layer> layers_;
  build::rope_table rope_;  // every layer: rope.freq_base
};

}  // namespace

std::unique_ptr<model_arch> make_arch_llama() { return std::make_unique<arch_llama>(); }

}  // namespace kvq
