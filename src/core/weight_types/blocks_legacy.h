// Legacy (32-element) GGUF weight blocks: llama.cpp's layouts (ggml-common.h), byte for byte.
// Element order within a block: byte j holds element j in its low nibble and element j + 16 in its
// high nibble (4-bit types); for 5-bit types bit j of qh is the fifth bit of element j.
#pragma once
#include <cstdint>

namespace kvq {

constexpr int qk_legacy = 32;  // elements per legacy block
constexpr int qk8_0 = 32;
constexpr int qk4_0 = 32;

// q4_0 (GGUF type 2): value = d * (nibble - 8).
struct block_q4_0 {
  uint16_t d;       // f16 scale
  uint8_t qs[16];   // nibbles
};
static_assert(sizeof(block_q4_0) == 18, "q4_0 block is 18 bytes");

// q4_1 (type 3): value = d * nibble + m.
struct block_q4_1 {
  uint16_t d;       // f16 scale
  uint16_t m;       // f16 minimum
  uint8_t qs[16];
};
static_assert(sizeof(block_q4_1) == 20, "q4_1 block is 20 bytes");

// q5_0 (type 6): value = d * ((nibble | qh_bit << 4) - 16).
struct block_q5_0 {
  uint16_t d;
  uint8_t qh[4];    // fifth bits, little-endian u32: bit j for element j
  uint8_t qs[16];
};
static_assert(sizeof(block_q5_0) == 22, "q5_0 block is 22 bytes");

// q5_1 (type 7): value = d * (nibble | qh_bit << 4) + m.
struct block_q5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(block_q5_1) == 24, "q5_1 block is 24 bytes");

// q8_0 (type 8): value = d * qs[i].
struct block_q8_0 {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(block_q8_0) == 34, "q8_0 block is 34 bytes");

// iq4_nl (type 20): value = d * kvalues_iq4nl[nibble] (a non-linear 16-level grid).
struct block_iq4_nl {
  uint16_t d;
  uint8_t qs[16];
};
static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl block is 18 bytes");

// The iq4_nl / iq4_xs levels (llama.cpp kvalues_iq4nl).
inline constexpr int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                             1,    13,   25,  38,  53,  69,  89,  113};

}  // namespace kvq
