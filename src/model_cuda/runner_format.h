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

}  // namespace kvq::cuda
