// Llama-family transformer read from GGUF: architectures llama, mistral, qwen2 (q/k/v bias),
// qwen3 (per-head q/k RMSNorm). Shapes, RoPE and the attention scale come from GGUF metadata.
// References: Llama (Touvron et al. 2023, arXiv:2302.13971, §2: RMSNorm, SwiGLU, RoPE);
// RoPE (Su et al. 2021, arXiv:2104.09864, §3.4); GQA (Ainslie et al. 2023, arXiv:2305.13245).
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

enum class rope_type { norm, neox, count };  // norm: pairs (2i, 2i+1); neox: pairs (i, i + n_rot/2)

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
  int64_t n_params = 0;
};

// Called once per layer per forward with the tensors the cache receives (after RoPE):
// q [n_tokens, n_head, head_dim], k and v [n_tokens, n_kv_head, head_dim].
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

  // Cache parameters matching this model's shapes (n_layer, n_kv_head, head_dim), n_ctx and one
  // sequence; the format options (types, rotation, windows...) are taken from `options`.
  kv_cache_params cache_params(int n_ctx, const kv_cache_params& options = {}) const;

  // Runs tokens[0..n) at positions pos0..pos0+n-1 of sequence seq_id through the model, appending
  // their K/V to `cache` (which must hold exactly pos0 positions of seq_id).
  // logits: [all_logits ? n : 1, n_vocab] f32 (the last token's only when !all_logits).
  // Processes the batch in one pass (prefill) — callers split long prompts into batches.
  // Throws invalid_input for token ids outside [0, n_vocab) and for non-finite activations
  // ("[model] non-finite activation in layer 3 ...").
  void forward(std::span<const int32_t> tokens, int pos0, int seq_id, kv_cache& cache,
               thread_pool& pool, float* logits, bool all_logits);

  void set_attn_observer(attn_observer obs) { observer_ = std::move(obs); }

 private:
  model() = default;
  struct layer;
  struct scratch;
  model_hparams hp_;
  std::unique_ptr<gguf_file> file_;
  std::vector<layer> layers_;
  weight_view tok_embd_, output_;
  std::vector<float> output_norm_;
  std::vector<float> rope_freqs_;   // [n_rot/2] inverse frequencies (theta_i per position)
  std::unique_ptr<scratch> scratch_;
  attn_observer observer_;
};

// Architectures accepted by model::load.
std::vector<std::string> supported_architectures();

}  // namespace kvq
