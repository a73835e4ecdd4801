// One architecture: its hyper-parameters beyond the common ones, its tensors and its forward graph
// over the shared builders (src/model/graph.h). A new architecture is one file in src/model/arch/
// implementing model_arch plus one row in the table of src/model/model.cpp (llama.cpp's
// src/models/<arch>.cpp shape). Private to the model layer.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/gguf.h"
#include "kvq/matmul.h"
#include "kvq/model.h"
#include "model/graph.h"

namespace kvq {

class model_arch {
 public:
  virtual ~model_arch() = default;
  // Called with the common hyper-parameters read (load_common_hparams, hp.layers filled with
  // global layers at rope.freq_base): reads the architecture's own keys into hp and maps its
  // tensors from f (which outlives this object). Errors as model::load.
  virtual void load(const gguf_file& f, model_hparams& hp) = 0;
  // Runs the validated batch of g and writes the logits of g.out_rows: [out_rows, n_vocab].
  virtual void forward(const graph_ctx& g, float* logits) const = 0;
};

// llama, mistral, qwen2, qwen3 (src/model/arch/llama.cpp).
std::unique_ptr<model_arch> make_arch_llama();
// gemma3 (src/model/arch/gemma3.cpp).
std::unique_ptr<model_arch> make_arch_gemma3();

// GGUF loading helpers shared by the architectures (src/model/loader.cpp).
namespace load {

// The keys every architecture reads under "{arch}.": embedding_length, block_count,
// attention.head_count(_kv), feed_forward_length, context_length, attention.key_length /
// value_length, rope.dimension_count / freq_base / scaling.*, attention.layer_norm_rms_epsilon,
// attention.scale; n_vocab from token_embd.weight; hp.layers = n_layer global layers.
void common_hparams(const gguf_file& f, model_hparams& hp);

// A 1-D f32/f16/bf16 tensor of exactly n elements as f32 (norm weights, biases).
std::vector<float> vector_f32(const gguf_file& f, const std::string& name, int64_t n);
// A 2-D weight of shape [n_in, n_out] (ggml order) in its stored format.
weight_view matrix(const gguf_file& f, const std::string& name, int64_t n_in, int64_t n_out);
// v as int after checking 0 < v <= 2^30 (names the key otherwise).
int positive_int(const gguf_file& f, const std::string& key, int64_t v);

// token_embd.weight, output_norm.weight and output.weight (or the tied token_embd.weight:
// hp.tied_output), checked against hp.
struct io_weights {
  weight_view tok_embd, output;
  std::vector<float> output_norm;  // [n_embd]
};
io_weights io(const gguf_file& f, model_hparams& hp);

// rope_freqs.weight ([n_rot/2] frequency factors) or empty when absent.
std::vector<float> rope_factors(const gguf_file& f, const model_hparams& hp);

}  // namespace load
}  // namespace kvq
