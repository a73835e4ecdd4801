// Text generation: prefill the prompt in batches of n_batch tokens, then decode one token at a time.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/certified.h"
#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/sampling.h"
#include "kvq/tokenizer.h"

namespace kvq {

struct generate_params {
  std::string prompt;
  int n_predict = 128;   // tokens to generate; < 0: until end-of-generation or context full
  int n_ctx = 0;         // 0: min(model context, 4096)
  int n_batch = 512;     // prompt tokens per prefill pass
  int n_threads = 0;     // 0: all hardware threads
  bool add_bos = true;   // prepend BOS when the vocabulary defines one and asks for it
  bool ignore_eos = false;
  sampling_params sampling;
  kv_cache_params cache;  // types/options; shapes and n_ctx are filled from the model
  // cuda: every layer on the GPU (cuda::model_runner, kvq/cuda_model.h; its check_supported errors
  // for what it does not run, unsupported "[cuda] not supported ..." without CUDA or a GPU)
  compute_device device = compute_device::cpu;
};

struct generate_result {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> ids;     // generated ids
  std::string text;             // decoded generated text
  std::string stop_reason;      // "n_predict" | "eog" | "context_full" (prompt + ids fill n_ctx)
  uint64_t seed = 0;
  int n_ctx = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  double prefill_tokens_per_s = 0, decode_tokens_per_s = 0;
  size_t kv_bytes = 0;               // bytes allocated by the cache
  size_t kv_bytes_used = 0;          // bytes holding the stored positions
  double kv_bytes_per_token = 0;     // asymptotic storage per token (all layers, K+V)
  double kv_bytes_per_token_f16 = 0; // the same for an f16 cache, for the ratio
  std::string kv_describe;
  std::string attn_tier;  // kv_attn_tier of the cache: the attention kernels' ISA tier
  // The report of the cache when it is certified (append_certified_report, certified.h), taken
  // after the last token; empty otherwise.
  std::vector<certified_report> certified;
};

// on_piece: called with each generated token's text as it is produced (may be empty).
// Generation ends at n_predict tokens, an end-of-generation token, or when the prompt and the
// generated tokens fill n_ctx positions (stop_reason "context_full"; never more than n_ctx).
// Errors (invalid_input): empty prompt on a model that adds no BOS (else it is BOS alone), prompt longer than n_ctx
// (or of n_ctx tokens when n_predict != 0: no position left to generate into), n_ctx larger than the model's
// training context... unknown cache type (from make_kv_cache).
generate_result generate(model& m, const tokenizer& tok, const generate_params& p,
                         const std::function<void(const std::string&)>& on_piece = {});

// Resolves n_ctx 0 to min(training context, 4096) and checks it against the model (used by all
// tools). Errors (invalid_input, message tagged "[op]"): n_ctx < 0, n_ctx > the training context.
int resolve_n_ctx(const model& m, int n_ctx, const char* op = "generate");

}  // namespace kvq
