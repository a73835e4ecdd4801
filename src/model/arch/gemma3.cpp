// gemma3 (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786, §2.1), checked against
// llama.cpp's src/models/gemma3.cpp:
//   x = embd * sqrt(n_embd)
//   per layer: x += RMSNorm_post(attn(RMSNorm(x)));  x += RMSNorm_post(GeGLU(RMSNorm(x)))
//   attn: per-head q/k RMSNorm before NEOX RoPE, GQA, scale 1/sqrt(head_dim) (query_pre_attn_scalar);
//   logits = RMSNorm(x) token_embd^T (tied unless output.weight exists), optionally soft-capped.
// Sliding-window layers: with attention.sliding_window = W, layer il is windowed unless
// il % P == P - 1 (P = attention.sliding_window_pattern, default 6: five local layers, then one
// global); a windowed layer's query at position p sees keys [p - W + 1, p] and its RoPE base is
// rope.freq_base_swa (default 10000), the global layers use rope.freq_base and its linear scaling.
// Norm weights are used as stored: llama.cpp's converter already adds Gemma's +1
// (Gemma3RMSNorm computes x_normed * (1 + w)), so the GGUF holds 1 + w.
#include <cmath>
#include <string>
#include <vector>

#include "kvq/error.h"
#include "model/arch.h"

namespace kvq {
namespace {

class arch_gemma3 final : public model_arch {
 public:
  void load(const gguf_file& f, model_hparams& hp) override {
    const std::string a = hp.arch + ".";
    hp.rope = rope_type::neox;
    hp.qk_norm = true;
    hp.ffn = ffn_type::geglu;
    hp.post_norms = true;
    hp.embd_scale = std::sqrt((float)hp.n_embd);
    // llama.cpp: 1/sqrt(n_embd / n_head) for the 27B model (62 layers), else 1/sqrt(head_dim).
    if (!f.has(a + "attention.scale") && hp.n_layer == 62)
      hp.attn_scale = 1.0f / std::sqrt((float)(hp.n_embd / hp.n_head));
    if (auto c = f.try_float(a + "final_logit_softcapping")) {
      if (!(*c >= 0)) fail_input("[model] " + f.path() + ": " + a + "final_logit_softcapping " + std::to_string(*c) + " must be >= 0");
      hp.final_logit_softcap = (float)*c;
    }
    if (auto w = f.try_int(a + "attention.sliding_window"); w && *w > 0) {
      hp.sliding_window = load::positive_int(f, a + "attention.sliding_window", *w);
      const int64_t period = f.try_int(a + "attention.sliding_window_pattern").value_or(6);
      if (period < 0 || period > hp.n_layer)
        fail_input("[model] " + f.path() + ": " + a + "attention.sliding_window_pattern " + std::to_string(period) +
                   " must be in [0, block_count " + std::to_string(hp.n_layer) + "]");
      const double base_swa = f.try_float(a + "rope.freq_base_swa").value_or(10000.0);
      if (!(base_swa > 0))
        fail_input("[model] " + f.path() + ": " + a + "rope.freq_base_swa " + std::to_string(base_swa) + " must be > 0");
      for (int il = 0; il < hp.n_layer; ++il)
        if (period == 0 || il % period < period - 1) hp.layers[il] = layer_hparams{hp.sliding_window, (float)base_swa, 1.0f};
    }

    io_ = load::io(f, hp);
    const int64_t E = hp.n_embd, D = hp.head_dim, dq = (int64_t)hp.n_head * D, dkv = (int64_t)hp.n_kv_head * D;
    layers_.resize(hp.n_layer);
    const std::vector<float> factors = load::rope_factors(f, hp);
    for (int il = 0; il < hp.n_layer; ++il) {
      layer& L = layers_[il];
      const std::string b = "blk." + std::to_string(il) + ".";
      L.attn_norm = load::vector_f32(f, b + "attn_norm.weight", E);
      L.wq = load::matrix(f, b + "attn_q.weight", E, dq);
      L.wk = load::matrix(f, b + "attn_k.weight", E, dkv);
      L.wv = load::matrix(f, b + "attn_v.weight", E, dkv);
      L.wo = load::matrix(f, b + "attn_output.weight", dq, E);
      L.q_norm = load::vector_f32(f, b + "attn_q_norm.weight", D);
      L.k_norm = load::vector_f32(f, b + "attn_k_norm.weight", D);
      L.attn_post_norm = load::vector_f32(f, b + "post_attention_norm.weight", E);
      L.ffn_norm = load::vector_f32(f, b + "ffn_norm.weight", E);
      L.w_gate = load::matrix(f, b + "ffn_gate.weight", E, hp.n_ff);
      L.w_up = load::matrix(f, b + "ffn_up.weight", E, hp.n_ff);
      L.w_down = load::matrix(f, b + "ffn_down.weight", hp.n_ff, E);
      L.ffn_post_norm = load::vector_f32(f, b + "post_ffw_norm.weight", E);
      L.rope = build::make_rope(hp, hp.layers[il], factors);
    }
  }

  void forward(const graph_ctx& g, float* logits) const override {
    const model_hparams& hp = g.hp;
    graph_scratch& s = g.s;
    const int64_t n = g.n_tokens(), E = hp.n_embd;
    float *x = s.x.data(), *h = s.h.data(), *o = s.o.data();  // [n, n_embd]
    build::embed(g, io_.tok_embd, hp.embd_scale, x);
    for (int il = 0; il < hp.n_layer; ++il) {
      const layer& L = layers_[il];
      build::attn_weights aw;
      aw.wq = &L.wq, aw.wk = &L.wk, aw.wv = &L.wv, aw.wo = &L.wo;
      aw.q_norm = L.q_norm.data(), aw.k_norm = L.k_norm.data();
      aw.rope = &L.rope;
      build::norm(g.pool, x, L.attn_norm.data(), n, E, hp.rms_eps, h);
      build::attention(g, il, aw, h, o);
      build::norm(g.pool, o, L.attn_post_norm.data(), n, E, hp.rms_eps, o);
      build::add(g.pool, x, o, n * E);
      build::norm(g.pool, x, L.ffn_norm.data(), n, E, hp.rms_eps, h);
      build::ffn(g, {&L.w_gate, &L.w_up, &L.w_down, ffn_type::geglu}, h, o);
      build::norm(g.pool, o, L.ffn_post_norm.data(), n, E, hp.rms_eps, o);
      build::add(g.pool, x, o, n * E);
      build::check_finite(g, x, n * E, "the residual stream", il);
    }
    build::output(g, x, io_.output_norm.data(), io_.output, logits);
  }

 private:
  struct layer {
    std::vector<float> attn_norm, attn_post_norm, ffn_norm, ffn_post_norm;  // [n_embd]
    std::vector<float> q_norm, k_norm;                                      // [head_dim]
    weight_view wq, wk, wv, wo, w_gate, w_up, w_down;
    build::rope_table rope;  // this layer's base: rope.freq_base_swa (windowed) or rope.freq_base
  };
  load::io_weights io_;
  std::vector<layer> layers_;
};

}  // namespace

std::unique_ptr<model_arch> make_arch_gemma3() { return std::make_unique<arch_gemma3>(); }

}  // namespace kvq
