// Reference (scalar) dot products of one weight row with one activation row quantized to the
// type's vec_dot_type (act_blocks.h): integer products per block, then f32 scaling, as llama.cpp's
// ggml_vec_dot_*_generic (q4_0, q5_0, q8_0, iq4_nl: its x86 order, below). n: elements (a whole
// number of weight blocks). These are the oracle the AVX2 / AVX-512 tiers equal bit for bit.
//   legacy x q8_0:  8 f32 lanes, lane j = sum_b fma(d_w * d_x, sum_{i=4j..4j+3} q_i x_i), hsum
//   q4_1 / q5_1:    sum_b (d_w * d_x) * sum_i q_i x_i + m_w * s_x
//   K-quants:       sum_B d_x * (d * sum_j sc_j sum_i q_i x_i - dmin * sum_j m_j bsum_j)
#pragma once
#include <cstdint>

namespace kvq {

float vec_dot_q4_0_ref(int64_t n, const void* w, const void* x);
float vec_dot_q4_1_ref(int64_t n, const void* w, const void* x);
float vec_dot_q5_0_ref(int64_t n, const void* w, const void* x);
float vec_dot_q5_1_ref(int64_t n, const void* w, const void* x);
float vec_dot_q8_0_ref(int64_t n, const void* w, const void* x);
float vec_dot_iq4_nl_ref(int64_t n, const void* w, const void* x);
float vec_dot_q2_k_ref(int64_t n, const void* w, const void* x);
float vec_dot_q3_k_ref(int64_t n, const void* w, const void* x);
float vec_dot_q4_k_ref(int64_t n, const void* w, const void* x);
float vec_dot_q5_k_ref(int64_t n, const void* w, const void* x);
float vec_dot_q6_k_ref(int64_t n, const void* w, const void* x);
float vec_dot_iq4_xs_ref(int64_t n, const void* w, const void* x);

// Unpacks legacy block k of a row to 32 int8 quants and its scale (and minimum; 0 for the
// symmetric types). Used by the reference dots and the 32-value SIMD tile kernels' scalar tails.
void unpack_q4_0(const void* row, int64_t k, int8_t* q, float* d, float* m);
void unpack_q4_1(const void* row, int64_t k, int8_t* q, float* d, float* m);
void unpack_q5_0(const void* row, int64_t k, int8_t* q, float* d, float* m);
void unpack_q5_1(const void* row, int64_t k, int8_t* q, float* d, float* m);
void unpack_q8_0(const void* row, int64_t k, int8_t* q, float* d, float* m);
void unpack_iq4_nl(const void* row, int64_t k, int8_t* q, float* d, float* m);

}  // namespace kvq
