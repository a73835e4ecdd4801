// End-to-end decode/prefill speed of KV-cache formats against context depth (kvq bench), and
// synthetic random-weight models of published shapes for measuring speed at realistic head_dim
// without downloading weights (speed does not depend on the weight values).
//
// Protocol. All requested formats run side by side in one pass (f16 is added when missing, as the
// baseline of every ratio), each with its own cache of n_ctx positions, so that load from other
// processes hits every format alike:
//  0. warm-up (untimed): one forward of max(n_prefill, 1) tokens and one decode step on the first
//     cache, then cleared (pages in the weights, sizes the model's scratch buffers);
//  for each depth d (ascending; the caches are reused and filled further):
//  1. fill every cache to d positions:
//     - "real": model::forward over fill tokens in batches of n_batch (a real prefill);
//     - "synthetic": cache::append of K/V rows drawn per layer and channel from N(mean, std),
//       where mean/std are measured on the K/V (after RoPE) of a real prefill of up to 256 tokens
//       of this model (so outlier channels and scales are those of the model), through the same
//       append path the model uses, n_batch rows at a time;
//  2. per format: one untimed decode step at d (warm-up of this cache at this depth); then
//     prefill_repeats rounds in which every format (in a rotating order) runs n_prefill tokens in
//     one forward at positions d.. and truncates back to d; prefill tokens/s = n_prefill / median;
//  3. decode: n_decode + 1 rounds; in each round every format runs one single-token forward at
//     position d + round (formats in a rotating order); round 0 is a warm-up and is not timed;
//     decode tokens/s = 1 / median step time; then every cache is truncated back to d.
// KV bytes are cache::bytes_used() at depth d. Depths whose timed positions go past the model's
// training context (n_ctx_train, or bench_params::n_ctx_train) measure speed only (the row says so).
// Tokens for the fill, prefill and decode come from `tokens` (a text), repeated as needed, or
// are pseudo-random ids when it is empty.
//
// Cache size: n_ctx = bench_params::n_ctx, or (0) the deepest depth + the timed positions
// max(n_decode, n_prefill) + 1 (the + 1: the untimed decode step after a prefill, at every depth
// and in the warm-up). Every depth must leave room for its timed positions, and the caches
// of all formats together (kv_bytes_per_token x n_ctx each) must fit in max_kv_bytes; both are
// checked before any work (bench_check), so a depth that cannot run fails at once instead of
// allocating, filling or swapping for hours.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/certified.h"
#include "kvq/gguf.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"

