// Private: the per-ISA row kernels behind kvq::matmul and the activation quantizer they share.
//
// Numerics per weight type:
//   f32, f16, bf16: weights widened to f32 in registers, x stays f32, f32 FMA accumulation.
//   q8_0, q4_0:     x is quantized per token to q8 blocks (32 int8 + an f32 scale, round to
//                   nearest even, as ggml's vec_dot_type q8_0 but with an f32 scale), then integer
//                   block dot products scaled by d_w * d_x (ggml's q8_0 x q8_0 / q4_0 x q8_0 scheme).
//                   The error against exact math is bounded by sum_i |w_i| * amax(x block)/254.
#pragma once
#include <cstdint>
#include <vector>

#include "core/weight_blocks.h"
#include "kvq/cpu.h"
#include "kvq/matmul.h"

namespace kvq::detail {

// One block of an activation row quantized for the integer dot products.
struct block_q8_x {
  float d;           // scale: value = d * qs[i]
  int8_t qs[qk8_0];  // in [-127, 127]
};
static_assert(sizeof(block_q8_x) == 36, "block_q8_x is 36 bytes");

// x: [n_tokens, n_in] f32 -> out: [n_tokens, n_in / 32] blocks. n_in must be a multiple of 32.
void quantize_x_q8(const float* x, int64_t n_in, int64_t n_tokens, block_q8_x* out);

// Everything a row kernel needs: rows [r0, r1) of y for all tokens.
struct matmul_task {
  weight_view w;             // by value: a view
  const float* x;            // [n_tokens, n_in]
  const block_q8_x* xq;      // [n_tokens, n_in / 32] when w is q8_0 / q4_0, else null
  int64_t n_tokens;
  float* y;                  // [n_tokens, n_out]
};

void matmul_rows_scalar(const matmul_task& task, int64_t r0, int64_t r1);
void matmul_rows_avx2(const matmul_task& task, int64_t r0, int64_t r1);  // needs AVX2+FMA+F16C

// matmul on an explicit tier (tests and benchmarks; matmul() uses best_isa()). A tier above what
// the CPU supports raises errc::unsupported. isa::avx512 runs the AVX2 kernels.
void matmul_with_isa(isa tier, const weight_view& w, const float* x, int64_t n_tokens, float* y,
                     thread_pool& pool);

}  // namespace kvq::detail
