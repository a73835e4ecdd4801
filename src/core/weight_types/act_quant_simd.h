// SIMD activation quantizer: the same contract and bits as quantize_act (act_blocks.h) for finite
// x; q8_0 and q8_k blocks in AVX2 (the matmul's AVX2 and AVX-512 tiers), the rest by quantize_act.
// Needs AVX2 (call after runtime dispatch).
#pragma once
#include <cstdint>

#include "core/weight_types/act_blocks.h"

namespace kvq {

void quantize_act_avx2(act_type t, const float* x, int64_t n, void* out);

}  // namespace kvq
