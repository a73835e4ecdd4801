// KIVI pages on the GPU (kivi4: K per-channel 4-bit in groups of 32 positions, V q4a; docs/cuda.md
// "KIVI") against the CPU cache itself (kv_cache_quant, -ctk kivi4 -ctv q4a / kivi4, exact sink 4,
// residual 32): the same f32 rows in, every stored byte compared (codes, channel scales and zeros,
// V scales and zeros, the exact sink and residual rows), and the attention of a prompt chunk's
// queries through decode_plan (one entry per query, as the GPU runner attends) against the CPU
// cache's attend of the same queries.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cache/kv_cache_impl.h"
#include "cuda_test_util.h"
#include "kvq/error.h"
#include "kvq/kv_cache.h"
#include "kvq/thread_pool.h"

namespace kvq::cuda::test {
namespace {

// [T][nh][hd] f32: Qwen2.5-like K (a few channels offset by 70 .. 210, spreads over 2^-3 .. 2^3), or
// V without offsets; a few exact zeros of both signs (the min / max tie rules).
std::vector<float> kivi_rows(std::mt19937& rng, int T, int nh, int hd, bool offsets) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x((size_t)T * nh * hd);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = (int)(i % hd);
    const float off = offsets && c % 16 == 5 ? 70.0f + 70.0f * (float)((c / 16) % 3) : 0.0f;
    x[i] = off + std::ldexp(1.0f, (c * 5) % 7 - 3) * nd(rng);
    if (i % 97 == 11) x[i] = (i / 97) % 2 ? -0.0f : 0.0f;
  }
  return x;
}

struct kivi_case {
  kv_cache_type type_v;  // q4a (V rotated, the recommended cache) or kivi4 (V unrotated)
  int head_dim;
  int page_size;
};

class CudaKivi : public ::testing::TestWithParam<kivi_case> {
 protected:
  static constexpr int nh = 2, sink = 4, T0 = 101, T = 4 + 32 * 6 + 9, n_ctx = 256;
  int hd = 0, P = 32;
  std::vector<float> xk, xv;
  std::unique_ptr<kv_cache> cache;

  void SetUp() override {
    KVQ_REQUIRE_GPU();
    hd = GetParam().head_dim;
    P = GetParam().page_size;
    std::mt19937 rng(4100 + hd);
    xk = kivi_rows(rng, T, nh, hd, true);
    xv = kivi_rows(rng, T, nh, hd, false);
    kv_cache_params p;
    p.type_k = kv_cache_type::kivi4;
    p.type_v = GetParam().type_v;
    p.n_layer = 1;
    p.n_ctx = n_ctx;
    p.n_kv_head = nh;
    p.head_dim = hd;
    p.sink = sink;
    p.exact_recent = 0;
    cache = make_kv_cache(p);
    const size_t row = (size_t)nh * hd;
    cache->append(0, 0, T0, xk.data(), xv.data());  // the history, then a prompt chunk
    cache->append(0, 0, T - T0, xk.data() + T0 * row, xv.data() + T0 * row);
  }
  paged_kv_format format() const {
    paged_kv_format f;
    f.format = kv_format::kivi4;
    f.head_dim = hd;
    f.n_kv_head = nh;
    f.page_size = P;
    f.rotation = GetParam().type_v == kv_cache_type::q4a ? rotation_kind::hadamard : rotation_kind::none;
    return f;
  }
  // body rows compressed once n positions are held (kv_cache_quant: min_tail = 32 - 32 + 1)
  static int n_comp(int n) { return std::max(0, n - sink - 1) / 32 * 32; }

