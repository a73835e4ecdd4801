// Transformer models read from GGUF. Each architecture is one file under src/model/arch/ over the
// shared builders of src/model/graph.h (RMSNorm, attention with RoPE and the cache, SwiGLU / GeGLU
// FFN), reading the hyper-parameters it needs from the GGUF metadata:
//  - llama, mistral: Llama (Touvron et al. 2023, arXiv:2302.13971, §2: RMSNorm, SwiGLU, RoPE);
//    qwen2 adds q/k/v bias, qwen3 per-head q/k RMSNorm (both NEOX RoPE);
//  - gemma3: Gemma 3 (Gemma Team 2025, arXiv:2503.19786, §2): GeGLU (tanh GELU), RMSNorm before and
//    after attention and FFN, per-head q/k RMSNorm, embeddings scaled by sqrt(n_embd), tied output,
//    five of six layers with sliding-window attention and their own RoPE base.
// RoPE (Su et al. 2021, arXiv:2104.09864, §3.4); GQA (Ainslie et al. 2023, arXiv:2305.13245).
// The graphs follow llama.cpp's src/models/<arch>.cpp, against whose outputs the tests compare.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/gguf.h"
#include "kvq/kv_cache.h"
#include "kvq/matmul.h"
#include "kvq/thread_pool.h"

namespace kvq {

class model_arch;      // src/model/arch.h
struct graph_scratch;  // src/model/graph.h

enum class rope_type { norm, neox, count };  // norm: pairs (2i, 2i+1); neox: pairs (i, i + n_rot/2)
enum class ffn_type { swiglu, geglu, count };   // silu(gate) * up; gelu_tanh(gate) * up

// What differs from layer to layer (gemma3's sliding-window layers).
struct layer_hparams {
  int window = 0;                   // sliding window (tokens): a query at position p sees keys
                                    // [p - window + 1, p]; 0 = global (causal over all positions)
  float rope_freq_base = 10000.0f;  // RoPE base of this layer
  float rope_freq_scale = 1.0f;     // RoPE linear scale of this layer
};

struct model_hparams {
  std::string arch;      // general.architecture
  std::string name;      // general.name (may be empty)
  int n_vocab = 0;
  int n_embd = 0;        // {arch}.embedding_length
  int n_layer = 0;       // {arch}.block_count
  int n_head = 0;        // {arch}.attention.head_count
  int n_kv_head = 0;     // {arch}.attention.head_count_kv (default n_head)
  int head_dim = 0;      // {arch}.attention.key_length (default n_embd / n_head)
  int n_ff = 0;          // {arch}.feed_forward_length
  int n_ctx_train = 0;   // {arch}.context_length
  int n_rot = 0;         // {arch}.rope.dimension_count (default head_dim)
  float rope_freq_base = 10000.0f;  // {arch}.rope.freq_base
  float rope_freq_scale = 1.0f;     // 1 / {arch}.rope.scaling.factor when scaling.type == linear
  rope_type rope = rope_type::norm;
  float rms_eps = 1e-5f;            // {arch}.attention.layer_norm_rms_epsilon
  float attn_scale = 0.0f;          // {arch}.attention.scale, default 1/sqrt(head_dim)
  bool qkv_bias = false;            // qwen2
  bool qk_norm = false;             // qwen3
  bool tied_output = false;         // no output.weight: logits use token_embd.weight
  ffn_type ffn = ffn_type::swiglu;
  bool post_norms = false;          // gemma3: RMSNorm of the attention and FFN outputs before the residual add
  float embd_scale = 1.0f;          // token embeddings are multiplied by this (gemma3: sqrt(n_embd))
  float final_logit_softcap = 0.0f; // {arch}.final_logit_softcapping: logits = c * tanh(logits / c); 0 = off
  int sliding_window = 0;           // {arch}.attention.sliding_window (tokens; 0 = none)
  std::vector<layer_hparams> layers;  // [n_layer]
  int64_t n_params = 0;
};

// A batch of tokens from one or several sequences for model::forward (llama.cpp's llama_batch).
// The tokens of one sequence form one contiguous run of the batch at consecutive positions
// starting at the cache's n_pos(seq_id) (a sequence appears in at most one run).
struct model_batch {
  std::span<const int32_t> tokens;  // [n_tokens] ids in [0, n_vocab)
  std::span<const int32_t> pos;     // [n_tokens] positions (tokens from the start of the sequence)
  std::span<const int32_t> seq_id;  // [n_tokens] in [0, cache n_seq)
  // [n_tokens]: nonzero = write this token's logits; empty = the last token of every sequence.
  std::span<const uint8_t> output;
};

// Called once per layer per sequence of the batch with the tensors the cache receives (after RoPE):
// q [n_tokens, n_head, head_dim], k and v [n_tokens, n_kv_head, head_dim] of that sequence.
using attn_observer = std::function<void(int il, int pos0, int n_tokens, const float* q,
                                         const float* k, const float* v)>;

class model {
 public:
  // Opens `path`, reads hparams and maps every tensor (weights stay in their stored format).
  // Errors: io (cannot open), invalid_input (malformed GGUF, missing key/tensor, inconsistent
  // shape: names the tensor, expected and found shape), unsupported (architecture or tensor type).
  static std::unique_ptr<model> load(const std::string& path);
  ~model();

  const model_hparams& hparams() const { return hp_; }
  const gguf_file& gguf() const { return *file_; }

  // Cache parameters matching this model's shapes (n_layer, n_kv_head, head_dim), n_ctx and
  // n_seq sequences; the format options (types, rotation, windows...) are taken from `options`.
  kv_cache_params cache_params(int n_ctx, const kv_cache_params& options = {}, int n_seq = 1) const;

  // Runs a batch of tokens from one or several sequences through the model in one pass (prefill
  // and decode alike), appending each sequence's K/V to `cache` and attending with
  // kv_cache::attend_batch. logits: [n_outputs, n_vocab] f32, one row per output token in batch
  // order; returns n_outputs. Throws invalid_input (nothing appended) for an empty batch, spans of
  // different lengths, a token id outside [0, n_vocab), a sequence id outside the cache, a
  // sequence in two runs or whose positions do not continue its cache; and for non-finite
  // activations ("[model] non-finite activation in layer 3 ...").
  int forward(const model_batch& batch, kv_cache& cache, thread_pool& pool, float* logits);

  // One sequence: tokens[0..n) at positions pos0..pos0+n-1 of seq_id (the cache must hold exactly
  // pos0 positions of it). logits: [all_logits ? n : 1, n_vocab] (the last token's only when
  // !all_logits). Callers split long prompts into batches. Throws as forward(batch).
  void forward(std::span<const int32_t> tokens, int pos0, int seq_id, kv_cache& cache,
               thread_pool& pool, float* logits, bool all_logits);

  void set_attn_observer(attn_observer obs) { observer_ = std::move(obs); }

 private:
  model();
  model_hparams hp_;
  std::unique_ptr<gguf_file> file_;
  std::unique_ptr<model_arch> arch_;     // the architecture's weights and graph (src/model/arch/)
  std::unique_ptr<graph_scratch> scratch_;
  std::vector<int32_t> all_pos_, all_seq_;  // the single-sequence forward's batch
  std::vector<uint8_t> all_out_;
  attn_observer observer_;
};

// Architectures accepted by model::load.
std::vector<std::string> supported_architectures();

}  // namespace kvq
