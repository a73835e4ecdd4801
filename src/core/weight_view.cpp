// weight_view construction, row decoding and the float64 reference product.
#include <fmt/format.h>

#include <vector>

#include "core/weight_blocks.h"
#include "kvq/error.h"
#include "kvq/matmul.h"

namespace kvq {

weight_view make_weight_view(const gguf_tensor_info& t) {
  const int64_t blk = ggml_block_elems(t.type);
  if (blk == 0)
    fail_unsupported(fmt::format("[matmul] tensor '{}' has type {} (id {}); supported weight types: "
                                 "f32, f16, bf16, q8_0, q4_0",
                                 t.name, ggml_type_name(t.type), (unsigned)t.type));
  if (t.ne.empty() || t.ne.size() > 2)
    fail_input(fmt::format("[matmul] tensor '{}' has {} dims; a weight must be 1-D or 2-D", t.name,
                           t.ne.size()));
  const int64_t n_in = t.ne[0], n_out = t.ne.size() > 1 ? t.ne[1] : 1;
  if (n_in <= 0 || n_out <= 0 || n_in % blk != 0)
    fail_input(fmt::format("[matmul] tensor '{}': ne[0] = {} is not a positive multiple of the {} "
                           "block size {}",
                           t.name, n_in, ggml_type_name(t.type), blk));
  weight_view w;
  w.type = t.type;
  w.n_in = n_in;
  w.n_out = n_out;
  w.data = t.data;
  w.row_bytes = (size_t)(n_in / blk * ggml_block_bytes(t.type));
  w.name = t.name;
  if (t.data == nullptr || (uint64_t)w.row_bytes * (uint64_t)n_out > t.n_bytes)
    fail_input(fmt::format("[matmul] tensor '{}' has no data or too little ({} bytes for {} x {} {})",
                           t.name, t.n_bytes, n_out, n_in, ggml_type_name(t.type)));
  return w;
}

void weight_row_to_f32(const weight_view& w, int64_t r, float* out) {
  if (r < 0 || r >= w.n_out)
    fail_input(fmt::format("[matmul] row {} out of range for '{}' ({} rows)", r, w.name, w.n_out));
  const uint8_t* row = w.data + (size_t)r * w.row_bytes;
  switch (w.type) {
    case ggml_type::f32: std::memcpy(out, row, (size_t)w.n_in * 4); return;
    case ggml_type::f16: {
      const auto* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < w.n_in; ++i) out[i] = f16_to_f32(h[i]);
      return;
    }
    case ggml_type::bf16: {
      const auto* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < w.n_in; ++i) out[i] = bf16_to_f32(h[i]);
      return;
    }
    case ggml_type::q8_0: {
      const auto* b = reinterpret_cast<const block_q8_0*>(row);
      for (int64_t k = 0; k < w.n_in / qk8_0; ++k) dequant_q8_0(b[k], out + k * qk8_0);
      return;
    }
    case ggml_type::q4_0: {
      const auto* b = reinterpret_cast<const block_q4_0*>(row);
      for (int64_t k = 0; k < w.n_in / qk4_0; ++k) dequant_q4_0(b[k], out + k * qk4_0);
      return;
    }
    default:
      fail_unsupported(fmt::format("[matmul] weight '{}' has unsupported type {}", w.name,
                                   ggml_type_name(w.type)));
  }
}

void matmul_ref(const weight_view& w, const float* x, int64_t n_tokens, float* y) {
  std::vector<float> row((size_t)w.n_in);
  for (int64_t r = 0; r < w.n_out; ++r) {
    weight_row_to_f32(w, r, row.data());
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * w.n_in;
      double acc = 0;
      for (int64_t i = 0; i < w.n_in; ++i) acc += (double)row[i] * (double)xt[i];
      y[t * w.n_out + r] = (float)acc;
    }
  }
}

}  // namespace kvq
