// Dense attention, AVX2 tier (filled in later; for now it defers to the reference).
#include "kernels/attn_dense_tiers.h"

namespace kvq {

bool attn_dense_avx2_supported(const kv_dense_view&) { return false; }
void attn_dense_avx2(const kv_dense_view& kv, const attn_query_view& q, attn_state* states) {
  attn_dense_ref(kv, q, states);
}

}  // namespace kvq
