// Test hook of the AVX-512 (VL + VNNI) tier (qk_engine_dots_avx512, attn_quant_tiers.h): the scorers
// of attn_quant_simd.inc built apart from attn_quant_avx512.cpp, whose object code they leave unchanged.
#define KVQ_TIER avx512
#define KVQ_TIER_HOOKS
#include "kernels/attn_quant_simd.inc"
