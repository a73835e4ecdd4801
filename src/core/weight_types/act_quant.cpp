// Activation quantizers for the integer weight dots (one per act_type).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/weight_types/act_blocks.h"

namespace kvq {

namespace {

// Quantizes n values (32 or 256) to qs with d = amax / 127; returns d.
float quantize_block(const float* x, int n, int8_t* qs) {
  float amax = 0;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float id = amax > 0 ? 127.0f / amax : 0.0f;
  for (int i = 0; i < n; ++i) qs[i] = (int8_t)std::nearbyint(x[i] * id);
  return amax / 127.0f;
}

}  // namespace

int64_t act_block_elems(act_type t) {
  switch (t) {
    case act_type::f32: return 1;
    case act_type::q8_0: case act_type::q8_1: return 32;
    case act_type::q8_k: return qk_k;
    default: return 0;
  }
}

int64_t act_block_bytes(act_type t) {
  switch (t) {
    case act_type::f32: return 4;
    case act_type::q8_0: return sizeof(block_q8_x);
    case act_type::q8_1: return sizeof(block_q8_1x);
    case act_type::q8_k: return sizeof(block_q8_k);
    default: return 0;
  }
}

void quantize_act(act_type t, const float* x, int64_t n, void* out) {
  switch (t) {
    case act_type::f32: std::memcpy(out, x, (size_t)n * 4); return;
    case act_type::q8_0: {
      auto* q = static_cast<block_q8_x*>(out);
      for (int64_t b = 0; b < n / 32; ++b) q[b].d = quantize_block(x + 32 * b, 32, q[b].qs);
      return;
    }
    case act_type::q8_1: {
      auto* q = static_cast<block_q8_1x*>(out);
      for (int64_t b = 0; b < n / 32; ++b) {
        q[b].d = quantize_block(x + 32 * b, 32, q[b].qs);
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[b].qs[i];
        q[b].s = q[b].d * (float)sum;
      }
      return;
    }
    case act_type::q8_k: {
      auto* q = static_cast<block_q8_k*>(out);
      for (int64_t b = 0; b < n / qk_k; ++b) {
        q[b].d = quantize_block(x + qk_k * b, qk_k, q[b].qs);
        for (int j = 0; j < qk_k / 16; ++j) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += q[b].qs[16 * j + i];
          q[b].bsums[j] = (int16_t)sum;
        }
      }
      return;
    }
    default: return;
  }
}

}  // namespace kvq
