// Private: SIMD tiers of the dense attention (called only after runtime dispatch).
#pragma once
#include "kvq/attention.h"

namespace kvq {

bool attn_dense_supported_avx2(const kv_dense_view& kv);
void attn_dense_avx2(const kv_dense_view& kv, const attn_query_view& q, attn_state* states);
// The same engine built for the AVX-512 tier (512-bit P·V); called when best_isa() == isa::avx512.
bool attn_dense_supported_avx512(const kv_dense_view& kv);
void attn_dense_avx512(const kv_dense_view& kv, const attn_query_view& q, attn_state* states);

}  // namespace kvq
