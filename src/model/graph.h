// Shared builders of the architectures' forward graphs (src/model/arch/*.cpp): token embedding,
// RMSNorm, attention (Q/K/V projections with optional bias and per-head q/k RMSNorm, RoPE, the
// cache's append and attend_batch, output projection), gated FFN (SwiGLU / GeGLU) and the output
// head. Each builder works on the whole batch ([n_tokens, ...] row-major f32), whatever the
// sequences. (After llama.cpp's build_norm / build_attn / build_ffn in src/llama-graph.cpp.)
// Private to the model layer.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/matmul.h"
#include "kvq/model.h"

namespace kvq {

// One sequence's tokens in a batch: rows [t0, t0 + n) at positions pos0 .. pos0 + n - 1.
struct seq_run {
  int seq_id = 0;
  int pos0 = 0;
  int t0 = 0;
  int n = 0;
};

// Activations of one forward, grown to the largest batch seen (no allocation once warm).
struct graph_scratch {
  int64_t cap = 0;
  std::vector<float> x, h, o;         // [n, n_embd]: residual stream, normed input, block output
  std::vector<float> q, attn;         // [n, n_head, head_dim]
  std::vector<float> k, v;            // [n, n_kv_head, head_dim]
  std::vector<float> gate, up, act;   // [n, n_ff]
  std::vector<float> rope_cs;         // [n, n_rot]: cos / sin of each token's RoPE angles
  std::vector<attend_seq> seqs;       // one per sequence of the batch
  std::vector<seq_run> runs;
  std::vector<int32_t> out_rows;      // batch rows whose logits are written
  void reserve(int64_t n, const model_hparams& hp);
};

// What the builders of one forward share.
struct graph_ctx {
  const model_hparams& hp;
  const model_batch& batch;
  std::span<const seq_run> runs;
  std::span<const int32_t> out_rows;  // batch rows whose logits are written, ascending
  kv_cache& cache;
  thread_pool& pool;
  graph_scratch& s;
  const attn_observer& observer;
  int64_t n_tokens() const { return (int64_t)batch.tokens.size(); }
};

namespace build {

// RoPE inverse frequencies of one layer, as ggml computes them: freq_scale * theta_scale^i
// accumulated in float, theta_scale = base^(-2/n_rot), divided by rope_freqs.weight when present.
struct rope_table {
  int n_rot = 0;
  bool neox = false;
  std::vector<float> inv_freq;  // [n_rot/2]
};
// factors: rope_freqs.weight ([n_rot/2]) or empty.
rope_table make_rope(const model_hparams& hp, const layer_hparams& lp, std::span<const float> factors);

// x[t] = tok_embd[tokens[t]] * scale. x: [n, n_embd].
void embed(const graph_ctx& g, const weight_view& tok_embd, float scale, float* x);

// RMSNorm of n_rows rows of n elements (out may alias x); rows split over the pool when large
// enough to pay for it (every row's bits are the same either way).
void norm(thread_pool& pool, const float* x, const float* w, int64_t n_rows, int64_t n, float eps, float* out);

// x[i] += y[i] for i < n, split over the pool when large enough.
void add(thread_pool& pool, float* x, const float* y, int64_t n);

// Throws invalid_input "[model] non-finite activation (NaN/Inf) in <what> of layer il ..." unless
// every x[i] (i < n) is finite.
void check_finite(const graph_ctx& g, const float* x, int64_t n, const char* what, int il);

// The attention block's weights of one layer; optional parts are nullptr.
struct attn_weights {
  const weight_view* wq = nullptr;  // [n_embd -> n_head * head_dim]
  const weight_view* wk = nullptr;  // [n_embd -> n_kv_head * head_dim]
  const weight_view* wv = nullptr;
  const weight_view* wo = nullptr;  // [n_head * head_dim -> n_embd]
  const float* bq = nullptr;        // [n_head * head_dim] (qwen2)
  const float* bk = nullptr;        // [n_kv_head * head_dim]
  const float* bv = nullptr;
  const float* q_norm = nullptr;    // [head_dim] per-head RMSNorm before RoPE (qwen3, gemma3)
  const float* k_norm = nullptr;
  const rope_table* rope = nullptr;
};

// Self-attention of layer il for the whole batch: Q/K/V = h W (+ bias), per-head q/k RMSNorm,
// RoPE at each token's position, then per sequence the observer and cache.append, one
// cache.attend_batch over the sequences (scale hp.attn_scale; the cache applies the layer's
// window), and out = attn Wo. h: [n, n_embd] (normed input), out: [n, n_embd].
void attention(const graph_ctx& g, int il, const attn_weights& w, const float* h, float* out);

// Gated FFN: out = down(act(gate(h)) * up(h)), act = silu (SwiGLU) or tanh GELU (GeGLU).
// h, out: [n, n_embd] (must not alias).
struct ffn_weights {
  const weight_view* gate = nullptr;  // [n_embd -> n_ff]
  const weight_view* up = nullptr;
  const weight_view* down = nullptr;  // [n_ff -> n_embd]
  ffn_type type = ffn_type::swiglu;
};
void ffn(const graph_ctx& g, const ffn_weights& w, const float* h, float* out);

// Logits of the output rows: RMSNorm(x[row], norm_w) W_out, soft-capped when hp.final_logit_softcap
// > 0. x: [n, n_embd]; logits: [out_rows.size(), n_vocab].
void output(const graph_ctx& g, const float* x, const float* norm_w, const weight_view& w_out, float* logits);

}  // namespace build
}  // namespace kvq
