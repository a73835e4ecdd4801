// Weight matrices kept in their stored GGUF format (no f32 copy of quantized weights) and the
// products the model needs. Layout follows ggml: a 2-D weight has ne = {n_in, n_out}; row r
// (n_in contiguous elements, in blocks of the type) produces output r.
#pragma once
#include <cstdint>
#include <string>

#include "kvq/gguf.h"
#include "kvq/thread_pool.h"

namespace kvq {

// A view of a 2-D weight in its stored format. Supported types (one traits row each,
// src/core/weight_types/traits.cpp): f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_k,
// q3_k, q4_k, q5_k, q6_k, iq4_xs, with llama.cpp's block layouts (ggml-common.h).
struct weight_view {
  ggml_type type = ggml_type::f32;
  int64_t n_in = 0;    // ne[0]
  int64_t n_out = 0;   // ne[1]
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
  std::string name;
};

// Builds a view of `t` (1-D tensors give n_out = 1), checking the type is supported
// (errc::unsupported naming tensor, shape, type and the supported list; unknown type ids too),
// that it is 1-D or 2-D, that ne[0] is a multiple of the type's block size and that the byte size
// equals what the type and shape need (invalid_input naming tensor, type, shape and both sizes).
weight_view make_weight_view(const gguf_tensor_info& t);

// y[t, r] = sum_i W[r, i] * x[t, i]   for t < n_tokens, r < n_out.
// x: [n_tokens, n_in] f32, y: [n_tokens, n_out] f32 (must not alias x). Threads over output rows
// (products under ~128K multiply-adds stay on the calling thread: handing off costs more).
// SIMD tier chosen at run time (cpu.h: AVX-512 VNNI, AVX2+FMA+F16C, else scalar; KVQ_ISA lowers it).
// Numerics: f32/f16/bf16 weights are widened to f32 and accumulated in f32 with x kept in f32
// (register-tiled kernels; measured as fast as OpenBLAS sgemm for prefill, so BLAS is not used).
// Quantized types: x is quantized once per call and token to the type's activation blocks (its
// vec_dot_type, as llama.cpp: q8_0 for q4_0/q5_0/q8_0/iq4_nl, q8_1 for q4_1/q5_1, q8_k (256
// values) for the K-quants and iq4_xs; f32 scales) and the block dot products are integer, scaled
// in f32; error <= sum_i |W[r,i]| * amax(x block)/254 plus f32 rounding. Prefill (n_tokens > 1)
// reads each weight row once per token chunk and never dequantizes a matrix.
// Allocates only when a thread-local scratch buffer grows.
void matmul(const weight_view& w, const float* x, int64_t n_tokens, float* y, thread_pool& pool);

// Reference (scalar, float64 accumulation) used by tests.
void matmul_ref(const weight_view& w, const float* x, int64_t n_tokens, float* y);

// Copies row `r` of `w` into out[n_in] as f32 (used for embeddings lookup; a 1-D tensor is one
// row). Throws invalid_input when r is out of range.
void weight_row_to_f32(const weight_view& w, int64_t r, float* out);

}  // namespace kvq
