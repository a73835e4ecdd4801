// The format traits table (one row per format) and the code packing of docs/formats.md.
#include <cstring>

#include "kvq/error.h"
#include "kvq/quant.h"

namespace kvq {

namespace {

using F = kv_format;
using L = kv_layout;

// Lloyd-Max levels (quant.h, "non-uniform per-token"), x 127 and rounded: fitted by
// alternating nearest-level codes / least-squares scale / centroid updates on 60,000 groups of 32
// standard Gaussian values (scripts/fit_kv_levels.py prints these tables; docs/formats.md).
constexpr int8_t kLevels4[16] = {-127, -106, -88, -71, -55, -41, -27, -13, 0, 14, 28, 43, 58, 75, 93, 115};
constexpr int8_t kLevels3[8] = {-127, -86, -53, -23, 4, 33, 64, 102};
constexpr int8_t kLevels2[4] = {-127, -47, 17, 85};

// clang-format off
constexpr kv_format_traits kTable[] = {
  // format    name     layout          bits asym  offset max  min   block_bytes         kivi_v  rotate
  {F::f32,   "f32",   L::dense,        32, false,    0,   0,    0, 128,                F::f32,   false},
  {F::f16,   "f16",   L::dense,        16, false,    0,   0,    0, 64,                 F::f16,   false},
  {F::bf16,  "bf16",  L::dense,        16, false,    0,   0,    0, 64,                 F::bf16,  false},
  {F::q8,    "q8",    L::per_token,     8, false,    0, 127, -127, sizeof(block_kv8),  F::q8,    true},
  {F::q4,    "q4",    L::per_token,     4, false,    8,  15,    0, sizeof(block_kv4),  F::q4,    true},
  {F::q3,    "q3",    L::per_token,     3, false,    4,   7,    0, sizeof(block_kv3),  F::q3,    true},
  {F::q2,    "q2",    L::per_token,     2, false,    2,   3,    0, sizeof(block_kv2),  F::q2,    true},
  {F::q8a,   "q8a",   L::per_token,     8, true,  -128, 127, -128, sizeof(block_kv8),  F::q8a,   false},
  {F::q4a,   "q4a",   L::per_token,     4, true,     0,  15,    0, sizeof(block_kv4),  F::q4a,   true},
  {F::q3a,   "q3a",   L::per_token,     3, true,     0,   7,    0, sizeof(block_kv3),  F::q3a,   true},
  {F::q2a,   "q2a",   L::per_token,     2, true,     0,   3,    0, sizeof(block_kv2),  F::q2a,   true},
  {F::kivi8, "kivi8", L::per_channel,   8, true,  -128, 127, -128, sizeof(block_kv8),  F::q8a,   false},
  {F::kivi4, "kivi4", L::per_channel,   4, true,     0,  15,    0, sizeof(block_kv4),  F::q4a,   false},
  {F::kivi2, "kivi2", L::per_channel,   2, true,     0,   3,    0, sizeof(block_kv2),  F::q2a,   false},
  {F::q4nl,  "q4nl",  L::per_token,     4, false,    0,  15,    0, sizeof(block_kv4),  F::q4nl,  true, kLevels4},
  {F::q3nl,  "q3nl",  L::per_token,     3, false,    0,   7,    0, sizeof(block_kv3),  F::q3nl,  true, kLevels3},
  {F::q2nl,  "q2nl",  L::per_token,     2, false,    0,   3,    0, sizeof(block_kv2),  F::q2nl,  true, kLevels2},
};
// clang-format on
static_assert(sizeof(kTable) / sizeof(kTable[0]) == (size_t)kv_format::count);

constexpr bool table_in_order() {
  for (size_t i = 0; i < sizeof(kTable) / sizeof(kTable[0]); ++i)
    if ((size_t)kTable[i].format != i) return false;
  return true;
}
static_assert(table_in_order());

}  // namespace

const kv_format_traits& kv_traits(kv_format f) {
  KVQ_ASSERT((size_t)f < (size_t)kv_format::count);
  return kTable[(size_t)f];
}

bool find_kv_format(const std::string& name, kv_format* out) {
  for (const auto& t : kTable)
    if (name == t.name) {
      *out = t.format;
      return true;
    }
  return false;
}

size_t kv_code_bytes(kv_format f, int head_dim) {
  const auto& t = kv_traits(f);
  return (size_t)head_dim * t.bits / 8;
}

int kv_row_scale_count(kv_format f, int head_dim, int group) {
  const auto& t = kv_traits(f);
  if (t.layout != kv_layout::per_token) return 0;
  return head_dim / group * (t.asymmetric ? 2 : 1);
}

// Layout of a block of m elements (m = 32, or a final partial block, m % 8 == 0):
//   8 bits: byte i = e[i]
//   4 bits: byte i (i < m/2): low nibble e[i], high nibble e[i + m/2]
//   2 bits: byte i (i < m/4): bits 2k..2k+1 hold e[i + k*m/4], k = 0..3
//   3 bits: the low 2 bits as the 2-bit layout (m/4 bytes), then m/8 bytes of bit 2: e[i] at
//           byte i/8, bit i%8.
void pack_codes(int bits, const uint8_t* u, int n, uint8_t* dst) {
  for (int b0 = 0; b0 < n; b0 += 32) {
    const int m = n - b0 < 32 ? n - b0 : 32;
    const uint8_t* e = u + b0;
    switch (bits) {
      case 8:
        std::memcpy(dst, e, (size_t)m);
        dst += m;
        break;
      case 4:
        for (int i = 0; i < m / 2; ++i) dst[i] = (uint8_t)((e[i] & 15) | (e[i + m / 2] & 15) << 4);
        dst += m / 2;
        break;
      case 2:
      case 3: {
        const int q = m / 4;
        for (int i = 0; i < q; ++i) {
          uint8_t byte = 0;
          for (int k = 0; k < 4; ++k) byte |= (uint8_t)((e[i + k * q] & 3) << (2 * k));
          dst[i] = byte;
        }
        dst += q;
        if (bits == 3) {
          for (int i = 0; i < m / 8; ++i) {
            uint8_t byte = 0;
            for (int k = 0; k < 8; ++k) byte |= (uint8_t)(((e[8 * i + k] >> 2) & 1) << k);
            dst[i] = byte;
          }
          dst += m / 8;
        }
        break;
      }
      default: KVQ_ASSERT(false);
    }
  }
}

void unpack_codes(int bits, const uint8_t* src, int n, uint8_t* u) {
  for (int b0 = 0; b0 < n; b0 += 32) {
    const int m = n - b0 < 32 ? n - b0 : 32;
    uint8_t* e = u + b0;
    switch (bits) {
      case 8:
        std::memcpy(e, src, (size_t)m);
        src += m;
        break;
      case 4:
        for (int i = 0; i < m / 2; ++i) {
          e[i] = src[i] & 15;
          e[i + m / 2] = src[i] >> 4;
        }
        src += m / 2;
        break;
      case 2:
      case 3: {
        const int q = m / 4;
        for (int i = 0; i < q; ++i)
          for (int k = 0; k < 4; ++k) e[i + k * q] = (src[i] >> (2 * k)) & 3;
        src += q;
        if (bits == 3) {
          for (int i = 0; i < m; ++i) e[i] |= (uint8_t)(((src[i / 8] >> (i % 8)) & 1) << 2);
          src += m / 8;
        }
        break;
      }
      default: KVQ_ASSERT(false);
    }
  }
}

}  // namespace kvq
