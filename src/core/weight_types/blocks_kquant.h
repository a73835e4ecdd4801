// K-quant (256-element super-block) GGUF weight blocks: llama.cpp's layouts (ggml-common.h), byte
// for byte. A super-block holds 8 or 16 sub-blocks, each with its own scale (and, for q2_k / q4_k /
// q5_k, its own minimum), themselves quantized against the f16 super-block scales d / dmin:
//   value = d * sc[j] * q - dmin * m[j]          (q2_k, q4_k, q5_k: "scale and minimum")
//   value = d * sc[j] * q                        (q3_k, q6_k, iq4_xs: signed q, no minimum)
#pragma once
#include <cstdint>

namespace kvq {

constexpr int qk_k = 256;        // elements per K-quant super-block
constexpr int k_scale_size = 12; // packed 6-bit scales + minimums of q4_k / q5_k

// q2_k (type 10): 16 sub-blocks of 16; scales[j] = sc (low nibble) | m (high nibble); q in 0..3.
// qs: 2 halves of 32 bytes; in half h, bits 2s..2s+1 of byte l are element 128h + 32s + l.
struct block_q2_k {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d;
  uint16_t dmin;
};
static_assert(sizeof(block_q2_k) == 84, "q2_k block is 84 bytes");

// q3_k (type 11): 16 sub-blocks of 16, signed 6-bit scales (stored + 32, packed into 12 bytes),
// q = low 2 bits from qs (as q2_k) minus 4 when the hmask bit is clear; hmask bit j of byte l is
// the high bit of element 32j + l.
struct block_q3_k {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
};
static_assert(sizeof(block_q3_k) == 110, "q3_k block is 110 bytes");

// q4_k (type 12): 8 sub-blocks of 32, 6-bit scale and minimum each (packed in 12 bytes, see
// unpack_scale_min_k4); qs: 4 groups of 32 bytes, low nibbles sub-block 2g, high nibbles 2g+1.
struct block_q4_k {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[k_scale_size];
  uint8_t qs[128];
};
static_assert(sizeof(block_q4_k) == 144, "q4_k block is 144 bytes");

// q5_k (type 13): q4_k plus a fifth bit: bit j of qh[l] is the high bit of element 32j + l.
struct block_q5_k {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[k_scale_size];
  uint8_t qh[32];
  uint8_t qs[128];
};
static_assert(sizeof(block_q5_k) == 176, "q5_k block is 176 bytes");

// q6_k (type 14): 16 sub-blocks of 16 with int8 scales; q = (4 low bits | 2 high bits << 4) - 32.
// Two halves of 128 elements; in half h, element 128h + 32s + l takes its low nibble from
// ql[64h + l + 32(s & 1)] (low nibble for s < 2, high for s >= 2) and its high bits from bits
// 2s..2s+1 of qh[32h + l].
struct block_q6_k {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(block_q6_k) == 210, "q6_k block is 210 bytes");

// iq4_xs (type 23): 8 sub-blocks of 32 with 6-bit signed scales (low 4 bits in scales_l, high 2
// bits in scales_h, stored + 32); levels from kvalues_iq4nl; sub-block j uses qs[16j .. 16j + 15]
// (low nibbles elements 0..15, high nibbles 16..31).
struct block_iq4_xs {
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[4];
  uint8_t qs[128];
};
static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs block is 136 bytes");

// Scale and minimum of sub-block j (0..7) of q4_k / q5_k from the 12 packed bytes (llama.cpp
// get_scale_min_k4): j < 4 in the low 6 bits of bytes j / j + 4; j >= 4 split across a nibble of
// byte j + 4 and the top 2 bits of bytes j - 4 / j.
inline void unpack_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Signed 6-bit scale of q3_k sub-block j (0..15), already minus 32.
inline int q3_k_scale(const uint8_t* s, int j) {
  const int lo = (s[j & 7] >> (4 * (j >> 3))) & 0xF;
  const int hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
  return (lo | hi << 4) - 32;
}

// Signed scale of iq4_xs sub-block j (0..7), already minus 32.
inline int iq4_xs_scale(const block_iq4_xs& b, int j) {
  const int lo = (b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF;
  const int hi = (b.scales_h >> (2 * j)) & 3;
  return (lo | hi << 4) - 32;
}

}  // namespace kvq
