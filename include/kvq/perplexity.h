// Perplexity and KL divergence of a KV-cache configuration, with llama.cpp's llama-perplexity
// protocol so that the numbers compare with it directly:
//  - the whole text is tokenized once, as llama.cpp's common_tokenize(add_special = true,
//    parse_special = false): BOS first (EOS last) when the vocabulary asks for it;
//  - it is cut into n_chunk = n_tokens / n_ctx chunks of n_ctx tokens (a partial tail is dropped),
//    at most `n_chunks` of them;
//  - the first token of every chunk is replaced by BOS (when the vocabulary has one) and the chunk
//    is evaluated from position 0 with an empty cache;
//  - only the second half is scored: the logits of positions first .. n_ctx-2, first = n_ctx / 2,
//    predict tokens first+1 .. n_ctx-1, i.e. n_ctx/2 - 1 scored tokens per chunk.
//  - PPL = exp(mean NLL); its standard error is PPL * sqrt((mean(NLL²) - mean(NLL)²) / (N - 1)).
// (llama.cpp examples/perplexity/perplexity.cpp, perplexity() and process_logits().)
//
// KL divergence (llama.cpp --kl-divergence): per scored token, KL(base || test) in nats between
// the softmax of a reference run (the "base", usually an f16 cache) and this run, reported as
// mean ± standard error, median, p90/p99/p99.9, max; "same top-1" = % of tokens whose argmax
// agrees; RMS Δp = root mean square of p_test(observed) - p_base(observed) in %; ΔPPL in % from
// the per-token NLL difference (paired, so its error is much smaller than either PPL's).
//
// Base logits come either from a file written by an earlier run (kl_base_file, format below) or
// from a second cache evaluated side by side on the same chunk (perplexity_params::compare_type),
// which needs no file and is exact for any vocabulary.
//
// KL base file (little-endian), written atomically (temp file + rename):
//   bytes 0..7   magic "KVQKLD1\n"
//   u32          header length L, then L bytes of JSON: {"format":"kvq-kld","version":1,
//                "model":general.name, "arch", "n_vocab", "n_embd", "n_layer", "n_ctx",
//                "n_chunk", "n_scored_per_chunk", "top_k" (0 = full vocabulary),
//                "tokens_fnv1a64" (FNV-1a hash of all token ids of the text, hex), "n_tokens",
//                "type_k", "type_v"}
//   then n_chunk * n_scored_per_chunk records in order of chunk and position, each:
//     f32 logp_observed                       log-probability of the observed next token
//     top_k == 0: f32 logp[n_vocab]           full log-softmax
//     top_k  > 0: i32 id[top_k], f32 logp[top_k] (descending), f32 log_rest
//                                             log of the probability mass outside the top_k
//   With top_k > 0 the KL is the divergence between the two distributions over the top_k tokens
//   of the base plus one "rest" bucket: a lower bound of the full KL (grouping, log-sum
//   inequality), exact when the base puts no mass outside its top_k. Argmax and p(observed) stay
//   exact. A file is refused with invalid_input when its model (arch, name, n_vocab, n_embd,
//   n_layer), n_ctx or text tokens differ from the run comparing against it, or when it holds
//   fewer chunks than that run evaluates.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/certified.h"
#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/tokenizer.h"

