// AVX-512 VNNI tier of the matmul row kernels: the 256-bit kernels with VPDPBUSD block sums.
#define KVQ_MATMUL_ROWS matmul_rows_avx512
#define KVQ_MATMUL_VNNI 1
#include "core/matmul_simd.inc"
