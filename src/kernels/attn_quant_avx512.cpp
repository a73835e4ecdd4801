// The AVX-512 (VL + VNNI) tier of the fused attention: attn_quant_simd.inc compiled with the
// AVX-512 flags (CMakeLists.txt), so the integer Q·K dots use VPDPBUSD. Called only when
// best_isa() == isa::avx512.
#define KVQ_TIER avx512
#include "kernels/attn_quant_simd.inc"
