// The model on the GPU (issue 19): every layer of a llama / mistral / qwen2 model runs on one CUDA
// device, its K/V in a paged cache on the device, logits copied back for sampling only.
//  - Weights are uploaded once: every 2-D weight is dequantized on the host by the CPU
//    dequantizers (weight_row_to_f32) and stored in f16; Q/K/V and gate/up are concatenated so a
//    layer runs four products, each one cublasGemmEx (f16 x f16 -> f32, f32 accumulation).
//  - kvq's own kernels do the rest (src/model_cuda/model_kernels.cu): embedding lookup, residual
//    add fused with RMSNorm, bias + RoPE (NORM or NEOX pairs, the CPU engine's inverse frequencies),
//    SwiGLU; activations between products are f16, the residual stream f32.
//  - K channel scale (q8 / q4, on unless cp.k_channel_scale is false): as kv_cache_quant, a
//    sequence's first C = min(channel_calib, n_ctx) positions are kept in f32 staging rows and
//    queries at positions below C attend them exactly; the forward that brings position C - 1
//    calibrates mu / lambda per layer on positions [1, C) (cuda::channel_stats, bit-equal to the
//    CPU's) and stores the staged rows; K is then stored as R((k - mu) / lambda) from f32 rows.
//  - Attention: the fused rotate-quantize-append kernel, the split-KV decode kernel and the tiled
//    causal prefill kernel of kvq/cuda.h over f16, q8 or q4 pages (page size 16). A forward() of
//    >= 64 tokens (a prompt chunk) appends its K/V, then attends through prefill_plan (the chunk's
//    queries against the history and the chunk itself, on the codes); shorter ones, decode steps,
//    every forward with the K channel scale (prefill_plan does not take it yet) and every forward
//    with set_tiled_prefill(false) run the decode kernel with one "sequence" per token: query t
//    attends the pages up to its own position. q8 / q4 queries see every position through its
//    codes, its own batch's too, as the CPU cache does without an exact window (sink 0,
//    exact_recent 0).
//  - KIVI (-ctk kivi4 -ctv q4a / kivi4): kivi4 pages of 32 body positions (position - sink), the
//    sink and the residual in exact f16 rows per (layer, sequence); append_kivi, quantize_kivi_groups
//    for the groups a step completes, then every query (prompt or decode) through the decode kernel
//    with its own exact residual, as the CPU cache's attend (docs/cuda.md "KIVI pages"), one entry
//    per query (a forward() of >= 16 tokens in query tiles with set_kivi_query_tiles); a forward()
//    runs in steps of at most 1024 - sink - (min_tail + 31) tokens; decode() steps as CUDA graphs
//    with set_cuda_graphs (the groups and moves of a step padded to one per sequence).
// Sequences: the runner holds cp.n_seq sequences of up to cp.n_ctx positions each, their pages
// (16 positions of every kv head of one layer) drawn from one pool of n_seq * ceil(n_ctx / 16)
// pages per layer (or cp.n_pages, when smaller: a server's --kv-budget) through a free list, so
// sequences of different lengths share it and a cleared sequence returns its pages. forward() runs tokens of one
// sequence (prefill or one decode token); decode() runs one token of each of several sequences as one batch (batched
// decode, issue 19 point 4): the weight products as one GEMM over the batch, RoPE at each token's own position, append
// and attention per sequence through the page table (one decode-kernel launch for all). Numerics against the CPU
// engine: the products round their inputs to f16 (the CPU keeps f32 activations), so logits differ by rounding;
// tests/cuda/test_cuda_model.cpp states the tolerances per cache type.
//
// Errors: kvq::error(unsupported) "[cuda] not supported: kvq was built without KVQ_BUILD_CUDA"
// (stub build) or "[cuda] no GPU visible ..." when no device is there; check_supported's errors
// for what the GPU path does not run (never a silent substitution).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kvq/kv_cache.h"
#include "kvq/model.h"

