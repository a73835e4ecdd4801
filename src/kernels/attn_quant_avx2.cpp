// The AVX2 tier of the fused attention (and the dense views): see attn_quant_simd.inc.
#define KVQ_TIER avx2
#include "kernels/attn_quant_simd.inc"