namespace kvq {

struct perplexity_params {
  int n_ctx = 512;        // tokens per chunk; must be in [4, the model's context]
  int n_batch = 0;        // tokens per forward pass inside a chunk; 0 = min(n_ctx, 2048) (llama.cpp's default)
  int n_chunks = -1;      // evaluate at most this many chunks; < 0: all
  int n_threads = 0;      // 0: all hardware threads
  kv_cache_params cache;  // types and options of the cache under test (shapes filled from the model)
  // KL divergence against a base (at most one of the two):
  std::string kl_base_in;    // read base log-probs from this file (written by kl_base_out)
  std::optional<kv_cache_type> compare_type;  // evaluate a second cache of this type (K and V) side by side
  // Write this run's log-probs as a base file (written atomically when the run completes).
  std::string kl_base_out;
  int kl_top_k = -1;         // base file records: -1 auto (full if n_vocab <= 1024, else 128), 0 full
  // cuda: the model on the GPU (kvq/cuda_model.h); KL base files work, --compare does not (one
  // runner per run). Errors as cuda::check_supported, unsupported without CUDA or a GPU.
  compute_device device = compute_device::cpu;
};

struct ppl_stats {
  double ppl = 0, ppl_err = 0;  // exp(mean NLL) and its standard error (llama.cpp's formula)
  double nll_mean = 0;          // mean NLL in nats
  int64_t n_scored = 0;         // scored tokens
};

struct kld_stats {
  int64_t n = 0;                                   // tokens compared
  double mean = 0, mean_err = 0;                   // nats
  double median = 0, p90 = 0, p99 = 0, p99_9 = 0, max = 0, min = 0;
  double same_top1_pct = 0, same_top1_err = 0;     // %
  double rms_dp_pct = 0, rms_dp_err = 0;           // RMS of p_test(obs) - p_base(obs), %
  double ppl_base = 0, ppl_base_err = 0;           // the base's PPL on the compared tokens
  double dppl_pct = 0, dppl_err = 0;               // 100 * (PPL / PPL_base - 1), paired error
  int top_k = 0;                                   // 0: full-vocabulary KL; > 0: grouped (see above)
  std::string base_desc;                           // "file X (f16/f16)" or "f16 cache, same run"
};

struct perplexity_result {
  int n_ctx = 0, n_batch = 0;
  int64_t n_tokens = 0;       // tokens of the whole text (BOS included)
  int n_chunk = 0;            // chunks evaluated
  int n_scored_per_chunk = 0;  // n_ctx/2 - 1
  ppl_stats ppl;
  bool has_kld = false;
  kld_stats kld;
  std::string kv_describe;
  std::string attn_tier;  // kv_attn_tier of the cache: the attention kernels' ISA tier
  double kv_bytes_per_token = 0, kv_bytes_per_token_f16 = 0;
  double seconds = 0, tokens_per_s = 0;  // wall time of the evaluation (all caches evaluated)
  std::vector<double> chunk_ppl;         // running PPL after each chunk (as llama.cpp prints)
  // The KL base file written (perplexity_params::kl_base_out; all 0 without one): its records (one
  // per scored token: n_chunk x n_scored_per_chunk), their top_k (0: full vocabulary) and the
  // file's bytes (magic, header and records).
  int64_t kl_base_records = 0;
  int kl_base_top_k = 0;
  uint64_t kl_base_bytes = 0;
  // One report per certified cache the call created (the cache under test, then the --compare
  // one), taken after the last chunk (append_certified_report, certified.h); empty otherwise.
  std::vector<certified_report> certified;
};

// Called after each chunk: chunks done, total, tokens evaluated so far (all caches), seconds.
using perplexity_progress = std::function<void(int done, int total, int64_t tokens, double seconds)>;

// Tokenizes `text` as llama.cpp's perplexity does (see above). Errors (invalid_input): empty text.
// op: the name that starts error messages ("[perplexity] ..."), so each tool names itself.
std::vector<int32_t> perplexity_tokenize(const tokenizer& tok, const std::string& text,
                                         const std::string& op = "perplexity");

// Validates `p` against the model without any text, so a tool can refuse bad flags before it
// reads and tokenizes a large file: n_ctx outside [4, model context], n_batch < 0, n_chunks == 0,
// kl_top_k out of range, both kl_base_in and compare_type, kl_base_in and kl_base_out the same
// file (by path or link), unknown or unsupported cache types
// (make_kv_cache), a KL base file that is missing, not a kvq file, or made with another
// model/vocabulary/context. Errors: invalid_input (io when the base file cannot be opened).
// perplexity() runs the same checks first.
void perplexity_check(const model& m, const perplexity_params& p);

// Evaluates `tokens` (already tokenized, e.g. by perplexity_tokenize) with the protocol above.
// bos: the id that replaces the first token of each chunk (the vocabulary's BOS when it adds one,
// see perplexity_bos()), or -1 (chunks keep their first token).
// Errors (invalid_input): those of perplexity_check(), fewer tokens than one chunk, a token id
// outside the vocabulary, a KL file that is truncated or made from another text. io: cannot write
// kl_base_out (nothing is left behind). Validation happens before any evaluation.
perplexity_result perplexity(model& m, std::span<const int32_t> tokens, int32_t bos,
                             const perplexity_params& p, const perplexity_progress& progress = {});

// BOS id when the vocabulary adds BOS (add_bos_default()), else -1.
int32_t perplexity_bos(const tokenizer& tok);

// Reads a text file whole. Errors: io (cannot open), invalid_input (a directory, an empty file).
// op: the name that starts error messages ("[perplexity] ...", "[kv_error] ...").
std::string read_text_file(const std::string& path, const std::string& op = "perplexity");

}  // namespace kvq
