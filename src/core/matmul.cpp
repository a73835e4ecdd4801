// matmul dispatch (ISA tier once per process, rows split over the thread pool, activations
// quantized once per call to the type's vec_dot_type), the scalar float tier and the generic
// matrix-matrix loop over a type's vec_dot.
#include "kvq/matmul.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "core/matmul_kernels.h"
#include "core/weight_types/act_quant_simd.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {
namespace detail {

namespace {
// f16 -> f32 for all 65536 values (256 KiB), so the scalar tier does not branch per element.
const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = f16_to_f32((uint16_t)h);
    return t;
  }();
  return table.data();
}

// One weight row as f32 (thread-local buffer reused across calls).
const float* row_f32(const weight_view& w, int64_t r, std::vector<float>& buf) {
  const uint8_t* row = w.data + (size_t)r * w.row_bytes;
  if (w.type == ggml_type::f32) return reinterpret_cast<const float*>(row);
  buf.resize((size_t)w.n_in);
  if (w.type == ggml_type::f16) {
    const float* tab = f16_table();
    const auto* h = reinterpret_cast<const uint16_t*>(row);
    for (int64_t i = 0; i < w.n_in; ++i) buf[i] = tab[h[i]];
  } else {
    weight_row_to_f32(w, r, buf.data());
  }
  return buf.data();
}

}  // namespace

void matmul_rows_float_scalar(const matmul_task& task, int64_t r0, int64_t r1) {
  const weight_view& w = task.w;
  const int64_t n_in = w.n_in, n_out = w.n_out;
  thread_local std::vector<float> buf;
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = row_f32(w, r, buf);
    for (int64_t t = 0; t < task.n_tokens; ++t) {
      const float* xt = task.x + t * n_in;
      float acc[8] = {};  // 8 partial sums: independent chains (and SIMD-friendly)
      int64_t i = 0;
      for (; i + 8 <= n_in; i += 8)
        for (int k = 0; k < 8; ++k) acc[k] += wr[i + k] * xt[i + k];
      for (; i < n_in; ++i) acc[0] += wr[i] * xt[i];
      task.y[t * n_out + r] =
          ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
  }
}

void matmul_rows_vec_dot(const matmul_task& task, int64_t r0, int64_t r1) {
  const weight_view& w = task.w;
  const auto* xq = static_cast<const uint8_t*>(task.xq);
  // Token chunks whose quantized activations stay in ~32 KiB of L1/L2; each weight row is read once
  // per chunk (prefill reuses it across the chunk's tokens, decode is one token).
  const int64_t tc = std::max<int64_t>(1, 32768 / (int64_t)std::max<size_t>(task.xq_row_bytes, 1));
  for (int64_t t0 = 0; t0 < task.n_tokens; t0 += tc) {
    const int64_t t1 = std::min(task.n_tokens, t0 + tc);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w.data + (size_t)r * w.row_bytes;
      for (int64_t t = t0; t < t1; ++t)
        task.y[t * w.n_out + r] = task.dot(w.n_in, row, xq + (size_t)t * task.xq_row_bytes);
    }
  }
}

void matmul_with_isa(isa tier, const weight_view& w, const float* x, int64_t n_tokens, float* y,
                     thread_pool& pool) {
  if (n_tokens <= 0 || w.n_out <= 0) return;
  const weight_type_traits* tr = find_weight_traits(w.type);
  if (tr == nullptr || w.data == nullptr)
    fail_unsupported(fmt::format("[matmul] weight '{}' has unsupported type {} (supported: {})", w.name,
                                 ggml_type_name(w.type), supported_weight_type_names()));
  if ((int)tier > (int)best_isa() && tier != isa::scalar)
    fail_unsupported(fmt::format("[matmul] ISA tier {} is not available on this CPU (best: {})",
                                 isa_name(tier), isa_name(best_isa())));
  const rows_fn rows = tr->rows[(int)tier];

  matmul_task task{w, x, nullptr, 0, tr->vec_dot[(int)tier], n_tokens, y};
  thread_local std::vector<uint8_t> xq;  // [n_tokens, xq_row_bytes]
  if (tr->vec_dot_type != act_type::f32) {
    const act_type at = tr->vec_dot_type;
    task.xq_row_bytes = (size_t)(w.n_in / act_block_elems(at) * act_block_bytes(at));
    xq.resize(task.xq_row_bytes * (size_t)n_tokens);
    uint8_t* const xq_data = xq.data();  // (xq is thread-local: name the buffer, not the variable)
    // The SIMD quantizer writes the scalar one's bits (act_quant_simd.h), so tiers still agree.
    const auto quantize = tier == isa::scalar ? quantize_act : quantize_act_avx2;
    auto quantize_token = [&](int64_t t, int) {
      quantize(at, x + t * w.n_in, w.n_in, xq_data + (size_t)t * task.xq_row_bytes);
    };
    if (n_tokens >= 16) pool.parallel_for(n_tokens, quantize_token);  // prefill: tokens in parallel
    else for (int64_t t = 0; t < n_tokens; ++t) quantize_token(t, 0);
    task.xq = xq.data();
  }

  // Handing work to the pool costs a few microseconds even with spinning workers. Measured on 2
  // cores (f16 matvec, one thread vs two): 64x64 0.27 vs 1.3 us, 512x512 12 vs 10.6 us, 512x1408
  // 36 vs 30 us. So stay on the caller below ~128K multiply-adds (64K for the integer-dot path).
  const double work = (double)w.n_in * (double)w.n_out * (double)n_tokens;
  const double min_work = task.xq ? (double)(1 << 16) : (double)(1 << 17);
  const int n_threads = (int)std::min<int64_t>(pool.size(), std::max<int64_t>(1, w.n_out / 8));
  if (n_threads <= 1 || work < min_work) {
    rows(task, 0, w.n_out);
    return;
  }
  // Rows in chunks handed out by an atomic counter (as ggml's mul_mat): a thread that the OS
  // deschedules on a shared host holds up only its current chunk, not half the matrix. Chunks are
  // multiples of 8 rows (the widest row tile), about 8 per thread.
  const int64_t chunk = std::max<int64_t>(8, (w.n_out + 8 * n_threads - 1) / (8 * n_threads) + 7) / 8 * 8;
  const int64_t n_chunks = (w.n_out + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  pool.run_on_all([&](int, int) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < n_chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      rows(task, c * chunk, std::min(w.n_out, (c + 1) * chunk));
  });
}

}  // namespace detail

void matmul(const weight_view& w, const float* x, int64_t n_tokens, float* y, thread_pool& pool) {
  detail::matmul_with_isa(best_isa(), w, x, n_tokens, y, pool);
}

}  // namespace kvq
