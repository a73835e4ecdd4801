// Private: the per-ISA row kernels behind kvq::matmul.
//
// Numerics per weight type (the traits row's vec_dot_type, weight_types/act_blocks.h):
//   f32, f16, bf16: weights widened to f32 in registers, x stays f32, f32 FMA accumulation.
//   quantized:      x is quantized per token to 8-bit blocks (q8_0 / q8_1: 32 values, q8_k: 256
//                   values; f32 scale, round to nearest even), then integer block dot products
//                   scaled in f32 (ggml's vec_dot scheme). The error against exact math is bounded
//                   by sum_i |w_i| * amax(x block)/254 plus f32 rounding. Every SIMD tier returns
//                   the scalar tier's bits (the reference dots' order, dot_ref.h), for decode and
//                   for any prefill batch.
#pragma once
#include <cstdint>
#include <vector>

#include "core/weight_types/traits.h"
#include "kvq/cpu.h"
#include "kvq/matmul.h"

namespace kvq::detail {

// Everything a row kernel needs: rows [r0, r1) of y for all tokens.
struct matmul_task {
  weight_view w;             // by value: a view
  const float* x;            // [n_tokens, n_in]
  const void* xq;            // [n_tokens, xq_row_bytes] activations in vec_dot_type (null for f32)
  size_t xq_row_bytes;       // bytes of one token's quantized activations
  vec_dot_fn dot;            // the tier's dot for w.type (null for f32 types)
  int64_t n_tokens;
  float* y;                  // [n_tokens, n_out]
};

void matmul_rows_float_scalar(const matmul_task& task, int64_t r0, int64_t r1);  // f32/f16/bf16
void matmul_rows_vec_dot(const matmul_task& task, int64_t r0, int64_t r1);  // any type with a dot
// f32/f16/bf16 and the 32-value symmetric types (q4_0, q5_0, q8_0, iq4_nl) against q8_0
// activations; needs AVX2+FMA+F16C.
void matmul_rows_avx2(const matmul_task& task, int64_t r0, int64_t r1);
void matmul_rows_avx512(const matmul_task& task, int64_t r0, int64_t r1);  // + AVX-512 VNNI

// matmul on an explicit tier (tests and benchmarks; matmul() uses best_isa()). A tier above what
// the CPU supports raises errc::unsupported.
void matmul_with_isa(isa tier, const weight_view& w, const float* x, int64_t n_tokens, float* y,
                     thread_pool& pool);

}  // namespace kvq::detail
