// One sequence's forward passes on the device a command asked for (--device): the CPU engine
// (model::forward over a kv_cache) or the model on the GPU (cuda::model_runner, kvq/cuda_model.h).
// The plumbing that generate, perplexity and eval-passkey share, so that a command gains
// --device cuda by building a forward_engine instead of a kv_cache.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/thread_pool.h"

namespace kvq {

// The checks of forward_engine's constructor without allocating anything: for cuda,
// cuda::check_supported(m, cp, max_batch) (host-only), then validate(cp), then for cuda
// cuda::require() (unsupported "[cuda] not supported ..." / "[cuda] no GPU visible ..."), so a
// command fails before reading and tokenizing its text. Throws as they do.
void forward_engine_check(const model& m, const kv_cache_params& cp, compute_device d, int max_batch);

class forward_engine {
 public:
  // cpu: make_kv_cache(cp); cuda: cuda::model_runner(m, cp, max_batch) (weights uploaded, paged
  // cache allocated; unsupported "[cuda] not supported ..." without CUDA or "[cuda] no GPU
  // visible ..." without a GPU), whose decode steps (a forward of one token with its logits) run
  // as one CUDA graph (model_runner::decode with set_cuda_graphs). cp: shapes as model::cache_params fills them; max_batch >= the
  // tokens of any forward(). m must outlive the engine.
  forward_engine(model& m, const kv_cache_params& cp, compute_device d, int max_batch);
  ~forward_engine();
  forward_engine(const forward_engine&) = delete;
  forward_engine& operator=(const forward_engine&) = delete;

  // Runs tokens [n] of sequence 0 at positions pos0 .. pos0 + n - 1 (pos0 = positions already
  // stored). output: [n] nonzero = write that token's logits, empty (or no flag set) = the last
  // token's only. logits: [rows, n_vocab] f32 in token order; returns the rows written for a
  // non-empty mask with flags set, else 0 (the last token's row is written either way).
  int forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output, float* logits,
              thread_pool& pool);
  void clear();  // forgets every position

  compute_device device() const { return device_; }
  kv_cache* cpu_cache() { return cache_.get(); }  // the CPU cache; nullptr on the GPU
  std::string describe() const;                   // the cache (and, on the GPU, the device)
  std::string attn_tier() const;                  // kv_attn_tier, or the GPU kernels' name
  size_t kv_bytes() const;                        // bytes allocated for K/V
  size_t kv_bytes_used() const;                   // bytes of K/V in use

 private:
  model& m_;
  compute_device device_;
  std::unique_ptr<kv_cache> cache_;              // cpu
  std::unique_ptr<cuda::model_runner> runner_;   // cuda
  std::vector<int32_t> pos_, seq_;               // [n] scratch of a masked CPU batch
};

}  // namespace kvq
