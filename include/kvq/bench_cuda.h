// Decode speed of the model on the GPU (kvq bench --device cuda): batched decode steps of B
// sequences at depth D through cuda::model_runner (kvq/cuda_model.h), beside the byte bound of the
// step measured in the same run, and the number of sequences of a long context each cache type fits.
//
// Protocol, per (format, batch B, depth D), formats interleaved per (B, D), one runner each (its
// weights regenerated on the device, or uploaded from the model):
//  1. fill: every sequence b < B gets D positions of random K/V in every layer
//     (model_runner::fill_synthetic: the fused append kernel on uniform values, no forward pass);
//  2. n_warmup untimed decode steps, then n_decode timed ones; a step is model_runner::decode of one
//     token per sequence with greedy ids back to the host (the next step's tokens), so it includes
//     the host page table, the decode plan, the table uploads and the argmax copy; the host clock
//     around each call (decode returns after the copy); step time = median, tok/s = B / median.
// Byte bound of a step: (weights read per step + KV pages attended) / copy bandwidth, where the
// weights read are every matrix but the embedding table of an untied model (B rows of it only:
// negligible) and the KV pages are those of the B sequences at depth D + 1 (pages x bytes per page);
// the copy bandwidth is cuda::copy_bandwidth (bytes read + written, device-to-device) measured at the
// start of the run. x bound = median / bound.
// Capacity (capacity_ctx > 0), per format: the largest N such that N sequences of capacity_ctx
// positions (+ the timed steps) fit in the device memory left after the weights and a reserve of
// activations and workspaces; a runner of N such sequences is allocated, filled and decoded at
// batch N (the row with capacity = true proves that they fit and run).
// Prefill (prefill_depths), per (prompt length P, format): one runner of one sequence of P
// positions; one untimed forward of a chunk, then the prompt of P random tokens as forward() calls
// of prefill_chunk tokens (logits of the last token only, copied back), timed on the host clock
// from the first call to the return of the last, first with the tiled prefill kernel
// (model_runner::set_tiled_prefill(true)), then, for P <= prefill_per_token_max, the same runner
// cleared and the same prompt through the decode kernel with one "sequence" per token (the former
// path); tok/s = P / seconds. The two paths' last logits are compared (rel RMS) as a check that
// both ran the same model.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/model.h"

namespace kvq {

struct bench_cuda_params {
  std::vector<kv_cache_params> formats;    // GPU cache types (f16, q8, q4; see cuda::check_supported)
  std::vector<int> batches = {1};          // sequences per decode step
  std::vector<int> depths = {4096};        // positions each sequence holds before the timed steps
  int n_decode = 16;                       // timed steps (median)
  int n_warmup = 2;                        // untimed steps before them
  int capacity_ctx = 0;                    // > 0: also measure how many sequences of this context fit
  size_t reserve_bytes = size_t(3) << 30;  // device memory kept free beside the cache in the capacity rows
  uint64_t seed = 1234;
  // also time the same runner's steps as CUDA graphs (model_runner::set_cuda_graphs), right after
  // the direct steps (n_warmup + n_decode more positions): the graph_* fields
  bool graphs = false;
  std::vector<int> prefill_depths;     // prompt lengths whose prefill is timed (empty: none)
  int prefill_chunk = 512;             // tokens per forward() of a prompt
  int prefill_per_token_max = 1 << 30; // the per-token baseline only for prompts up to this length
};

struct bench_cuda_prefill_row {
  std::string type, describe;
  int prompt = 0, chunk = 0;
  double tiled_seconds = 0, tiled_tokens_per_s = 0;
  double per_token_seconds = 0, per_token_tokens_per_s = 0;  // 0: not measured
  double speedup = 0;           // tiled_tokens_per_s / per_token_tokens_per_s (0: not measured)
  double logits_rel_rms = -1;   // last logits, tiled vs per-token: RMS(diff) / RMS(per-token) (-1: not measured)
};

struct bench_cuda_row {
  std::string type;  // cache type name (K = V)
  std::string describe;
  int batch = 0, depth = 0;
  bool capacity = false;  // a capacity row: batch = the most sequences of depth capacity_ctx that fit
  double fill_seconds = 0;
  double step_ms_median = 0, step_ms_min = 0, step_ms_max = 0;
  double tokens_per_s = 0;       // batch / median step
  size_t weight_bytes_read = 0;  // per step
  size_t kv_bytes_read = 0;      // pages attended in one step
  size_t kv_bytes_allocated = 0;
  double bound_ms = 0;        // (weight_bytes_read + kv_bytes_read) / copy bandwidth
  double x_bound = 0;         // step_ms_median / bound_ms
  double speedup_vs_f16 = 0;  // tokens_per_s / f16's at the same (batch, depth); 0 without an f16 row
  double graph_ms_median = 0;  // with CUDA graphs (0: not measured)
  double graph_x_bound = 0;    // graph_ms_median / bound_ms
};

struct bench_cuda_result {
  std::string device;         // cuda::device_name()
  std::string model_desc;     // arch, layers, heads, head_dim, vocab, weights
  double copy_bandwidth = 0;  // bytes/s (read + write)
  size_t mem_total = 0, mem_free_start = 0;
  std::vector<bench_cuda_row> rows;  // (batch, depth)-major, format-minor; capacity rows last
  std::vector<bench_cuda_prefill_row> prefill;  // prompt-major, format-minor
};

// Runs the protocol above on the model of hyper-parameters hp: m's weights when m is set (hp =
// m->hparams()), else random weights (a published shape: shape_hparams, kvq/bench.h). Errors:
// invalid_input "[bench] ..." for empty formats, empty batches / depths without prefill_depths, a
// prefill depth < 1, prefill_chunk < 1, a batch < 1, a depth < 0,
// n_decode < 1, n_warmup < 0, capacity_ctx < 0; cuda::check_supported's errors per format (before
// any work); unsupported "[bench] ..." for a kivi4 format with graphs (the GPU's KIVI steps
// have none); unsupported "[cuda] ..." without a GPU; the runner's errors (out of device memory).
bench_cuda_result bench_cuda(const model_hparams& hp, const model* m, const bench_cuda_params& p,
                             const std::function<void(const std::string&)>& progress = {});

}  // namespace kvq