namespace kvq {

// Where a tool runs the model: the CPU engine (model::forward) or cuda::model_runner.
enum class compute_device : uint8_t { cpu, cuda, count };
// "cpu" / "cuda"; anything else: invalid_input "[device] unknown device 'x' (supported: cpu, cuda)".
compute_device parse_compute_device(const std::string& name);
const char* compute_device_name(compute_device d);

namespace cuda {

// Validates, on the host and without a GPU (so it works in every build), that the GPU path runs
// model m with cache parameters cp (shapes as model::cache_params fills them) and prefill batches
// of up to max_batch tokens. Throws unsupported, naming the field and value and what is supported:
//  - architectures other than llama, mistral, qwen2; sliding-window layers, logit soft-caps;
//  - cache types other than f16, q8, q4 (K and V the same type) and the KIVI cache -ctk kivi4 with
//    -ctv q4a or kivi4 (K per-channel in groups of 32, exact sink and residual; docs/cuda.md "KIVI
//    pages"; other KIVI types, --kv-kivi-group != 32, an explicit --kv-rot other than none, the
//    channel scales are refused for it), rotations other than none /
//    hadamard (f16: none), a group size other than the default, exact sink / recent windows,
//    the V channel scale (--kv-channel-scale; the K channel scale, on by default for q8 / q4 as on
//    the CPU, runs, with channel_calib <= 8192), certified attention, the dequantize attention path;
//  - head_dim, n_kv_head or GQA ratios the kernels do not take (kvq/cuda.h).
// invalid_input for max_batch < 1, cp.n_ctx < 1 or cp.n_seq < 1.
void check_supported(const model& m, const kv_cache_params& cp, int max_batch);
// The same checks on hyper-parameters alone (a model of a published shape, weights not loaded).
void check_supported(const model_hparams& hp, const kv_cache_params& cp, int max_batch);

// Bytes of one page of the runner's pool over all layers (16 positions of every kv head, K and V,
// codes and scales), on the host without a GPU: what a budget in bytes buys in pages
// (cp.n_pages = budget / this). Throws as check_supported.
size_t runner_page_bytes(const model_hparams& hp, const kv_cache_params& cp);
// Device bytes a runner of (hp, cp, max_batch) keeps for its KV state outside the page pool, on the
// host without a GPU: the K channel scale's staged f32 rows and statistics (cp.n_seq x
// --kv-channel-calib positions, q8 / q4), the exact f16 sink rows, the KIVI exact (sink + residual)
// rows. A --kv-budget pays these first; the pool gets the rest. Throws as check_supported.
size_t runner_fixed_kv_bytes(const model_hparams& hp, const kv_cache_params& cp, int max_batch);

class model_runner {
 public:
  // Checks as check_supported, then needs a GPU (require()), uploads the weights of m and allocates
  // the paged cache (cp.n_seq sequences of up to cp.n_ctx positions; cp.n_pages > 0: a pool of at
  // most that many pages, shared, invalid_input for cp.n_pages < 0) and the activations of
  // max_batch tokens. m must outlive the runner (its hyper-parameters are read; weights are copied).
  model_runner(const model& m, const kv_cache_params& cp, int max_batch);
  // A model of hyper-parameters hp (llama / mistral / qwen2; kvq::shape_hparams gives published
  // shapes) with random weights generated on the device (f16 uniform with variance 1 / n_in per
  // output, norms 1, qwen2 biases U(-0.5, 0.5), from `seed`): for measuring speed at real shapes,
  // which does not depend on the values, without a GGUF file. Checks and errors as above.
  model_runner(const model_hparams& hp, const kv_cache_params& cp, int max_batch, uint64_t seed);
  ~model_runner();
  model_runner(const model_runner&) = delete;
  model_runner& operator=(const model_runner&) = delete;

