// Causal prefill attention on the GPU (prefill_plan) against (a) the CPU oracle on the same codes,
// attn_quant_ref (q8 / q4, queries quantized as kv_cache_quant does: one scale per K group, int16
// for q8 K, int8 for q4 K) or attn_dense_ref (f16), with the chunk's queries as one multi-token
// query view at pos0 = kv_len - q_len (causal through attn_spec::key_range), and (b) the decode
// kernel with one "sequence" per query token over the pages up to its position (the runner's former
// prefill path). Relative error <= 1e-3 over head_dim {64, 80, 96, 128, 256} x GQA {1, 4, 7, 8} x
// page size {16, 64} x {q4, q8, f16}, odd chunk lengths, chunks starting at position 0 and past it,
// chunks and histories crossing page boundaries, several sequences per plan; outputs poisoned with
// NaN before each run, pools poisoned too, each run twice.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "cuda_test_util.h"
#include "kvq/error.h"

namespace kvq::cuda::test {
namespace {

struct prefill_case {
  kv_format format;
  int hd, ng, n_kv_head, page_size;
  std::vector<int> kv_len, q_len;  // per sequence: positions in the pages, queries (the last q_len)
  kv_elem qe = kv_elem::f16;
  kv_elem oe = kv_elem::f32;
  float softcap = 0.0f;
};
void PrintTo(const prefill_case& c, std::ostream* os) {
  *os << kv_traits(c.format).name << "_hd" << c.hd << "_gqa" << c.ng << "_p" << c.page_size;
}

// The exact sink of a prefill (prefill_params::body_lo + exact_window_view): rows [0, len[b]) of
// slot slot[b] (or b) are positions [0, len[b]).
struct sink_data {
  int cap = 0;
  std::vector<uint16_t> k, v;  // [n_slots][n_kv_head][cap][hd] f16
  std::vector<int32_t> len, slot;
};

// CPU oracle: out [n_q][n_head][hd] f32. With a sink: the pages' positions [body_lo, p] and the sink
// rows j <= p (f32 rotated queries x f16 rows, attn_dense_ref), merged per query (attn_state).
std::vector<float> prefill_ref(const paged_cache& c, const std::vector<uint16_t>& q, kv_elem qe, int n_head,
                               const attn_spec& spec, const std::vector<int>& q_len, int body_lo = 0,
                               const sink_data* sk = nullptr) {
  const int hd = c.f.head_dim, nkv = c.f.n_kv_head, ng = n_head / nkv, batch = c.batch();
  const rotation rot = rotation::make(c.f.rotation, hd, 0);
  const bool quant = c.f.format != kv_format::f16;
  const int qg = c.g.group, nqg = quant ? hd / qg : 1;
  const bool q16 = c.f.format == kv_format::q8;
  int64_t n_q = 0;
  for (int l : q_len) n_q += l;
  std::vector<float> out((size_t)n_q * n_head * hd);
  int64_t qo = 0;
  for (int b = 0; b < batch; ++b) {
    const int L = c.len[b], nq = q_len[b];
    for (int h = 0; h < nkv; ++h) {
      std::vector<float> qr((size_t)nq * ng * hd), qh(qr.size()), obuf(qr.size()), q8s((size_t)nq * ng * nqg);
      std::vector<int8_t> q8(qr.size());
      std::vector<int16_t> q16v(qr.size());
      for (int t = 0; t < nq; ++t)
        for (int gg = 0; gg < ng; ++gg) {
          float* x = &qr[((size_t)t * ng + gg) * hd];
          for (int i = 0; i < hd; ++i) x[i] = half_value(q[(((size_t)(qo + t)) * n_head + h * ng + gg) * hd + i], qe);
          rot.forward(x);
          for (int i = 0; i < hd; ++i) qh[((size_t)t * ng + gg) * hd + i] = f16_to_f32(f32_to_f16(x[i]));
          for (int gi = 0; quant && gi < nqg; ++gi) {
            const size_t e = ((size_t)t * ng + gg) * hd + gi * qg;
            q8s[((size_t)t * ng + gg) * nqg + gi] =
                q16 ? quantize_q16_ref(x + gi * qg, qg, &q16v[e]) : quantize_q8_ref(x + gi * qg, qg, &q8[e]);
          }
        }
      std::vector<attn_state> st((size_t)nq * ng);
      for (size_t i = 0; i < st.size(); ++i) st[i] = attn_state::empty(&obuf[i * hd], hd);
      attn_query_view qv;
      qv.q = quant ? qr.data() : qh.data();
      qv.stride_t = (int64_t)ng * hd;
      qv.n_tokens = nq;
      qv.n_group = ng;
      qv.head_dim = hd;
      qv.pos0 = L - nq;
      qv.spec = spec;
      if (quant) {
        if (q16) qv.q16 = q16v.data();
        else qv.q8 = q8.data();
        qv.q8_scale = q8s.data();
        qv.q8_scale_stride_t = (int64_t)ng * nqg;
        qv.q8_group = qg;
      }
      const size_t cb = c.g.code_bytes, ns = c.g.n_scales;
      const int lo = std::min(body_lo, L), nb = L - lo;  // the pages' positions [lo, L)
      std::vector<uint8_t> kc(std::max(nb, 1) * cb), vc(std::max(nb, 1) * cb);
      std::vector<uint16_t> ks(std::max<size_t>(1, nb * ns)), vs(std::max<size_t>(1, nb * ns));
      for (int j = 0; j < nb; ++j) {
        std::memcpy(&kc[j * cb], c.k_codes(b, lo + j, h), cb);
        std::memcpy(&vc[j * cb], c.v_codes(b, lo + j, h), cb);
        if (ns) {
          std::memcpy(&ks[j * ns], c.k_scales(b, lo + j, h), 2 * ns);
          std::memcpy(&vs[j * ns], c.v_scales(b, lo + j, h), 2 * ns);
        }
      }
      if (nb > 0 && quant) {
        kv_quant_view kv;
        kv.k = {c.f.format, kc.data(), (int64_t)cb, ks.data(), (int64_t)ns, c.g.group};
        kv.v = {c.f.format, vc.data(), (int64_t)cb, vs.data(), (int64_t)ns, c.g.group};
        kv.pos_begin = lo;
        kv.n_pos = nb;
        kv.head_dim = hd;
        attn_quant_ref(kv, qv, st.data());
      } else if (nb > 0) {
        kv_dense_view dv;
        dv.k = kc.data();
        dv.v = vc.data();
        dv.type_k = dv.type_v = kv_elem::f16;
        dv.row_stride = hd;
        dv.pos_begin = lo;
        dv.n_pos = nb;
        dv.head_dim = hd;
        attn_dense_ref(dv, qv, st.data());
      }
      if (sk && sk->len[b] > 0) {
        std::vector<float> ebuf(qr.size());
        std::vector<attn_state> se(st.size());
        for (size_t i = 0; i < se.size(); ++i) se[i] = attn_state::empty(&ebuf[i * hd], hd);
        const size_t eb = ((size_t)(sk->slot.empty() ? b : sk->slot[b]) * nkv + h) * sk->cap * hd;
        kv_dense_view dv;
        dv.k = &sk->k[eb];
        dv.v = &sk->v[eb];
        dv.type_k = dv.type_v = kv_elem::f16;
        dv.row_stride = hd;
        dv.pos_begin = 0;  // row j is position j: causal against the queries' positions
        dv.n_pos = sk->len[b];
        dv.head_dim = hd;
        attn_query_view qe32 = qv;
        qe32.q = qr.data();  // the exact rows see the f32 rotated queries
        qe32.q8 = nullptr;
        qe32.q16 = nullptr;
        qe32.q8_scale = nullptr;
        attn_dense_ref(dv, qe32, se.data());
        for (size_t i = 0; i < st.size(); ++i) st[i].merge(se[i]);
      }
      for (int t = 0; t < nq; ++t)
        for (int gg = 0; gg < ng; ++gg) {
          float* o = &out[(((size_t)(qo + t)) * n_head + h * ng + gg) * hd];
          st[(size_t)t * ng + gg].finalize(o);
          rot.inverse(o);
        }
    }
    qo += nq;
  }
  return out;
}

// The runner's former prefill path: decode_plan with one "sequence" per query token over the pages
// of positions [0, pos0 + t] of its sequence.
std::vector<float> per_token_decode(const paged_cache& c, const std::vector<uint16_t>& q, kv_elem qe, int n_head,
                                    const attn_spec& spec, const std::vector<int>& q_len) {
  std::vector<int32_t> indptr{0}, indices, last;
  for (int b = 0; b < c.batch(); ++b)
    for (int t = 0; t < q_len[b]; ++t) {
      const int len = c.len[b] - q_len[b] + t + 1, np = (len + c.f.page_size - 1) / c.f.page_size;
      indices.insert(indices.end(), c.indices.begin() + c.indptr[b], c.indices.begin() + c.indptr[b] + np);
      indptr.push_back((int32_t)indices.size());
      last.push_back(len - (np - 1) * c.f.page_size);
    }
  const int n = (int)last.size();
  decode_params dp;
  dp.n_head = n_head;
  dp.spec = spec;
  dp.q_elem = qe;
  dp.out_elem = kv_elem::f32;
  decode_plan plan(c.f, dp, indptr.data(), last.data(), n);
  dbuf di = dbuf::from(indptr), dx = dbuf::from(indices), dl = dbuf::from(last), dq = dbuf::from(q);
  dbuf dout((size_t)n * n_head * c.f.head_dim * 4);
  paged_kv_view kv = c.view();
  kv.indptr = di.as<int32_t>();
  kv.indices = dx.as<int32_t>();
  kv.last_page_len = dl.as<int32_t>();
  kv.batch = n;
  plan.run(kv, dq.p, dout.p);
  synchronize();
  return to_host<float>(dout.p, (size_t)n * n_head * c.f.head_dim);
}

class CudaPrefill : public ::testing::TestWithParam<prefill_case> {};

TEST_P(CudaPrefill, MatchesCpuReferenceAndDecodePath) {
  KVQ_REQUIRE_GPU();
  const prefill_case& p = GetParam();
  paged_kv_format f;
  f.format = p.format;
  f.head_dim = p.hd;
  f.n_kv_head = p.n_kv_head;
  f.page_size = p.page_size;
  f.rotation = p.format == kv_format::f16 ? rotation_kind::none : rotation_kind::hadamard;
  std::mt19937 rng(1009 * p.hd + 37 * p.ng + p.kv_len[0] + p.q_len[0]);
  paged_cache c;
  build_cache(c, f, p.kv_len, rng, kv_elem::f16);
  const int n_head = p.ng * p.n_kv_head, hd = p.hd, batch = (int)p.kv_len.size();
  std::vector<int32_t> qo{0};
  for (int l : p.q_len) qo.push_back(qo.back() + l);
  const int n_q = qo.back();
  attn_spec spec;
  spec.scale = 1.0f / std::sqrt((float)hd);
  spec.softcap = p.softcap;
  const std::vector<uint16_t> q = random_halves(rng, (size_t)n_q * n_head * hd, hd, p.qe);
  const std::vector<float> ref = prefill_ref(c, q, p.qe, n_head, spec, p.q_len);

  prefill_params pp;
  pp.n_head = n_head;
  pp.spec = spec;
  pp.q_elem = p.qe;
  pp.out_elem = p.oe;
  prefill_plan plan(f, pp, qo.data(), c.indptr.data(), c.last.data(), batch);
  const size_t n_out = ref.size(), ob = p.oe == kv_elem::f16 ? 2 : 4;
  dbuf dq = dbuf::from(q), dout(n_out * ob);
  std::vector<float> got(n_out);
  double err = 0.0;
  for (int rep = 0; rep < 2; ++rep) {  // twice: poisoned output each time
    device_fill(dout.p, 0xFF, dout.n);
    plan.run(c.view(), dq.p, dout.p);
    synchronize();
    if (p.oe == kv_elem::f16) {
      const std::vector<uint16_t> h = to_host<uint16_t>(dout.p, n_out);
      for (size_t i = 0; i < n_out; ++i) got[i] = f16_to_f32(h[i]);
    } else {
      got = to_host<float>(dout.p, n_out);
    }
    size_t bad = 0;
    for (float x : got) bad += !std::isfinite(x);
    ASSERT_EQ(bad, 0u) << "non-finite (unwritten?) outputs";
    err = std::max(err, rel_err(got, ref));
  }
  // f16 output: its own rounding (2^-11 relative) on top
  const double bound = p.oe == kv_elem::f16 ? 1.5e-3 : 1e-3;
  EXPECT_LE(err, bound) << "tiles " << plan.n_tiles() << ", items " << plan.n_items();
  const std::vector<float> dec = per_token_decode(c, q, p.qe, n_head, spec, p.q_len);
  const double err_dec = rel_err(got, dec), err_dec_ref = rel_err(dec, ref);
  EXPECT_LE(err_dec, bound) << "vs the decode kernel, one sequence per token";
  // per-row check: the worst single query row against the oracle (a wrong causal bound on one row
  // hides in the global RMS of a long chunk)
  double worst_row = 0.0;
  for (size_t r = 0; r < n_out / hd; ++r) {
    const std::vector<float> gr(got.begin() + r * hd, got.begin() + (r + 1) * hd),
        rr(ref.begin() + r * hd, ref.begin() + (r + 1) * hd);
    worst_row = std::max(worst_row, rel_err(gr, rr));
  }
  EXPECT_LE(worst_row, 10 * bound) << "worst query row";
  std::printf("[ prefill  ] rel err %.3g vs cpu, %.3g vs decode path (decode vs cpu %.3g), worst row %.3g, %d tiles, "
              "%d items\n",
              err, err_dec, err_dec_ref, worst_row, plan.n_tiles(), plan.n_items());
}

std::string prefill_name(const ::testing::TestParamInfo<prefill_case>& i) {
  const prefill_case& p = i.param;
  std::string s = std::string(kv_traits(p.format).name) + "_hd" + std::to_string(p.hd) + "_gqa" + std::to_string(p.ng) +
                  "_kv" + std::to_string(p.n_kv_head) + "_p" + std::to_string(p.page_size);
  for (size_t b = 0; b < p.kv_len.size(); ++b) s += "_" + std::to_string(p.kv_len[b]) + "q" + std::to_string(p.q_len[b]);
  return s + (p.qe == kv_elem::bf16 ? "_bf16" : "") + (p.oe == kv_elem::f16 ? "_of16" : "") + (p.softcap > 0 ? "_cap" : "");
}

using V = std::vector<int>;
INSTANTIATE_TEST_SUITE_P(
    Matrix, CudaPrefill,
    ::testing::Values(
        // q4: chunk at 0 (17 of 17), chunk past a history (97 queries after 903), GQA 1 / 7 / 8, page 64
        prefill_case{kv_format::q4, 128, 4, 2, 16, V{1000, 17}, V{97, 17}},
        prefill_case{kv_format::q4, 64, 1, 2, 64, V{300, 64}, V{1, 64}},
        prefill_case{kv_format::q4, 80, 7, 1, 16, V{133}, V{33}},
        prefill_case{kv_format::q4, 96, 8, 1, 64, V{65, 200}, V{31, 129}},
        prefill_case{kv_format::q4, 256, 4, 1, 16, V{200}, V{77}, kv_elem::bf16},
        prefill_case{kv_format::q4, 128, 8, 2, 16, V{4096}, V{512}, kv_elem::f16, kv_elem::f16},
        prefill_case{kv_format::q4, 128, 7, 1, 64, V{2047}, V{255}},
        // q8 (int16 queries)
        prefill_case{kv_format::q8, 128, 7, 2, 16, V{1500}, V{129}},
        prefill_case{kv_format::q8, 80, 1, 1, 64, V{97}, V{97}},
        prefill_case{kv_format::q8, 64, 8, 2, 16, V{50, 1}, V{13, 1}},
        prefill_case{kv_format::q8, 256, 1, 1, 64, V{333}, V{111}, kv_elem::bf16},
        prefill_case{kv_format::q8, 96, 4, 1, 16, V{16, 48}, V{16, 33}, kv_elem::f16, kv_elem::f32, 2.0f},
        // f16
        prefill_case{kv_format::f16, 128, 8, 1, 16, V{700, 65}, V{65, 65}},
        prefill_case{kv_format::f16, 64, 1, 2, 64, V{129}, V{127}},
        prefill_case{kv_format::f16, 80, 7, 1, 16, V{81}, V{19}},
        prefill_case{kv_format::f16, 96, 4, 2, 64, V{257}, V{100}, kv_elem::f16, kv_elem::f32, 1.5f},
        prefill_case{kv_format::f16, 256, 4, 1, 16, V{300}, V{150}, kv_elem::bf16, kv_elem::f16},
        // long histories behind short chunks: the tiles are split over the keys (split-KV + merge)
        prefill_case{kv_format::f16, 128, 4, 2, 16, V{3000, 20}, V{100, 20}},
        prefill_case{kv_format::q4, 80, 8, 1, 64, V{5000}, V{9}},
        prefill_case{kv_format::q8, 128, 1, 1, 16, V{2500}, V{64}, kv_elem::f16, kv_elem::f16}),
    prefill_name);

// The exact sink on the prefill path: prefill_params::body_lo masks the pages' positions below it and
// the run's exact_window_view adds the sink rows j <= each query's position (row j = position j),
// merged per query row in the second kernel (every tile takes the split path's merge). Against the
// oracle (rel <= 1e-3, the worst row <= 1e-2): chunks at position 0 whose first queries see only the
// sink, chunks past a history, body_lo 4 / 70 (past a 64-key tile), a long history split over the
// keys, several sequences reading permuted slots, q8 / q4, GQA 1 / 4 / 7.
struct prefill_sink_case {
  kv_format format;
  int hd, ng, n_kv_head, page_size;
  std::vector<int> kv_len, q_len;
  int body_lo;
  bool slots;
};
void PrintTo(const prefill_sink_case& c, std::ostream* os) {
  *os << kv_traits(c.format).name << "_hd" << c.hd << "_gqa" << c.ng << "_lo" << c.body_lo;
}
class CudaPrefillSink : public ::testing::TestWithParam<prefill_sink_case> {};

TEST_P(CudaPrefillSink, MatchesCpuReference) {
  KVQ_REQUIRE_GPU();
  const prefill_sink_case& p = GetParam();
  paged_kv_format f;
  f.format = p.format;
  f.head_dim = p.hd;
  f.n_kv_head = p.n_kv_head;
  f.page_size = p.page_size;
  f.rotation = rotation_kind::hadamard;
  std::mt19937 rng(2027 * p.hd + 41 * p.ng + p.kv_len[0] + p.body_lo);
  paged_cache c;
  build_cache(c, f, p.kv_len, rng, kv_elem::f16);
  const int n_head = p.ng * p.n_kv_head, hd = p.hd, batch = (int)p.kv_len.size(), S = p.body_lo;
  std::vector<int32_t> qo{0};
  for (int l : p.q_len) qo.push_back(qo.back() + l);
  attn_spec spec;
  spec.scale = 1.0f / std::sqrt((float)hd);
  const std::vector<uint16_t> q = random_halves(rng, (size_t)qo.back() * n_head * hd, hd, kv_elem::f16);
  sink_data sk;
  sk.cap = S;
  const int n_slots = p.slots ? batch + 2 : batch;
  sk.k = random_halves(rng, (size_t)n_slots * p.n_kv_head * S * hd, hd, kv_elem::f16);
  sk.v = random_halves(rng, (size_t)n_slots * p.n_kv_head * S * hd, hd, kv_elem::f16, 0.5f);
  for (int b = 0; b < batch; ++b) {
    sk.len.push_back(std::min(S, p.kv_len[b]));
    if (p.slots) sk.slot.push_back((3 * b + 2) % n_slots);
  }
  const std::vector<float> ref = prefill_ref(c, q, kv_elem::f16, n_head, spec, p.q_len, S, &sk);

  prefill_params pp;
  pp.n_head = n_head;
  pp.spec = spec;
  pp.body_lo = S;
  prefill_plan plan(f, pp, qo.data(), c.indptr.data(), c.last.data(), batch, S);
  dbuf dq = dbuf::from(q), dout(ref.size() * 4), ek = dbuf::from(sk.k), ev = dbuf::from(sk.v), el = dbuf::from(sk.len),
       es;
  exact_window_view ew;
  ew.k = ek.as<uint16_t>();
  ew.v = ev.as<uint16_t>();
  ew.len = el.as<int32_t>();
  ew.cap = S;
  if (p.slots) {
    es = dbuf::from(sk.slot);
    ew.slot = es.as<int32_t>();
  }
  std::vector<float> got;
  double err = 0.0;
  for (int rep = 0; rep < 2; ++rep) {  // twice: poisoned output each time
    device_fill(dout.p, 0xFF, dout.n);
    plan.run(c.view(), dq.p, dout.p, &ew);
    synchronize();
    got = to_host<float>(dout.p, ref.size());
    size_t bad = 0;
    for (float x : got) bad += !std::isfinite(x);
    ASSERT_EQ(bad, 0u) << "non-finite (unwritten?) outputs";
    err = std::max(err, rel_err(got, ref));
  }
  double worst_row = 0.0;
  for (size_t r = 0; r < ref.size() / hd; ++r) {
    const std::vector<float> gr(got.begin() + r * hd, got.begin() + (r + 1) * hd),
        rr(ref.begin() + r * hd, ref.begin() + (r + 1) * hd);
    worst_row = std::max(worst_row, rel_err(gr, rr));
  }
  // without the sink rows (a run with no exact view) the output must be far off: the rows are used
  device_fill(dout.p, 0xFF, dout.n);
  plan.run(c.view(), dq.p, dout.p);
  synchronize();
  const double err_none = rel_err(to_host<float>(dout.p, ref.size()), ref);
  std::printf("[ prefill sink ] rel err %.3g, worst row %.3g (without the sink rows %.3g), %d tiles, %d items\n", err,
              worst_row, err_none, plan.n_tiles(), plan.n_items());
  EXPECT_LE(err, 1e-3);
  EXPECT_LE(worst_row, 1e-2);
  EXPECT_GT(err_none, 10 * err);
}

std::string prefill_sink_name(const ::testing::TestParamInfo<prefill_sink_case>& i) {
  const prefill_sink_case& p = i.param;
  std::string s = std::string(kv_traits(p.format).name) + "_hd" + std::to_string(p.hd) + "_gqa" + std::to_string(p.ng) +
                  "_kv" + std::to_string(p.n_kv_head) + "_p" + std::to_string(p.page_size) + "_lo" +
                  std::to_string(p.body_lo);
  for (size_t b = 0; b < p.kv_len.size(); ++b)
    s += "_" + std::to_string(p.kv_len[b]) + "q" + std::to_string(p.q_len[b]);
  return s + (p.slots ? "_slots" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Sink, CudaPrefillSink,
    ::testing::Values(prefill_sink_case{kv_format::q4, 64, 4, 2, 16, V{200}, V{200}, 4, false},
                      prefill_sink_case{kv_format::q4, 128, 7, 1, 16, V{1000, 3}, V{97, 3}, 4, true},
                      prefill_sink_case{kv_format::q4, 80, 1, 2, 64, V{300}, V{130}, 70, false},
                      prefill_sink_case{kv_format::q4, 128, 4, 1, 16, V{5000}, V{9}, 4, true},
                      prefill_sink_case{kv_format::q8, 128, 4, 2, 16, V{150}, V{150}, 70, true},
                      prefill_sink_case{kv_format::q8, 96, 7, 1, 64, V{2500, 66}, V{64, 66}, 4, false},
                      prefill_sink_case{kv_format::q8, 256, 1, 1, 16, V{333}, V{111}, 20, true}),
    prefill_sink_name);

TEST(CudaPrefillErrors, PlanValidates) {
  KVQ_REQUIRE_GPU();
  paged_kv_format f;
  f.n_kv_head = 2;
  f.page_size = 16;
  const int32_t indptr[2] = {0, 2}, last[1] = {5}, qo[2] = {0, 21};  // 21 positions, 21 queries
  prefill_params pp;
  pp.spec.scale = 0.1f;
  pp.n_head = 8;
  auto expect_error = [&](const prefill_params& p, const int32_t* q, const int32_t* ip, const int32_t* l, errc code,
                          const std::string& what) {
    try {
      prefill_plan plan(f, p, q, ip, l, 1);
      ADD_FAILURE() << "no error: " << what;
    } catch (const kvq::error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("[cuda attn_prefill]", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(prefill_plan(f, pp, qo, indptr, last, 1));
  prefill_params p = pp;
  p.n_head = 3;
  expect_error(p, qo, indptr, last, errc::unsupported, "n_head 3");
  p = pp;
  p.spec.window = 64;
  expect_error(p, qo, indptr, last, errc::unsupported, "sliding window 64");
  p = pp;
  p.q_elem = kv_elem::f32;
  expect_error(p, qo, indptr, last, errc::unsupported, "f32");
  p = pp;
  p.spec.softcap = -1.0f;
  expect_error(p, qo, indptr, last, errc::invalid_input, "softcap");
  const int32_t qo_long[2] = {0, 22};
  expect_error(pp, qo_long, indptr, last, errc::invalid_input, "22 queries");
  const int32_t qo_bad[2] = {1, 5};
  expect_error(pp, qo_bad, indptr, last, errc::invalid_input, "qo_indptr[0]");
  const int32_t bad_last[1] = {17};
  expect_error(pp, qo, indptr, bad_last, errc::invalid_input, "last_page_len[0] = 17");
  p = pp;
  p.body_lo = -1;
  expect_error(p, qo, indptr, last, errc::invalid_input, "body_lo must be >= 0");
  try {
    prefill_plan plan(f, pp, qo, indptr, last, 1, 1025);
    ADD_FAILURE() << "no error: exact_cap 1025";
  } catch (const kvq::error& e) {
    EXPECT_NE(std::string(e.what()).find("exact window capacity"), std::string::npos) << e.what();
  }
  f.head_dim = 72;
  expect_error(pp, qo, indptr, last, errc::unsupported, "head_dim 72");
}

}  // namespace
}  // namespace kvq::cuda::test
