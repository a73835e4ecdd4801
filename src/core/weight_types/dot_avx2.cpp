// AVX2 tier of the K-quant dots (compiled with -mavx2 -mfma -mf16c; called after runtime dispatch).
#include "core/weight_types/dot_simd.h"
#define KVQ_DOT_SUFFIX avx2
#define KVQ_DOT_VNNI 0
#include "core/weight_types/dot_simd.inc"
