// Attention error of KV-cache formats on real activations ("attention deviation vs f32", the
// measure of the seed PR): the model reads a text with an f32 cache while an attention observer
// captures the Q, K and V (after RoPE) of every layer; each requested format is then replayed on
// exactly those tensors through the ordinary cache path (make_kv_cache, append, attend: the same
// fused kernels as generation), and compared with an f32 cache replayed the same way.
//
// Per layer il and query head h, over all query positions t of all chunks:
//  - rel_err = sqrt(Σ_t ||o_fmt(t) - o_f32(t)||²) / sqrt(Σ_t ||o_f32(t)||²), o = attention output;
//  - tv = mean_t ½ Σ_j |p_fmt(t, j) - p_f32(t, j)|, the total-variation distance of the attention
//    probabilities over the keys j <= t. The probabilities are read out of the cache's own attend:
//    a second cache with the format's K and an exact f32 V whose rows are one-hot vectors
//    (row j = e_{j - b·head_dim} for the keys of block b, 0 elsewhere) returns p(t, j) for the
//    head_dim keys of block b as its output; ceil(n_ctx / head_dim) such passes give every p.
//    So tv measures what the kernel computes from the stored K (including its int8 query
//    quantization and exact windows), not a model of it. V's format does not enter tv.
// Both are also reported per layer (mean over heads) and overall; "worst heads" are the
// (layer, head) pairs with the largest rel_err.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/model.h"

namespace kvq {

struct kv_error_params {
  int n_ctx = 512;       // tokens per chunk (a fresh sequence; the first token replaced by bos)
  int n_chunks = 1;      // consecutive chunks of the text to capture
  int n_threads = 0;     // 0: all hardware threads
  bool tv = true;        // compute the total-variation distance (ceil(n_ctx/head_dim) extra passes)
  std::vector<kv_cache_params> formats;  // types and options to replay (shapes filled here)
};

struct kv_error_head {
  int il = 0, head = 0;
  double rel_err = 0, tv = 0;
};

struct kv_error_format {
  std::string type_k, type_v, describe;
  double bytes_per_token = 0, ratio_vs_f16 = 0;
  std::vector<double> rel_err;  // [n_layer, n_head]
  std::vector<double> tv;       // [n_layer, n_head] (zeros when tv is off: see kv_error_result::has_tv)
  std::vector<double> layer_rel_err, layer_tv;  // [n_layer] mean over heads
  double mean_rel_err = 0, max_rel_err = 0, mean_tv = 0, max_tv = 0;  // over (layer, head)
  std::vector<kv_error_head> worst;  // up to 5, largest rel_err first
};

struct kv_error_result {
  int n_layer = 0, n_head = 0, n_kv_head = 0, head_dim = 0;
  int n_ctx = 0, n_chunk = 0;
  int64_t n_queries = 0;  // query positions per head (n_chunk * n_ctx)
  bool has_tv = false;    // the TV distance was computed (kv_error_params::tv); else tv fields are 0
  std::vector<kv_error_format> formats;
  double seconds = 0;
};

// Called after each (chunk, format) replay: steps done, total steps.
using kv_error_progress = std::function<void(int done, int total)>;

// Validates `p` against the model without any text (so a tool can refuse bad flags before it
// reads and tokenizes a file). Errors (invalid_input): no formats, n_ctx outside [2, model
// context], n_chunks < 1, unknown/unsupported format (from make_kv_cache). kv_error() runs it first.
void kv_error_check(const model& m, const kv_error_params& p);

// tokens: the text (e.g. perplexity_tokenize); bos: replaces each chunk's first token, or -1.
// Errors (invalid_input): those of kv_error_check(), text shorter than one chunk (before any work).
kv_error_result kv_error(model& m, std::span<const int32_t> tokens, int32_t bos, const kv_error_params& p,
                         const kv_error_progress& progress = {});

}  // namespace kvq
