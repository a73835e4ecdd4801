// Private FWHT tiers behind kvq::fwht_radix2 (include/kvq/rotation.h).
#pragma once

namespace kvq {

// Scalar oracle: orthonormal in-place FWHT of x[n], n a power of two, Sylvester order.
void fwht_radix2_ref(float* x, int n);
// AVX2 tier for n >= 8 (falls back to the scalar oracle below 8). Same adds/subtracts in the same
// order as the oracle, so results are bit-identical. Call only when best_isa() >= isa::avx2.
void fwht_radix2_avx2(float* x, int n);

}  // namespace kvq
