// Fused quantized attention, AVX2 tier (placeholder until the SIMD kernel lands).
#include "kernels/attn_quant_tiers.h"

namespace kvq {

void qk_i32_avx2(const kv_quant_side& k, int r0, int n_rows, const int8_t* q8, int hd, int32_t* dots) {
  qk_i32_ref(k, r0, n_rows, q8, hd, dots);
}
bool attn_quant_avx2_supported(const kv_quant_view&) { return false; }
void attn_quant_avx2(const kv_quant_view& kv, const attn_query_view& q, attn_state* states) {
  attn_quant_ref(kv, q, states);
}

}  // namespace kvq
