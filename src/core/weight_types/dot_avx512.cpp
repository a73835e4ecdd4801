// AVX-512 VNNI tier of the K-quant dots: the AVX2 kernels with VPDPBUSD for the u8 x s8 sums.
#include "core/weight_types/dot_simd.h"
#define KVQ_DOT_SUFFIX avx512
#define KVQ_DOT_VNNI 1
#include "core/weight_types/dot_simd.inc"
