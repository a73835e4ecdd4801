// Helpers of the CUDA tests: device buffers, random paged caches built through append_paged, and the
// CPU oracle (kvq's scalar reference quantizers, rotation and attention on the same codes).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kvq/attention.h"
#include "kvq/cuda.h"
#include "kvq/f16.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

#define KVQ_REQUIRE_GPU()                                                                              \
  if (!::kvq::cuda::available())                                                                       \
  GTEST_SKIP() << "CUDA kernels not run: no GPU visible (cudaGetDeviceCount failed or returned 0, or " \
                  "kvq built without KVQ_BUILD_CUDA); device: "                                        \
               << ::kvq::cuda::device_name()

namespace kvq::cuda::test {

// Owning device buffer.
struct dbuf {
  void* p = nullptr;
  size_t n = 0;
  dbuf() = default;
  explicit dbuf(size_t bytes) : p(device_alloc(bytes)), n(bytes) {}
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  dbuf(dbuf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr; }
  dbuf& operator=(dbuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  ~dbuf() { device_free(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
  template <class T>
  static dbuf from(const std::vector<T>& v) {
    dbuf b(std::max<size_t>(1, v.size() * sizeof(T)));
    if (!v.empty()) copy_to_device(b.p, v.data(), v.size() * sizeof(T));
    return b;
  }
};

template <class T>
std::vector<T> to_host(const void* d, size_t n) {
  std::vector<T> v(n);
  if (n) copy_to_host(v.data(), d, n * sizeof(T));
  return v;
}

// Random values with a few outlier channels (what the rotation is for), as f16 or bf16 bits.
inline std::vector<uint16_t> random_halves(std::mt19937& rng, size_t n, int hd, kv_elem e, float sigma = 1.0f) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = nd(rng);
    if (i % hd == 3 || i % hd == (size_t)hd / 2 + 1) x *= 8.0f;  // outlier channels
    v[i] = e == kv_elem::bf16 ? f32_to_bf16(x) : f32_to_f16(x);
  }
  return v;
}
inline float half_value(uint16_t u, kv_elem e) { return e == kv_elem::bf16 ? bf16_to_f32(u) : f16_to_f32(u); }

// A paged cache on the device: random page ids (sparse in [page_base, n_pages)), filled by
// append_paged from random K/V, plus its host copy (pages of the table only).
struct paged_cache {
  paged_kv_format f;
  paged_kv_geometry g;
  std::vector<int> len;                       // tokens per sequence
  std::vector<int32_t> indptr, indices, last;  // host page table
  int64_t n_pages = 0;
  dbuf pool, d_indptr, d_indices, d_last;
  std::vector<uint16_t> k, v;  // host inputs [n_tokens][n_kv_head][hd] (f16/bf16 bits)
  kv_elem elem = kv_elem::f16;
  std::vector<int64_t> token_offset;  // [batch + 1] first token of each sequence in k/v
  std::vector<std::vector<uint8_t>> host_pages;  // [indices entry][page_bytes]

