// Test helper of the kernel tests: random K/V sides of every layout through the reference
// quantizers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kvq/attention.h"
#include "kvq/f16.h"
#include "kvq/quant.h"

namespace kvq {

// Random codes of a per-token side, [n_rows] rows, through the reference quantizer.
struct side_buf {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scales;
  kv_quant_side side;
};

inline side_buf make_side(kv_format f, int n_rows, int hd, int group, std::mt19937& rng) {
  side_buf b;
  const auto& t = kv_traits(f);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x((size_t)n_rows * hd);
  for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * (1.0f + (i % hd == 5 ? 20.0f : 0.0f)) + (i % 7 == 0 ? 1.5f : 0.f);
  const size_t row = t.layout == kv_layout::dense ? (size_t)hd * t.bits / 8 : kv_code_bytes(f, hd);
  b.codes.resize((size_t)n_rows * row);
  b.side.format = f;
  b.side.code_stride = (int64_t)row;
  if (t.layout == kv_layout::per_token) {
    const int sc = kv_row_scale_count(f, hd, group);
    b.scales.resize((size_t)n_rows * sc);
    for (int j = 0; j < n_rows; ++j)
      quantize_row_ref(f, &x[(size_t)j * hd], hd, group, &b.codes[j * row], &b.scales[(size_t)j * sc]);
    b.side.scale_stride = sc;
    b.side.group = group;
  } else if (t.layout == kv_layout::per_channel) {
    b.scales.resize((size_t)(n_rows + group - 1) / group * 2 * hd);
    for (int j = 0; j < n_rows; j += group)
      quantize_channel_group_ref(f, &x[(size_t)j * hd], std::min(group, n_rows - j), hd, &b.codes[j * row],
                                 &b.scales[(size_t)j / group * 2 * hd]);
    b.side.scale_stride = 2 * hd;
    b.side.group = group;
  } else {
    for (size_t i = 0; i < x.size(); ++i) {
      if (f == kv_format::f32) reinterpret_cast<float*>(b.codes.data())[i] = x[i];
      else if (f == kv_format::f16) reinterpret_cast<uint16_t*>(b.codes.data())[i] = f32_to_f16(x[i]);
      else reinterpret_cast<uint16_t*>(b.codes.data())[i] = f32_to_bf16(x[i]);
    }
  }
  b.side.codes = b.codes.data();
  b.side.scales = b.scales.empty() ? nullptr : b.scales.data();
  return b;
}

}  // namespace kvq
