// Private: SIMD tiers of the dense attention (called only after runtime dispatch).
#pragma once
#include "kvq/attention.h"

namespace kvq {

bool attn_dense_avx2_supported(const kv_dense_view& kv);
void attn_dense_avx2(const kv_dense_view& kv, const attn_query_view& q, attn_state* states);

}  // namespace kvq
