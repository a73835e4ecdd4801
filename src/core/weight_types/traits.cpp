// The weight-type traits table: one row per supported GGUF weight type.
#include "core/weight_types/traits.h"

#include "core/matmul_kernels.h"
#include "core/weight_types/dequant_ref.h"
#include "core/weight_types/dot_ref.h"
#include "core/weight_types/dot_simd.h"

namespace kvq {

namespace {

using detail::matmul_rows_avx2;
using detail::matmul_rows_avx512;
using detail::matmul_rows_float_scalar;
using detail::matmul_rows_vec_dot;

// Quantized types whose tiers differ only in the dot: the generic matrix-matrix loop over vec_dot.
// The 32-value symmetric types (q4_0, q5_0, q8_0, iq4_nl) and q4_k, q5_k, q6_k have their SIMD tiers
// in the rows kernels (matmul_simd.inc, matmul_kquant.inc: 4 rows at a time for decode, rows x
// tokens tiles for prefill), which return the reference dot's bits; their vec_dot stays the
// reference on every tier.
#define KVQ_ROWS_VEC_DOT {matmul_rows_vec_dot, matmul_rows_vec_dot, matmul_rows_vec_dot}
#define KVQ_ROWS_TILED {matmul_rows_vec_dot, matmul_rows_avx2, matmul_rows_avx512}

// clang-format off
const weight_type_traits k_rows[] = {
  // type               blk  bytes vec_dot_type    to_float          vec_dot {scalar, avx2, avx512}                                  rows
  {ggml_type::f32,      1,    4, act_type::f32,  to_float_f32,     {nullptr, nullptr, nullptr},                                    {matmul_rows_float_scalar, matmul_rows_avx2, matmul_rows_avx512}},
  {ggml_type::f16,      1,    2, act_type::f32,  to_float_f16,     {nullptr, nullptr, nullptr},                                    {matmul_rows_float_scalar, matmul_rows_avx2, matmul_rows_avx512}},
  {ggml_type::bf16,     1,    2, act_type::f32,  to_float_bf16,    {nullptr, nullptr, nullptr},                                    {matmul_rows_float_scalar, matmul_rows_avx2, matmul_rows_avx512}},
  {ggml_type::q4_0,    32,   18, act_type::q8_0, to_float_q4_0,    {vec_dot_q4_0_ref, vec_dot_q4_0_ref, vec_dot_q4_0_ref},         KVQ_ROWS_TILED},
  {ggml_type::q4_1,    32,   20, act_type::q8_1, to_float_q4_1,    {vec_dot_q4_1_ref, vec_dot_q4_1_avx2, vec_dot_q4_1_avx512},         KVQ_ROWS_VEC_DOT},
  {ggml_type::q5_0,    32,   22, act_type::q8_0, to_float_q5_0,    {vec_dot_q5_0_ref, vec_dot_q5_0_ref, vec_dot_q5_0_ref},         KVQ_ROWS_TILED},
  {ggml_type::q5_1,    32,   24, act_type::q8_1, to_float_q5_1,    {vec_dot_q5_1_ref, vec_dot_q5_1_avx2, vec_dot_q5_1_avx512},         KVQ_ROWS_VEC_DOT},
  {ggml_type::q8_0,    32,   34, act_type::q8_0, to_float_q8_0,    {vec_dot_q8_0_ref, vec_dot_q8_0_ref, vec_dot_q8_0_ref},         KVQ_ROWS_TILED},
  {ggml_type::iq4_nl,  32,   18, act_type::q8_0, to_float_iq4_nl,  {vec_dot_iq4_nl_ref, vec_dot_iq4_nl_ref, vec_dot_iq4_nl_ref},   KVQ_ROWS_TILED},
  {ggml_type::q2_k,   256,   84, act_type::q8_k, to_float_q2_k,    {vec_dot_q2_k_ref, vec_dot_q2_k_avx2, vec_dot_q2_k_avx512},         KVQ_ROWS_VEC_DOT},
  {ggml_type::q3_k,   256,  110, act_type::q8_k, to_float_q3_k,    {vec_dot_q3_k_ref, vec_dot_q3_k_avx2, vec_dot_q3_k_avx512},         KVQ_ROWS_VEC_DOT},
  {ggml_type::q4_k,   256,  144, act_type::q8_k, to_float_q4_k,    {vec_dot_q4_k_ref, vec_dot_q4_k_ref, vec_dot_q4_k_ref},         KVQ_ROWS_TILED},
  {ggml_type::q5_k,   256,  176, act_type::q8_k, to_float_q5_k,    {vec_dot_q5_k_ref, vec_dot_q5_k_ref, vec_dot_q5_k_ref},         KVQ_ROWS_TILED},
  {ggml_type::q6_k,   256,  210, act_type::q8_k, to_float_q6_k,    {vec_dot_q6_k_ref, vec_dot_q6_k_ref, vec_dot_q6_k_ref},         KVQ_ROWS_TILED},
  {ggml_type::iq4_xs, 256,  136, act_type::q8_k, to_float_iq4_xs,  {vec_dot_iq4_xs_ref, vec_dot_iq4_xs_avx2, vec_dot_iq4_xs_avx512},   KVQ_ROWS_VEC_DOT},
};
// clang-format on

}  // namespace

const weight_type_traits* find_weight_traits(ggml_type t) {
  for (const weight_type_traits& r : k_rows)
    if (r.type == t) return &r;
  return nullptr;
}

const std::string& supported_weight_type_names() {
  static const std::string names = [] {
    std::string s;
    for (const weight_type_traits& r : k_rows) s += (s.empty() ? "" : ", ") + std::string(ggml_type_name(r.type));
    return s;
  }();
  return names;
}

}  // namespace kvq
