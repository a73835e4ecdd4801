// matmul dispatch: picks the ISA tier once, threads over output rows.
#include "kvq/matmul.h"

#include <fmt/format.h>

#include <vector>

#include "kvq/cpu.h"
#include "kvq/error.h"

namespace kvq {

void matmul(const weight_view& w, const float* x, int64_t n_tokens, float* y, thread_pool& pool) {
  if (n_tokens <= 0) return;
  if (ggml_block_elems(w.type) == 0)
    fail_unsupported(fmt::format("[matmul] weight '{}' has unsupported type {}", w.name,
                                 ggml_type_name(w.type)));
  const int64_t n_chunks = std::min<int64_t>(w.n_out, pool.size() * 4);
  const int64_t per = (w.n_out + n_chunks - 1) / n_chunks;
  pool.parallel_for(n_chunks, [&](int64_t c, int) {
    std::vector<float> row((size_t)w.n_in);
    const int64_t r0 = c * per, r1 = std::min(w.n_out, r0 + per);
    for (int64_t r = r0; r < r1; ++r) {
      weight_row_to_f32(w, r, row.data());
      for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * w.n_in;
        float acc = 0;
        for (int64_t i = 0; i < w.n_in; ++i) acc += row[i] * xt[i];
        y[t * w.n_out + r] = acc;
      }
    }
  });
}

}  // namespace kvq
