// weight_view construction, row decoding and the float64 reference product.
#include <fmt/format.h>

#include <vector>

#include "core/weight_types/traits.h"
#include "kvq/error.h"
#include "kvq/matmul.h"

namespace kvq {

namespace {

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

}  // namespace

weight_view make_weight_view(const gguf_tensor_info& t) {
  const weight_type_traits* tr = find_weight_traits(t.type);
  if (tr == nullptr)
    fail_unsupported(fmt::format("[matmul] tensor '{}' (shape {}) has type {} (id {}); supported weight "
                                 "types: {}",
                                 t.name, shape_str(t.ne), ggml_type_name(t.type), (unsigned)t.type,
                                 supported_weight_type_names()));
  if (t.ne.empty() || t.ne.size() > 2)
    fail_input(fmt::format("[matmul] tensor '{}' ({}, shape {}) has {} dims; a weight must be 1-D or 2-D",
                           t.name, ggml_type_name(t.type), shape_str(t.ne), t.ne.size()));
  const int64_t n_in = t.ne[0], n_out = t.ne.size() > 1 ? t.ne[1] : 1;
  if (n_in <= 0 || n_out <= 0 || n_in % tr->blk != 0)
    fail_input(fmt::format("[matmul] tensor '{}' ({}, shape {}): ne[0] = {} is not a positive multiple "
                           "of the {} block size {}",
                           t.name, ggml_type_name(t.type), shape_str(t.ne), n_in, ggml_type_name(t.type),
                           tr->blk));
  weight_view w;
  w.type = t.type;
  w.n_in = n_in;
  w.n_out = n_out;
  w.data = t.data;
  w.row_bytes = (size_t)(n_in / tr->blk * tr->bytes);
  w.name = t.name;
  const uint64_t need = (uint64_t)w.row_bytes * (uint64_t)n_out;
  if (t.data == nullptr || need != t.n_bytes)
    fail_input(fmt::format("[matmul] tensor '{}' ({}, shape {}) has {} bytes of data; its type and shape "
                           "need {} ({} rows of {} bytes)",
                           t.name, ggml_type_name(t.type), shape_str(t.ne),
                           t.data == nullptr ? 0 : t.n_bytes, need, n_out, w.row_bytes));
  return w;
}

void weight_row_to_f32(const weight_view& w, int64_t r, float* out) {
  if (r < 0 || r >= w.n_out)
    fail_input(fmt::format("[matmul] row {} out of range for '{}' ({} rows)", r, w.name, w.n_out));
  const weight_type_traits* tr = find_weight_traits(w.type);
  if (tr == nullptr)
    fail_unsupported(fmt::format("[matmul] weight '{}' has unsupported type {}", w.name,
                                 ggml_type_name(w.type)));
  tr->to_float(w.data + (size_t)r * w.row_bytes, out, w.n_in);
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
