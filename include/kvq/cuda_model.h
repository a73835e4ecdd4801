// The model on the GPU (issue 19): every layer of a llama / mistral / qwen2 model runs on one CUDA
// device, its K/V in a paged cache on the device, logits copied back for sampling only.
//  - Weights are uploaded once: every 2-D weight is dequantized on the host by the CPU
//    dequantizers (weight_row_to_f32) and stored in f16; Q/K/V and gate/up are concatenated so a
//    layer runs four products, each one cublasGemmEx (f16 x f16 -> f32, f32 accumulation).
//  - kvq's own kernels do the rest (src/model_cuda/model_kernels.cu): embedding lookup, residual
//    add fused with RMSNorm, bias + RoPE (NORM or NEOX pairs, the CPU engine's inverse frequencies),
//    SwiGLU; activations between products are f16, the residual stream f32.
//  - Attention: the fused rotate-quantize-append kernel and the split-KV decode kernel of
//    kvq/cuda.h over f16, q8 or q4 pages (page size 16). Prefill runs the decode kernel with one
//    "sequence" per prompt token: query t attends the pages up to its own position (no tiled
//    prefill kernel yet). q8 / q4 queries see every position through its codes, its own batch's
//    too, as the CPU cache does without an exact window (sink 0, exact_recent 0).
// One sequence per runner. Numerics against the CPU engine: the products round their inputs to
// f16 (the CPU keeps f32 activations), so logits differ by rounding; tests/cuda/test_cuda_model.cpp
// states the tolerances per cache type.
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
//  - cache types other than f16, q8, q4 (K and V the same type), rotations other than none /
//    hadamard (f16: none), a group size other than the default, exact sink / recent windows,
//    channel scales (K's is on by default for q8 / q4 on the CPU: pass --kv-k-channel-scale off),
//    certified attention, the dequantize attention path, n_seq != 1;
//  - head_dim, n_kv_head or GQA ratios the kernels do not take (kvq/cuda.h).
// invalid_input for max_batch < 1 or cp.n_ctx < 1.
void check_supported(const model& m, const kv_cache_params& cp, int max_batch);

class model_runner {
 public:
  // Checks as check_supported, then needs a GPU (require()), uploads the weights of m and allocates
  // the paged cache for cp.n_ctx positions of one sequence and the activations of max_batch
  // tokens. m must outlive the runner (its hyper-parameters are read; weights are copied).
  model_runner(const model& m, const kv_cache_params& cp, int max_batch);
  ~model_runner();
  model_runner(const model_runner&) = delete;
  model_runner& operator=(const model_runner&) = delete;

  // Runs tokens [n] at positions pos0 .. pos0 + n - 1 (pos0 must equal n_pos()) and appends their
  // K/V. output: [n] nonzero = write that token's logits, empty = the last token only. logits:
  // host [rows, n_vocab] f32 in token order; returns rows. Throws invalid_input (nothing appended)
  // for n == 0, n > max_batch, a token id outside [0, n_vocab), pos0 != n_pos(), pos0 + n > n_ctx,
  // an output span of another length; invalid_input "[cuda model] non-finite logits ..." when a
  // written logit is NaN/Inf (the cache then holds the batch).
  int forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output, float* logits);

  void clear();       // forgets every position (the pages are reused)
  int n_pos() const;  // positions stored
  int n_ctx() const;
  int max_batch() const;
  std::string describe() const;  // e.g. "q4/q4 (hadamard, g32), 16-token pages, on NVIDIA H200 ..."
  size_t kv_bytes() const;       // bytes of the device page pool (all layers)
  size_t kv_bytes_used() const;  // bytes of the pages holding the n_pos() positions (all layers)
  size_t weight_bytes() const;   // bytes of the uploaded weights

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace cuda
}  // namespace kvq
