// Reference dequantizers: y[n] = the values of n elements (a whole number of blocks) stored at v.
// Bit-exact with the gguf Python package's gguf.quants.dequantize (an independent implementation
// of llama.cpp's dequantize_row_*).
#pragma once
#include <cstdint>

#include "core/weight_types/blocks_kquant.h"
#include "core/weight_types/blocks_legacy.h"

namespace kvq {

void to_float_f32(const void* v, float* y, int64_t n);
void to_float_f16(const void* v, float* y, int64_t n);
void to_float_bf16(const void* v, float* y, int64_t n);
void to_float_q4_0(const void* v, float* y, int64_t n);
void to_float_q4_1(const void* v, float* y, int64_t n);
void to_float_q5_0(const void* v, float* y, int64_t n);
void to_float_q5_1(const void* v, float* y, int64_t n);
void to_float_q8_0(const void* v, float* y, int64_t n);
void to_float_iq4_nl(const void* v, float* y, int64_t n);
void to_float_q2_k(const void* v, float* y, int64_t n);
void to_float_q3_k(const void* v, float* y, int64_t n);
void to_float_q4_k(const void* v, float* y, int64_t n);
void to_float_q5_k(const void* v, float* y, int64_t n);
void to_float_q6_k(const void* v, float* y, int64_t n);
void to_float_iq4_xs(const void* v, float* y, int64_t n);

}  // namespace kvq