  // The GPU cache of the T rows, as the runner keeps it: exact slot 0 = the sink, then body rows
  // [0, T - sink) in f16 (cap T); pages 0.. in reverse order hold body row r at r % P of page
  // table[r / P]; the whole groups of n_comp(T) quantized from the exact rows.
  struct gpu_cache {
    paged_kv_geometry g;
    std::vector<int32_t> table;
    dbuf pool, ek, ev;
  };
  gpu_cache build(int cap) const {
    gpu_cache c;
    const paged_kv_format f = format();
    c.g = paged_kv_geometry_of(f);
    const int n_body = T - sink, n_pages = (n_body + P - 1) / P;
    for (int i = 0; i < n_pages; ++i) c.table.push_back(n_pages - 1 - i);
    c.pool = dbuf((size_t)n_pages * c.g.page_bytes);
    device_fill(c.pool.p, 0xA5, c.pool.n);
    c.ek = dbuf((size_t)nh * cap * hd * 2);
    c.ev = dbuf((size_t)nh * cap * hd * 2);
    std::vector<int64_t> slots(T), eslots(T);
    for (int t = 0; t < T; ++t) {
      const int r = t - sink;
      slots[t] = t < sink ? -1 : (int64_t)c.table[r / P] * P + r % P;
      eslots[t] = t;  // slot 0, row t (sink rows, then body row r at sink + r)
    }
    dbuf dk = dbuf::from(xk), dv = dbuf::from(xv), ds = dbuf::from(slots), des = dbuf::from(eslots);
    paged_kv_view kv;
    kv.format = f;
    kv.pool = c.pool.as<uint8_t>();
    kv.n_pages = n_pages;
    exact_rows_out eo;
    eo.k = c.ek.as<uint16_t>();
    eo.v = c.ev.as<uint16_t>();
    eo.slots = des.as<int64_t>();
    eo.cap = cap;
    // in two calls, as the CPU cache got them
    append_kivi(kv, dk.p, dv.p, kv_elem::f32, ds.as<int64_t>(), T0, eo);
    exact_rows_out eo2 = eo;
    eo2.slots = des.as<int64_t>() + T0;
    append_kivi(kv, dk.as<float>() + (size_t)T0 * nh * hd, dv.as<float>() + (size_t)T0 * nh * hd, kv_elem::f32,
                ds.as<int64_t>() + T0, T - T0, eo2);
    std::vector<int64_t> src, dst;
    for (int g0 = 0; g0 < n_comp(T); g0 += 32) {
      src.push_back(sink + g0);
      dst.push_back((int64_t)c.table[g0 / P] * P + g0 % P);
    }
    dbuf dsrc = dbuf::from(src), ddst = dbuf::from(dst);
    quantize_kivi_groups(kv, c.ek.as<uint16_t>(), cap, dsrc.as<int64_t>(), ddst.as<int64_t>(), (int)src.size());
    synchronize();
    return c;
  }
};

TEST_P(CudaKivi, StoredBytesEqualTheCpuCache) {
  const int cap = T;
  const gpu_cache c = build(cap);
  const std::vector<uint8_t> pages = to_host<uint8_t>(c.pool.p, c.pool.n);
  const std::vector<uint16_t> ek = to_host<uint16_t>(c.ek.p, (size_t)nh * cap * hd),
                              ev = to_host<uint16_t>(c.ev.p, (size_t)nh * cap * hd);
  // kv_cache_stored_bytes: n, n_comp, body_lo, then per kv head and side the sink rows, the tail
  // rows, the body's code rows, its scale units (K: per group [hd] scales + [hd] zeros; V: per row)
  const std::vector<uint8_t> cpu = kv_cache_stored_bytes(*cache, 0, 0);
  const int nc = n_comp(T);
  ASSERT_GT(nc, 0);
  std::vector<uint8_t> gpu(12);
  const int hdr[3] = {T, nc, 0};
  std::memcpy(gpu.data(), hdr, 12);
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    gpu.insert(gpu.end(), b, b + n);
  };
  for (int h = 0; h < nh; ++h)
    for (int side = 0; side < 2; ++side) {
      const uint16_t* ex = (side ? ev : ek).data() + (size_t)h * cap * hd;
      put(ex, (size_t)sink * hd * 2);
      put(ex + (size_t)(sink + nc) * hd, (size_t)(T - sink - nc) * hd * 2);
      for (int r = 0; r < nc; ++r) {
        const int64_t pg = c.table[r / P];
        put(pages.data() + (side ? c.g.v_code_offset(pg, h, r % P) : c.g.k_code_offset(pg, h, r % P)), c.g.code_bytes);
      }
      if (side == 0)
        for (int g0 = 0; g0 < nc; g0 += 32)
          put(pages.data() + c.g.k_group_offset(c.table[g0 / P], h, (g0 % P) / 32), (size_t)4 * hd);
      else
        for (int r = 0; r < nc; ++r)
          put(pages.data() + c.g.v_scale_offset(c.table[r / P], h, r % P), (size_t)c.g.n_scales * 2);
    }
  ASSERT_EQ(gpu.size(), cpu.size());
  size_t first = gpu.size(), n_diff = 0;
  for (size_t i = 0; i < gpu.size(); ++i)
    if (gpu[i] != cpu[i]) {
      if (first == gpu.size()) first = i;
      ++n_diff;
    }
  EXPECT_EQ(n_diff, 0u) << "GPU bytes differ from the CPU cache's stored bytes from byte " << first << " of "
                        << gpu.size();
  // the K scales are not min/max's everywhere (the least-squares search moved some): the comparison
  // covers the search, not only its start
  int moved = 0;
  std::vector<float> col(32);
  for (int h = 0; h < nh; ++h)
    for (int c0 = 0; c0 < hd; ++c0) {
      for (int t = 0; t < 32; ++t) col[t] = f16_to_f32(f32_to_f16(xk[((size_t)(sink + t) * nh + h) * hd + c0]));
      const float mn = *std::min_element(col.begin(), col.end());
      const uint16_t zs =
          *reinterpret_cast<const uint16_t*>(pages.data() + c.g.k_group_offset(c.table[0], h, 0) + 2 * hd + 2 * c0);
      moved += zs != f32_to_f16(mn);
    }
  EXPECT_GT(moved, 0);
}