  paged_kv_view view() const {
    paged_kv_view v;
    v.format = f;
    v.pool = pool.as<uint8_t>();
    v.n_pages = n_pages;
    v.indptr = d_indptr.as<int32_t>();
    v.indices = d_indices.as<int32_t>();
    v.last_page_len = d_last.as<int32_t>();
    v.batch = (int)len.size();
    return v;
  }
  int batch() const { return (int)len.size(); }
  // Page-table entry and row of token j of sequence b.
  const uint8_t* host_block(int b, int j, int h) const {
    return host_pages[(size_t)indptr[b] + j / f.page_size].data() + (int64_t)h * g.head_bytes;
  }
  const uint8_t* k_codes(int b, int j, int h) const { return host_block(b, j, h) + g.k_codes + (j % f.page_size) * g.code_bytes; }
  const uint8_t* v_codes(int b, int j, int h) const { return host_block(b, j, h) + g.v_codes + (j % f.page_size) * g.code_bytes; }
  const uint16_t* k_scales(int b, int j, int h) const {
    return reinterpret_cast<const uint16_t*>(host_block(b, j, h) + g.k_scales) + (j % f.page_size) * g.n_scales;
  }
  const uint16_t* v_scales(int b, int j, int h) const {
    return reinterpret_cast<const uint16_t*>(host_block(b, j, h) + g.v_scales) + (j % f.page_size) * g.n_scales;
  }
};

// Builds the page table, appends all tokens (in `n_calls` append calls), downloads the used pages.
inline void build_cache(paged_cache& c, const paged_kv_format& f, const std::vector<int>& len, std::mt19937& rng,
                        kv_elem elem = kv_elem::f16, int64_t page_base = 0, int64_t extra_pages = 7, int n_calls = 2,
                        uint8_t pool_fill = 0xFF) {
  c.f = f;
  c.g = paged_kv_geometry_of(f);
  c.len = len;
  c.elem = elem;
  const int batch = (int)len.size(), ps = f.page_size;
  int64_t used = 0;
  for (int l : len) used += (l + ps - 1) / ps;
  c.n_pages = page_base + used + extra_pages;
  std::vector<int32_t> ids(c.n_pages - page_base);
  std::iota(ids.begin(), ids.end(), (int32_t)page_base);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.indptr.assign(batch + 1, 0);
  c.last.assign(batch, 0);
  c.indices.clear();
  size_t next = 0;
  for (int b = 0; b < batch; ++b) {
    const int np = (len[b] + ps - 1) / ps;
    for (int i = 0; i < np; ++i) c.indices.push_back(ids[next++]);
    c.indptr[b + 1] = (int32_t)c.indices.size();
    c.last[b] = np ? len[b] - (np - 1) * ps : 0;
  }
  c.pool = dbuf((size_t)(c.n_pages * c.g.page_bytes));
  device_fill(c.pool.p, pool_fill, c.pool.n);  // poison: unused rows hold f16 NaN patterns
  c.d_indptr = dbuf::from(c.indptr);
  c.d_indices = dbuf::from(c.indices);
  c.d_last = dbuf::from(c.last);
  // tokens
  c.token_offset.assign(batch + 1, 0);
  for (int b = 0; b < batch; ++b) c.token_offset[b + 1] = c.token_offset[b] + len[b];
  const int64_t nt = c.token_offset[batch];
  const size_t row = (size_t)f.n_kv_head * f.head_dim;
  c.k = random_halves(rng, nt * row, f.head_dim, elem);
  c.v = random_halves(rng, nt * row, f.head_dim, elem, 0.5f);
  std::vector<int64_t> slots(nt);
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < len[b]; ++j)
      slots[c.token_offset[b] + j] = (int64_t)c.indices[c.indptr[b] + j / ps] * ps + j % ps;
  dbuf dk = dbuf::from(c.k), dv = dbuf::from(c.v), ds = dbuf::from(slots);
  // append in n_calls pieces (the codes depend only on each token)
  const int64_t step = std::max<int64_t>(1, (nt + n_calls - 1) / n_calls);
  for (int64_t t0 = 0; t0 < nt; t0 += step) {
    const int n = (int)std::min<int64_t>(step, nt - t0);
    append_paged(c.view(), dk.as<uint16_t>() + t0 * row, dv.as<uint16_t>() + t0 * row, elem, ds.as<int64_t>() + t0, n);
  }
  synchronize();
  c.host_pages.assign(c.indices.size(), std::vector<uint8_t>(c.g.page_bytes));
  for (size_t e = 0; e < c.indices.size(); ++e)
    copy_to_host(c.host_pages[e].data(), c.pool.as<uint8_t>() + (int64_t)c.indices[e] * c.g.page_bytes, c.g.page_bytes);
}

// The CPU pipeline of kv_cache_quant for one token row: f16/bf16 -> f32 -> rotation -> f16 rounding.
inline void transform_row_ref(const rotation& rot, const uint16_t* x, kv_elem e, int hd, float* y) {
  for (int i = 0; i < hd; ++i) y[i] = half_value(x[i], e);
  rot.forward(y);
  for (int i = 0; i < hd; ++i) y[i] = f16_to_f32(f32_to_f16(y[i]));
}

inline double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = (double)got[i] - ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace kvq::cuda::test