  // Runs tokens [n] of sequence seq_id at positions pos0 .. pos0 + n - 1 (pos0 must equal
  // n_pos(seq_id)) and appends their K/V. output: [n] nonzero = write that token's logits, empty =
  // the last token only. logits: host [rows, n_vocab] f32 in token order; returns rows. Throws
  // invalid_input (nothing appended) for n == 0, n > max_batch, a token id outside [0, n_vocab),
  // seq_id outside [0, n_seq), pos0 != n_pos(seq_id), pos0 + n > n_ctx, an output span of another
  // length, more new pages than the pool has free ("[cuda model] the page pool is full ...");
  // invalid_input "[cuda model] non-finite logits ..." when a written logit is NaN/Inf (the cache
  // then holds the batch).
  int forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output, float* logits,
              int seq_id = 0);

  // One decode step of n = seq_ids.size() distinct sequences: tokens[i] at position
  // n_pos(seq_ids[i]) of sequence seq_ids[i], in one batch. logits: host [n][n_vocab] f32 or
  // nullptr (not copied back); argmax: host [n], the first index of each row's largest logit
  // (greedy sampling on the device; only n ids cross to the host), or nullptr. Throws
  // invalid_input (nothing appended) for n == 0, n > max_batch, spans of different lengths, a
  // repeated or out-of-range sequence id, a token id outside the vocabulary, a sequence already
  // holding n_ctx positions, more new pages than the pool has free; invalid_input "[cuda model] non-finite logits ..." when a row holds
  // NaN/Inf (checked on the device when only argmax is asked for).
  void decode(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens, float* logits, int32_t* argmax);

  // One step of a server's continuous batching: decode rows and a prompt piece in one pass over the
  // layers (one embedding, norm, RoPE, append and activation kernel per layer for all rows).
  // tokens / seq_ids [n]: rows [0, n_decode) one token each of distinct sequences at their next
  // position (as decode()), rows [n_decode, n) a piece of one other sequence continuing what it
  // holds (as forward()); output [n - n_decode]: the piece's flags (empty: its last token). Every
  // row's result equals what decode() and forward() return run apart, bit for bit: the weight
  // products run as two GEMMs (the decode rows, the piece's rows: each the row count it has apart, so
  // cuBLAS picks the same kernel) and each part's attention through the plan it gets apart (the
  // decode kernel's plan over the decode rows; the piece's prefill or per-token plan); the other
  // kernels work row by row. logits: host [rows][n_vocab], the decode rows then the piece's output
  // rows; argmax: nullptr or host [n_decode]: the decode rows' greedy ids (as decode()) and then only
  // the piece's rows of `logits` are written. Returns the rows (n_decode + the piece's output rows).
  // Not one pass (decode() then forward(), the same results): KIVI (its prompt steps and their
  // exact residual rows are per sequence). n_decode == 0: forward(). Throws invalid_input (nothing appended)
  // for what decode() and forward() refuse, n > max_batch, n_decode outside [0, n), a second
  // sequence among the piece's rows or the piece's sequence among the decode rows.
  int step(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens, int n_decode,
           std::span<const uint8_t> output, float* logits, int32_t* argmax);

  // CUDA graphs for decode() and step() (off by default): a step's ~11 launches per layer (a mixed
  // step's ~17) are captured into one graph and replayed with one launch. One graph per step shape
  // (rows, decode rows, output rows, argmax or not, staged / paged parts, tiled piece; at most 64
  // shapes whose attention plans hold at most 256 MiB of workspace, the least recently used dropped); a shape's first step runs directly and its second is
  // captured (capturing and instantiating cost more than a direct step). All its buffers are fixed and its tables are rewritten
  // in place before each step, so a step of a shape seen before replays its graph as it is when the
  // plans keep their launch (decode_plan::update / prefill_plan::update: same work-item counts);
  // otherwise the step is captured anew and applied with cudaGraphExecUpdate (instantiated again
  // when that is refused). A step that calibrates the K channel scale runs directly. In a captured
  // mixed step the piece's products and attention run on a second stream beside the decode rows'
  // (parallel branches). Same kernels, same results as without (with set_batch_invariant; without
  // it a replayed decode plan keeps the split-KV items of the step it was captured in).
  void set_cuda_graphs(bool on);
  bool cuda_graphs() const;

