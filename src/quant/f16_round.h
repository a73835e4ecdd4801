// Private: in-place rounding of f32 values to the nearest binary16 value (round-half-even), the
// same as f16_to_f32(f32_to_f16(x)) for finite x; F16C when the CPU has it.
#pragma once
#include <cstddef>

namespace kvq {

void round_to_f16_n(float* x, size_t n);
void round_to_f16_n_avx2(float* x, size_t n);  // call only after runtime dispatch

}  // namespace kvq
