// Test hook of the AVX2 tier (qk_engine_dots_avx2, attn_quant_tiers.h): the scorers of
// attn_quant_simd.inc built apart from attn_quant_avx2.cpp, whose object code they leave unchanged.
#define KVQ_TIER avx2
#define KVQ_TIER_HOOKS
#include "kernels/attn_quant_simd.inc"