  // Prompt attention (on by default): a forward() of >= 64 tokens attends through the tiled prefill
  // kernel (cuda::prefill_plan); off, through the decode kernel with one "sequence" per token (the
  // former path, kept as the benchmark's baseline). Same positions, same codes; the outputs differ
  // by float summation order only.
  void set_tiled_prefill(bool on);
  bool tiled_prefill() const;
  // prompt chunks that took the tiled path: the tiled prefill kernel, or, when every query of the
  // chunk is below the K channel scale's window, staged_attention alone (KIVI: the query tiles)
  int tiled_prefills() const;
  // KIVI prompt chunks (>= 16 tokens of one sequence) through the query tiles (decode_params::
  // kivi_tiles) when on and set_tiled_prefill is on; off by default: the per-query decode kernel on
  // the tensor cores is faster at every prompt length measured (docs/perf.md "KIVI prefill").
  void set_kivi_query_tiles(bool on);

  // Batch-invariant decode attention (off by default; the server turns it on): every decode plan
  // cuts a sequence's keys into split-KV items of 256 tokens, so a row's attention, and with it its
  // bits, depends on its own sequence only. Off, the plan sizes the items from the whole batch (the
  // longest sequence and the number of items against the GPU's slots: FlashDecoding's split-KV), which
  // keeps a lone long sequence's blocks busy but lets a row's summation order follow its neighbours.
  void set_batch_invariant(bool on);
  bool batch_invariant() const;
  int graph_instantiations() const;  // times a graph was instantiated (not merely updated)
  int graph_captures() const;        // steps captured (the other graph steps were replays)

  // Where the last step's time went (set_step_profile(true); off by default: two CUDA events per
  // step), host wall milliseconds from the entry into the runner's pass (after the argument checks):
  // prep, its tables and attention plans (decode_plan / prefill_plan construction, uploads queued);
  // launch, issuing its kernels and products (or the graph: capture, update, launch); finish, from
  // the last launch until the results are on the host (the wait on the GPU and the copies back).
  // gpu: CUDA event time on the runner's stream from before the tables' uploads to after the last
  // kernel (the device's span; it includes gaps where the GPU waited for the host's launches).
  struct step_profile {
    double prep_ms = 0, launch_ms = 0, finish_ms = 0, gpu_ms = 0;
  };
  void set_step_profile(bool on);
  step_profile last_step_profile() const;

  // Benchmark aid: appends n_tokens rows of random K/V (uniform in [-2, 2], from seed) to every layer
  // of sequence seq_id at positions n_pos(seq_id) .. + n_tokens - 1 through the same fused append
  // kernel as forward(), without running the model: a cache filled to depth D in milliseconds
  // instead of D forward steps (decode speed does not depend on the values). invalid_input for
  // seq_id outside [0, n_seq), n_tokens < 0 or n_pos + n_tokens > n_ctx.
  void fill_synthetic(int seq_id, int n_tokens, uint64_t seed);

  void clear();                 // forgets every position of every sequence (the pages are reused)
  void clear_seq(int seq_id);   // forgets sequence seq_id (its pages return to the pool)
  int n_pos(int seq_id = 0) const;  // positions stored in sequence seq_id
  int n_ctx() const;                // positions one sequence may hold
  int n_seq() const;
  int max_batch() const;
  std::string describe() const;  // e.g. "q4/q4 (hadamard, g32), 16-token pages, on NVIDIA H200 ..."
  size_t kv_bytes() const;       // bytes of the device page pool (all layers) and, with the K channel
                                 // scale, the staging rows and mu / lambda of every sequence
  size_t kv_bytes_used() const;  // bytes of the pages in use by all sequences (all layers)
  size_t kv_bytes_per_page() const;  // one page of every layer (16 positions of every kv head)
  // The pool (as kv_cache::page_info): page_size 16, n_pages, n_free, n_seq_held (pages in use),
  // max_pages_per_seq (ceil(n_ctx / 16)), page_bytes = kv_bytes_per_page(). A sequence of n
  // positions holds ceil(n / 16) pages.
  kv_page_info page_info() const;
  size_t weight_bytes() const;   // bytes of the uploaded weights

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace cuda
}  // namespace kvq