// A prompt chunk's queries (positions T0 .. T - 1) through decode_plan, one entry per query as the
// runner attends: entry i sees the pages' body rows [0, n_comp(p + 1)) and the exact rows [0,
// sink + p + 1 - sink) less the gap [sink, sink + n_comp(p + 1)) (its own residual and the sink),
// against the CPU cache's attend of the same f16-rounded queries (which keeps each query's exact
// window relative to its position). Both dequantize the same codes; they differ by summation order
// and exp2 only: bound 1e-3 relative. Without the gap (the compressed rows counted twice) the output
// moves: the test can fail.
TEST_P(CudaKivi, ChunkAttentionMatchesTheCpuCacheAttend) {
  const int cap = T, ng = 3, n_head = ng * nh, nq = T - T0;
  const gpu_cache c = build(cap);
  std::mt19937 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> qh((size_t)nq * n_head * hd);
  std::vector<float> qf(qh.size());
  for (size_t i = 0; i < qh.size(); ++i) {
    qh[i] = f32_to_f16(0.3f * nd(rng));
    qf[i] = f16_to_f32(qh[i]);
  }
  const float scale = 1.0f / std::sqrt((float)hd);
  std::vector<float> ref(qf.size());
  thread_pool tp(0);
  cache->attend(0, 0, T0, nq, n_head, qf.data(), scale, ref.data(), tp);

  std::vector<int32_t> indptr{0}, indices, last, elen, glo, ghi;
  for (int i = 0; i < nq; ++i) {
    const int p = T0 + i, body = n_comp(p + 1), np = (body + P - 1) / P;
    indices.insert(indices.end(), c.table.begin(), c.table.begin() + np);
    indptr.push_back((int32_t)indices.size());
    last.push_back(np > 0 ? body - (np - 1) * P : 0);
    elen.push_back(p + 1);
    glo.push_back(sink);
    ghi.push_back(sink + body);
  }
  dbuf dind = dbuf::from(indptr), didx = dbuf::from(indices), dlast = dbuf::from(last), delen = dbuf::from(elen),
       dglo = dbuf::from(glo), dghi = dbuf::from(ghi), dslot = dbuf::from(std::vector<int32_t>(nq, 0));
  paged_kv_view kv;
  kv.format = format();
  kv.pool = c.pool.as<uint8_t>();
  kv.n_pages = (int64_t)c.table.size();
  kv.indptr = dind.as<int32_t>();
  kv.indices = didx.as<int32_t>();
  kv.last_page_len = dlast.as<int32_t>();
  kv.batch = nq;
  exact_window_view ew;
  ew.k = c.ek.as<uint16_t>();
  ew.v = c.ev.as<uint16_t>();
  ew.len = delen.as<int32_t>();
  ew.cap = cap;
  ew.slot = dslot.as<int32_t>();
  ew.gap_lo = dglo.as<int32_t>();
  ew.gap_hi = dghi.as<int32_t>();
  decode_params dp;
  dp.n_head = n_head;
  dp.spec = attn_spec{scale};
  dp.q_elem = kv_elem::f16;
  dp.out_elem = kv_elem::f32;
  dp.split_tokens = 64;  // several split-KV items per query
  const decode_plan plan(format(), dp, indptr.data(), last.data(), nq, cap);
  dbuf dq = dbuf::from(qh), dout(qf.size() * 4);
  plan.run(kv, dq.p, dout.p, &ew);
  synchronize();
  const double err = rel_err(to_host<float>(dout.p, qf.size()), ref);
  std::printf("[ kivi4 / %s hd %d page %d ] chunk of %d queries: rel err vs the CPU cache's attend %.3e\n",
              kv_cache_type_name(GetParam().type_v), hd, P, nq, err);
  EXPECT_LE(err, 1e-3);

  exact_window_view nogap = ew;
  nogap.gap_lo = nogap.gap_hi = nullptr;
  plan.run(kv, dq.p, dout.p, &nogap);
  synchronize();
  EXPECT_GT(rel_err(to_host<float>(dout.p, qf.size()), ref), 10 * err + 1e-3);

  // the same queries in tiles (decode_params::kivi_tiles: the entries share the pages' prefix), head
  // dims up to 128; 256 keeps the per-entry kernel
  decode_params tp_ = dp;
  tp_.kivi_tiles = true;
  const decode_plan tiles(format(), tp_, indptr.data(), last.data(), nq, cap);
  EXPECT_EQ(tiles.n_items(), nq);  // one work item per entry (every body is non-empty here)
  tiles.run(kv, dq.p, dout.p, &ew);
  synchronize();
  const double err_t = rel_err(to_host<float>(dout.p, qf.size()), ref);
  std::printf("[ kivi4 / %s hd %d page %d ] the same chunk in query tiles: rel err %.3e\n",
              kv_cache_type_name(GetParam().type_v), hd, P, err_t);
  EXPECT_LE(err_t, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaKivi,
                         ::testing::Values(kivi_case{kv_cache_type::q4a, 64, 32},
                                           kivi_case{kv_cache_type::q4a, 128, 64},
                                           kivi_case{kv_cache_type::kivi4, 64, 64},
                                           kivi_case{kv_cache_type::q4a, 96, 32}),
                         [](const auto& info) {
                           return std::string(kv_cache_type_name(info.param.type_v)) + "_hd" +
                                  std::to_string(info.param.head_dim) + "_p" + std::to_string(info.param.page_size);
                         });

// Geometry and refusals, host only (run everywhere).
TEST(CudaKiviGeometry, PagesHoldWholeGroupsAndOtherShapesAreRefused) {
  paged_kv_format f;
  f.format = kv_format::kivi4;
  f.head_dim = 128;
  f.n_kv_head = 2;
  f.page_size = 32;
  f.rotation = rotation_kind::hadamard;
  const paged_kv_geometry g = paged_kv_geometry_of(f);
  EXPECT_EQ(g.code_bytes, 64);
  EXPECT_EQ(g.kivi_group, 32);
  // K codes 32 x 64, V codes 32 x 64, one group's 2 x 128 f16, 32 rows x 2 x 4 f16
  EXPECT_EQ(g.head_bytes, 2048 + 2048 + 512 + 512);
  EXPECT_EQ(g.k_group_offset(1, 1, 0), g.page_bytes + g.head_bytes + g.k_scales);
  f.page_size = 16;
  EXPECT_THROW(paged_kv_geometry_of(f), error);
  f.page_size = 64;
  f.head_dim = 80;
  EXPECT_THROW(paged_kv_geometry_of(f), error);
}

}  // namespace
}  // namespace kvq::cuda::test
