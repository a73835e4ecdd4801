// Private to the GPU model path: the paged format a runner uses (src/model_cuda/check.cpp).
#pragma once
#include "kvq/cuda.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"

namespace kvq::cuda {

// check_supported's checks; returns the device page format (page size 16) for m and cp.
paged_kv_format runner_kv_format(const model_hparams& hp, const kv_cache_params& cp, int max_batch);
// The KIVI part of it (cp.type_k kivi4, cp.type_v q4a or kivi4): kivi4 pages of 32 positions.
paged_kv_format runner_kivi_format(const model_hparams& hp, const kv_cache_params& cp);

// What a runner of (hp, cp, max_batch) keeps besides its page pool, on the host without a GPU (the
// runner's init and the server's --kv-budget both read it, so they cannot disagree).
struct runner_state_layout {
  int cal_n = 0;        // K channel scale: positions staged before calibration (0: none)
  int sink = 0;         // exact sink positions per sequence (q8 / q4 / KIVI)
  int kv_min_tail = 0;  // KIVI: exact residual rows kept at least
  int kv_chunk = 0;     // KIVI: rows one step adds to a sequence at most
  int kv_cap = 0;       // KIVI: exact rows per sequence (sink + residual + one step's rows)
  size_t fixed_bytes = 0;  // device bytes of the staging rows + channel statistics, the sink rows, the KIVI exact rows
};
runner_state_layout runner_layout(const model_hparams& hp, const kv_cache_params& cp, int max_batch);

}  // namespace kvq::cuda
