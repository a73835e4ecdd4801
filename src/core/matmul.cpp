// matmul dispatch (ISA tier once per process, rows split over the thread pool), the activation
// quantizer and the scalar tier.
#include "kvq/matmul.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/matmul_kernels.h"
#include "kvq/error.h"

namespace kvq {
namespace detail {

void quantize_x_q8(const float* x, int64_t n_in, int64_t n_tokens, block_q8_x* out) {
  const int64_t nb = n_in / qk8_0;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xs = x + t * n_in + b * qk8_0;
      block_q8_x& q = out[t * nb + b];
      float amax = 0;
      for (int i = 0; i < qk8_0; ++i) amax = std::max(amax, std::fabs(xs[i]));
      q.d = amax / 127.0f;
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      for (int i = 0; i < qk8_0; ++i) q.qs[i] = (int8_t)std::nearbyint(xs[i] * id);
    }
  }
}

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

int32_t dot_i8(const int8_t* a, const int8_t* b) {  // 32 elements
  int32_t s = 0;
  for (int i = 0; i < qk8_0; ++i) s += (int32_t)a[i] * (int32_t)b[i];
  return s;
}

}  // namespace

void matmul_rows_scalar(const matmul_task& task, int64_t r0, int64_t r1) {
  const weight_view& w = task.w;
  const int64_t n_in = w.n_in, n_out = w.n_out;
  if (w.type == ggml_type::q8_0 || w.type == ggml_type::q4_0) {
    const int64_t nb = n_in / qk8_0;
    int8_t wq[qk8_0];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w.data + (size_t)r * w.row_bytes;
      for (int64_t t = 0; t < task.n_tokens; ++t) {
        const block_q8_x* xq = task.xq + t * nb;
        float acc = 0;
        for (int64_t b = 0; b < nb; ++b) {
          float dw;
          const int8_t* q;
          if (w.type == ggml_type::q8_0) {
            const auto& blk = reinterpret_cast<const block_q8_0*>(row)[b];
            dw = f16_to_f32(blk.d);
            q = blk.qs;
          } else {
            const auto& blk = reinterpret_cast<const block_q4_0*>(row)[b];
            dw = f16_to_f32(blk.d);
            for (int j = 0; j < qk4_0 / 2; ++j) {
              wq[j] = (int8_t)((blk.qs[j] & 0x0f) - 8);
              wq[j + qk4_0 / 2] = (int8_t)((blk.qs[j] >> 4) - 8);
            }
            q = wq;
          }
          acc += (float)dot_i8(q, xq[b].qs) * (dw * xq[b].d);
        }
        task.y[t * n_out + r] = acc;
      }
    }
    return;
  }
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

void matmul_with_isa(isa tier, const weight_view& w, const float* x, int64_t n_tokens, float* y,
                     thread_pool& pool) {
  if (n_tokens <= 0 || w.n_out <= 0) return;
  if (ggml_block_elems(w.type) == 0 || w.data == nullptr)
    fail_unsupported(fmt::format("[matmul] weight '{}' has unsupported type {} (supported: f32, f16, "
                                 "bf16, q8_0, q4_0)",
                                 w.name, ggml_type_name(w.type)));
  if ((int)tier > (int)best_isa() && tier != isa::scalar)
    fail_unsupported(fmt::format("[matmul] ISA tier {} is not available on this CPU (best: {})",
                                 isa_name(tier), isa_name(best_isa())));
  void (*rows)(const matmul_task&, int64_t, int64_t) =
      tier == isa::scalar ? matmul_rows_scalar : matmul_rows_avx2;

  matmul_task task{w, x, nullptr, n_tokens, y};
  thread_local std::vector<block_q8_x> xq;
  if (w.type == ggml_type::q8_0 || w.type == ggml_type::q4_0) {
    xq.resize((size_t)(n_tokens * (w.n_in / qk8_0)));
    quantize_x_q8(x, w.n_in, n_tokens, xq.data());
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
  pool.run_on_all([&](int tid, int nt) {
    // Contiguous row ranges, multiples of 8 rows (the widest row tile).
    const int64_t per = ((w.n_out + nt - 1) / nt + 7) / 8 * 8;
    const int64_t r0 = std::min<int64_t>(w.n_out, per * tid), r1 = std::min<int64_t>(w.n_out, r0 + per);
    if (r0 < r1) rows(task, r0, r1);
  });
}

}  // namespace detail

void matmul(const weight_view& w, const float* x, int64_t n_tokens, float* y, thread_pool& pool) {
  detail::matmul_with_isa(best_isa(), w, x, n_tokens, y, pool);
}

}  // namespace kvq
