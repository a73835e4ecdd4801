// Activation blocks: a row of x quantized to 8 bits per block, in the format a weight type's
// integer dot expects (its vec_dot_type, as in ggml's CPU type traits). kvq keeps the scales in f32
// (ggml stores q8_0 / q8_1 scales in f16), so activation rounding is the only approximation.
#pragma once
#include <cstdint>

#include "core/weight_types/blocks_kquant.h"
#include "core/weight_types/blocks_legacy.h"

namespace kvq {

// The activation format of a dot product.
enum class act_type {
  f32,   // x used as is (f32 / f16 / bf16 weights)
  q8_0,  // block_q8_x: 32 values, f32 scale (q4_0, q5_0, q8_0, iq4_nl)
  q8_1,  // block_q8_1x: q8_0 plus d * sum(qs), for the minimum term (q4_1, q5_1)
  q8_k,  // block_q8_k: 256 values, f32 scale, 16-value sums (every K-quant and iq4_xs)
  count
};

// One 32-value block: value = d * qs[i], qs in [-127, 127].
struct block_q8_x {
  float d;
  int8_t qs[32];
};
static_assert(sizeof(block_q8_x) == 36, "block_q8_x is 36 bytes");

// q8_1: as block_q8_x plus s = d * sum(qs) (lets q4_1 / q5_1 add m * sum(x) per block).
struct block_q8_1x {
  float d;
  float s;
  int8_t qs[32];
};
static_assert(sizeof(block_q8_1x) == 40, "block_q8_1x is 40 bytes");

// q8_k (ggml block_q8_K): 256 values, f32 scale, bsums[j] = sum of qs[16j .. 16j + 15] (the
// minimum terms of q2_k / q4_k / q5_k and q3_k / q6_k's offsets need only these sums).
struct block_q8_k {
  float d;
  int8_t qs[qk_k];
  int16_t bsums[qk_k / 16];
};
static_assert(sizeof(block_q8_k) == 292, "block_q8_k is 292 bytes");

// Elements and bytes per activation block of each act_type (f32: 1 element, 4 bytes).
int64_t act_block_elems(act_type t);
int64_t act_block_bytes(act_type t);

// Quantizes x[n] (n a multiple of the block size) to blocks of type t at out: per block
// d = amax / 127, qs = round-to-nearest-even(x / d) (d = 0 for an all-zero block), so
// |x - d * qs| <= amax / 254. f32 copies x.
void quantize_act(act_type t, const float* x, int64_t n, void* out);

}  // namespace kvq
