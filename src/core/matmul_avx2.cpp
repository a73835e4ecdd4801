// AVX2 + FMA + F16C tier of the matmul row kernels (compiled with -mavx2 -mfma -mf16c).
#define KVQ_MATMUL_ROWS matmul_rows_avx2
#define KVQ_MATMUL_VNNI 0
#include "core/matmul_simd.inc"
