#include "runtime/forward_engine.h"

#include <algorithm>

#include "kvq/cuda.h"

namespace kvq {

void forward_engine_check(const model& m, const kv_cache_params& cp, compute_device d, int max_batch) {
  if (d == compute_device::cuda) cuda::check_supported(m, cp, max_batch);
  validate(cp);
  if (d == compute_device::cuda) cuda::require();  // before a command reads and tokenizes its text
}

forward_engine::forward_engine(model& m, const kv_cache_params& cp, compute_device d, int max_batch)
    : m_(m), device_(d) {
  if (d == compute_device::cuda) {
    runner_ = std::make_unique<cuda::model_runner>(m, cp, max_batch);
    runner_->set_cuda_graphs(true);  // decode steps (below) replay one graph
  } else {
    cache_ = make_kv_cache(cp);
  }
}

forward_engine::~forward_engine() = default;

int forward_engine::forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output,
                            float* logits, thread_pool& pool) {
  const bool masked = std::find_if(output.begin(), output.end(), [](uint8_t o) { return o != 0; }) != output.end();
  if (runner_) {
    // a decode step (one token whose logits are wanted) through decode(): the runner's CUDA graph
    if (tokens.size() == 1 && (output.empty() || masked) && pos0 == runner_->n_pos(0)) {
      const int32_t seq = 0;
      runner_->decode(std::span<const int32_t>(&seq, 1), tokens, logits, nullptr);
      return masked ? 1 : 0;
    }
    const int rows = runner_->forward(tokens, pos0, masked ? output : std::span<const uint8_t>{}, logits);
    return masked ? rows : 0;
  }
  if (!masked) {
    m_.forward(tokens, pos0, 0, *cache_, pool, logits, false);
    return 0;
  }
  const int n = (int)tokens.size();
  pos_.resize(n);
  seq_.assign(n, 0);
  for (int t = 0; t < n; ++t) pos_[t] = pos0 + t;
  return m_.forward(model_batch{tokens, pos_, seq_, output}, *cache_, pool, logits);
}

void forward_engine::clear() {
  if (runner_) runner_->clear();
  else cache_->clear(0);
}

std::string forward_engine::describe() const { return runner_ ? runner_->describe() : cache_->describe(); }

std::string forward_engine::attn_tier() const {
  return runner_ ? "cuda (fused paged decode kernel, kvq/cuda.h)" : kv_attn_tier(cache_->params());
}

size_t forward_engine::kv_bytes() const { return runner_ ? runner_->kv_bytes() : cache_->bytes(); }
size_t forward_engine::kv_bytes_used() const { return runner_ ? runner_->kv_bytes_used() : cache_->bytes_used(); }

}  // namespace kvq