namespace kvq {

struct bench_params {
  std::vector<kv_cache_params> formats;  // types and options (shapes and n_ctx filled here)
  std::vector<int> depths = {0, 512, 4096};
  int n_decode = 64;     // timed decode steps per (format, depth)
  int n_prefill = 512;   // timed prefill tokens per (format, depth); 0 skips
  int prefill_repeats = 3;  // prefill timings per (format, depth), median reported
  int n_batch = 512;     // fill batch (tokens or synthetic rows per append)
  int n_threads = 0;     // 0: all hardware threads
  std::string fill = "real";  // "real" | "synthetic"
  uint64_t seed = 1234;
  int n_ctx = 0;             // cache positions per format; 0: deepest depth + timed positions
  int n_ctx_train = 0;       // training context for beyond_train_ctx; 0: the model's (GGUF)
  size_t max_kv_bytes = 0;   // limit on all caches together (bytes); 0: none
};

struct bench_row {
  std::string type_k, type_v, describe;
  int sink = 0;                // exact sink tokens (kv_cache_params::sink)
  int exact_recent = 0;        // exact recent tokens (kv_cache_params::exact_recent)
  bool baseline_only = false;  // f16 added for the ratios, not requested
  int depth = 0;
  bool beyond_train_ctx = false;
  double fill_seconds = 0;
  double decode_tokens_per_s = 0;       // 1 / median step
  double decode_tokens_per_s_mean = 0;  // steps / total time
  double decode_ms_median = 0, decode_ms_min = 0, decode_ms_max = 0;
  double prefill_tokens_per_s = 0;      // n_prefill / median time; 0 when skipped
  size_t kv_bytes_used = 0;             // at depth d
  size_t kv_bytes_allocated = 0;
  double kv_bytes_per_token = 0;        // asymptotic (kv_bytes_per_token())
  double decode_speedup_vs_f16 = 0;     // decode tok/s / f16's at the same depth
  double prefill_speedup_vs_f16 = 0;
  double kv_bytes_ratio_vs_f16 = 0;     // f16 bytes_used / this bytes_used at the same depth
};

struct bench_result {
  std::string fill;
  std::string model_desc;  // arch, layers, heads, head_dim, weight type
  int n_threads = 0;
  int n_ctx = 0;           // cache size used (max depth + timed tokens)
  int n_ctx_train = 0;     // training context the rows were marked against
  std::vector<bench_row> rows;  // format-major, depth-minor
  // One report per certified format's cache, in the order of the formats, taken after the
  // deepest depth (append_certified_report, certified.h); empty when no format is certified.
  std::vector<certified_report> certified;
};

// Called with a short description of the step being run ("q4 depth 4096: fill").
using bench_progress = std::function<void(const std::string& what)>;

// Validates `p` for a model whose cache has the shape of `shape` (n_layer, n_kv_head, head_dim;
// its other fields are ignored) and returns the cache n_ctx that bench() allocates. Needs no model,
// so a tool can check before building one. Errors (invalid_input, message starting "[bench]"):
// no formats or depths, unknown type or bad format option, negative depth, a depth whose timed
// positions do not fit n_ctx, caches larger than max_kv_bytes (the message names the depth, the
// limit and the deepest depth that fits), n_decode < 1, n_prefill < 0, prefill_repeats < 1,
// n_batch < 1, unknown fill.
int bench_check(const kv_cache_params& shape, const bench_params& p);

// Errors: those of bench_check (before any work), token ids outside the vocabulary; every message
// starts with "[bench]" (errors of the layers below are re-tagged, keeping their code).
bench_result bench(model& m, std::span<const int32_t> tokens, const bench_params& p,
                   const bench_progress& progress = {});

// ---- synthetic models --------------------------------------------------------------------
struct model_shape {
  std::string name;   // e.g. "qwen3-1.7b"
  std::string arch;   // llama | qwen3 | ...
  int n_layer = 0, n_embd = 0, n_head = 0, n_kv_head = 0, head_dim = 0, n_ff = 0, n_vocab = 0;
  int n_ctx_train = 0;
  float rope_freq_base = 10000.0f;
  bool tied_output = false;
};

// Published shapes (from each model's config.json): llama3-8b, llama3.1-8b, llama3.2-1b, mistral-7b,
// qwen2.5-0.5b, qwen2.5-1.5b (qwen2.5: q/k/v biases, drawn uniform in [-0.5, 0.5]), qwen3-0.6b,
// qwen3-1.7b, qwen3-4b, qwen3-8b.
std::vector<model_shape> model_shapes();
// Throws invalid_input listing the known names.
model_shape find_model_shape(const std::string& name);
// The hyper-parameters model::load reads from make_synthetic_model(shape, ..., n_layer)'s file, without
// writing one, as for f16 weights (n_layer > 0 overrides the shape's): what the GPU runner's random-weight models take
// (cuda::model_runner, kvq/cuda_model.h). invalid_input for n_layer < 0.
model_hparams shape_hparams(const model_shape& shape, int n_layer = 0);

// Writes a GGUF (v3) with this shape and random weights of `weight_type` (f16, q8_0 or q4_0;
// norms f32 = 1) to a temporary file under `tmp_dir` (empty: $TMPDIR or /tmp), loads it with
// model::load and unlinks the file (the mapping stays valid). n_layer > 0 overrides the
// shape's layer count (decode time scales about linearly with it). Weights are uniform with
// variance 1/n_in per output so activations stay O(1). Disk: about n_params * bytes/weight.
// Errors: invalid_input (bad type or n_layer), io (cannot write the temp file).
std::unique_ptr<model> make_synthetic_model(const model_shape& shape, ggml_type weight_type, int n_layer = 0,
                                            uint64_t seed = 42, const std::string& tmp_dir = "");

}  // namespace kvq
