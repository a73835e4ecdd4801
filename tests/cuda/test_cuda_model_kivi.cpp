// The model on the GPU with the KIVI cache (-ctk kivi4 -ctv q4a / kivi4, exact sink, residual 32;
// docs/cuda.md "KIVI") against the CPU engine with the same cache on tinylit (llama, head_dim 64,
// GQA 4); batched decode against single-sequence steps; what the GPU refuses of KIVI (host only,
// runs everywhere).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "kvq/model.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

constexpr const char* kTinylit = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf";

kv_cache_params kivi_of(const model& m, kv_cache_type tv, int n_ctx, int sink, int n_seq = 1) {
  kv_cache_params o;
  o.type_k = kv_cache_type::kivi4;
  o.type_v = tv;
  o.sink = sink;
  return m.cache_params(n_ctx, o, n_seq);
}

// BOS then n - 1 tokens sampled (temperature 1, fixed seed) from the CPU model with an f32 cache.
std::vector<int32_t> sample_tokens(model& m, int n, uint32_t seed) {
  const int V = m.hparams().n_vocab;
  kv_cache_params o;
  o.type_k = o.type_v = kv_cache_type::f32;
  auto cache = make_kv_cache(m.cache_params(n, o));
  thread_pool pool(0);
  std::vector<float> lg(V);
  std::vector<int32_t> ids{1};
  std::mt19937 rng(seed);
  while ((int)ids.size() < n) {
    m.forward(std::span<const int32_t>(&ids.back(), 1), (int)ids.size() - 1, 0, *cache, pool, lg.data(), false);
    const float mx = *std::max_element(lg.begin(), lg.end());
    std::vector<double> w(V);
    for (int i = 0; i < V; ++i) w[i] = std::exp((double)lg[i] - mx);
    std::discrete_distribution<int> d(w.begin(), w.end());
    ids.push_back(d(rng));
  }
  return ids;
}

// Logits of every position: the first n_prefill tokens in one forward, then one token at a time.
std::vector<float> cpu_logits(model& m, const kv_cache_params& cp, const std::vector<int32_t>& ids, int n_prefill) {
  const int V = m.hparams().n_vocab, n = (int)ids.size();
  auto cache = make_kv_cache(cp);
  thread_pool pool(0);
  std::vector<float> out((size_t)n * V);
  m.forward(std::span<const int32_t>(ids.data(), n_prefill), 0, 0, *cache, pool, out.data(), true);
  for (int t = n_prefill; t < n; ++t)
    m.forward(std::span<const int32_t>(&ids[t], 1), t, 0, *cache, pool, &out[(size_t)t * V], false);
  return out;
}

// rms of a - b over the RMS of b about each row's mean; argmax agreement
struct diff {
  double rel = 0;
  int argmax_same = 0, rows = 0;
};
diff compare(const std::vector<float>& a, const std::vector<float>& b, int V) {
  diff d;
  double ss = 0, sr = 0;
  d.rows = (int)(a.size() / V);
  for (int r = 0; r < d.rows; ++r) {
    const float* x = &a[(size_t)r * V];
    const float* y = &b[(size_t)r * V];
    double mean = 0;
    for (int i = 0; i < V; ++i) mean += y[i];
    mean /= V;
    for (int i = 0; i < V; ++i) {
      ss += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
      sr += (y[i] - mean) * (y[i] - mean);
    }
    d.argmax_same += std::max_element(x, x + V) - x == std::max_element(y, y + V) - y;
  }
  d.rel = std::sqrt(ss / std::max(sr, 1e-300));
  return d;
}

void expect_refused(const model& m, const kv_cache_params& cp, const std::string& needle) {
  try {
    cuda::check_supported(m, cp, 512);
    ADD_FAILURE() << "no error for " << needle;
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(CudaModelKiviCheck, RunsKivi4AndRefusesTheRest) {
  KVQ_REQUIRE_DATA(mp, kTinylit);
  auto m = model::load(mp);
  EXPECT_NO_THROW(cuda::check_supported(*m, kivi_of(*m, kv_cache_type::q4a, 256, 4), 512));
  EXPECT_NO_THROW(cuda::check_supported(*m, kivi_of(*m, kv_cache_type::kivi4, 256, 0), 512));
  EXPECT_EQ(cuda::runner_page_bytes(m->hparams(), kivi_of(*m, kv_cache_type::q4a, 256, 4)),
            (size_t)m->hparams().n_layer * m->hparams().n_kv_head * (2 * 32 * 32 + 4 * 64 + 32 * 2 * 2 * 2));
  kv_cache_params cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.type_k = kv_cache_type::kivi2;
  expect_refused(*m, cp, "other KIVI types have no GPU kernels");
  cp = kivi_of(*m, kv_cache_type::q4, 256, 4);
  expect_refused(*m, cp, "-ctk kivi4 -ctv q4: the GPU's KIVI cache is -ctk kivi4 with -ctv q4a or kivi4");
  cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.type_k = kv_cache_type::q4a;
  expect_refused(*m, cp, "cache type 'q4a' has no GPU kernels");  // q4a / q4a: no per-token asymmetric pages
  cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.kivi_group = 64;
  expect_refused(*m, cp, "--kv-kivi-group 64");
  cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.rotation = rotation_kind::hadamard;
  expect_refused(*m, cp, "would rotate K as well");
  cp.rotation = rotation_kind::none;
  EXPECT_NO_THROW(cuda::check_supported(*m, cp, 512)) << "V unrotated";
  cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.k_channel_scale = true;
  expect_refused(*m, cp, "the K channel scale");
  cp = kivi_of(*m, kv_cache_type::q4a, 256, 4);
  cp.group_size = 64;
  expect_refused(*m, cp, "group size 64");
}

// GPU vs the CPU engine with the same cache (kivi4 / q4a, sink 4): a prompt in one forward (200 or
// 40 tokens; 1000 with max_batch 1000: two steps of the runner's 988-token KIVI step, the second's
// queries keeping their own exact residual as the CPU's attend does), then decode steps (groups
// completing on the way). The GPU's products round activations to f16 (the CPU keeps f32), so K / V values near a
// code boundary may take the other code: bound rel RMS 6e-2 (the GPU-vs-CPU q4 bound of
// test_cuda_model.cpp). The GPU must be closer to the CPU's KIVI cache than to the CPU's f16 cache
// (it stores the same codes, not merely something close to f16).
struct kivi_model_case {
  kv_cache_type type_v;
  int sink, n_prefill, n = 320, max_batch = 256;
};
class CudaModelKivi : public ::testing::TestWithParam<kivi_model_case> {};

TEST_P(CudaModelKivi, MatchCpuEngine) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  const kivi_model_case tc = GetParam();
  auto m = model::load(mp);
  const int V = m->hparams().n_vocab, n = tc.n;
  const std::vector<int32_t> ids = sample_tokens(*m, n, 29);
  const kv_cache_params cp = kivi_of(*m, tc.type_v, 1280, tc.sink);
  cuda::model_runner r(*m, cp, tc.max_batch);
  std::vector<float> gpu((size_t)n * V);
  std::vector<uint8_t> all(tc.n_prefill, 1);
  ASSERT_EQ(r.forward(std::span<const int32_t>(ids.data(), tc.n_prefill), 0, all, gpu.data()), tc.n_prefill);
  for (int t = tc.n_prefill; t < n; ++t)
    r.decode(std::vector<int32_t>{0}, std::vector<int32_t>{ids[t]}, &gpu[(size_t)t * V], nullptr);
  EXPECT_EQ(r.n_pos(0), n);
  const std::vector<float> cpu = cpu_logits(*m, cp, ids, tc.n_prefill);
  kv_cache_params f16 = cp;
  f16.type_k = f16.type_v = kv_cache_type::f16;
  f16.sink = 0;
  const std::vector<float> cpu_f16 = cpu_logits(*m, f16, ids, tc.n_prefill);
  const diff d = compare(gpu, cpu, V), d16 = compare(gpu, cpu_f16, V), c16 = compare(cpu, cpu_f16, V);
  std::printf(
      "[ gpu vs cpu kivi4/%s sink %d prefill %d ] %s: rel rms %.3e, argmax same %d/%d; vs cpu f16 %.3e "
      "(cpu kivi vs cpu f16 %.3e)\n",
      kv_cache_type_name(tc.type_v), tc.sink, tc.n_prefill, r.describe().c_str(), d.rel, d.argmax_same, d.rows, d16.rel,
      c16.rel);
  EXPECT_LE(d.rel, 6e-2);
  EXPECT_LT(d.rel, d16.rel);
  EXPECT_EQ(r.tiled_prefills(), 0) << "KIVI prompts attend through the per-query kernel unless the tiles are asked for";
  if (tc.n_prefill == 200 && tc.sink == 4) {
    // the prompt through the query tiles instead of the per-query kernel: the same codes, other
    // float order (a value near an f16 or code boundary may then round the other way in a later layer)
    r.clear();
    r.set_kivi_query_tiles(true);
    std::vector<float> tiled((size_t)tc.n_prefill * V), per(gpu.begin(), gpu.begin() + (size_t)tc.n_prefill * V);
    ASSERT_EQ(r.forward(std::span<const int32_t>(ids.data(), tc.n_prefill), 0, all, tiled.data()), tc.n_prefill);
    EXPECT_GT(r.tiled_prefills(), 0);
    const diff dt = compare(tiled, per, V);
    std::printf("[ kivi tiles vs per-entry prompt ] rel rms %.3e, argmax same %d/%d\n", dt.rel, dt.argmax_same,
                dt.rows);
    EXPECT_LE(dt.rel, 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CudaModelKivi,
                         ::testing::Values(kivi_model_case{kv_cache_type::q4a, 4, 200},
                                           kivi_model_case{kv_cache_type::q4a, 4, 40},
                                           kivi_model_case{kv_cache_type::kivi4, 0, 200},
                                           kivi_model_case{kv_cache_type::q4a, 37, 200},
                                           kivi_model_case{kv_cache_type::q4a, 4, 1000, 1040, 1000}),
                         [](const auto& i) {
                           return std::string(kv_cache_type_name(i.param.type_v)) + "_sink" +
                                  std::to_string(i.param.sink) + "_prefill" + std::to_string(i.param.n_prefill) +
                                  "_batch" + std::to_string(i.param.max_batch);
                         });

// Batched decode (4 sequences of different lengths in one runner, permuted order) against the same
// sequences one at a time: the same codes and exact rows per sequence; the products and the plan's
// split differ with the batch (f16 rounding), so bound rel RMS 6e-2 as the q4 case of
// test_cuda_model.cpp's CudaModelBatched; the steps cross group boundaries (prompts 64 and 100).
TEST(CudaModelKiviBatched, StepEqualsSingleSequenceSteps) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  auto m = model::load(mp);
  const int V = m->hparams().n_vocab, n_steps = 8;
  const std::vector<int> prompt_len{37, 5, 100, 64};
  const int B = (int)prompt_len.size();
  std::vector<std::vector<int32_t>> ids(B);
  for (int b = 0; b < B; ++b) ids[b] = sample_tokens(*m, prompt_len[b] + n_steps, 100 + b);
  const kv_cache_params cp = kivi_of(*m, kv_cache_type::q4a, 160, 4, B), one = kivi_of(*m, kv_cache_type::q4a, 160, 4);
  cuda::model_runner rb(*m, cp, 128);
  std::vector<float> lg((size_t)128 * V);
  for (int b = 0; b < B; ++b)
    ASSERT_EQ(rb.forward(std::span<const int32_t>(ids[b].data(), prompt_len[b]), 0, {}, lg.data(), b), 1);
  const std::vector<int32_t> order{2, 0, 3, 1};
  std::vector<std::vector<float>> batched(B, std::vector<float>((size_t)n_steps * V));
  std::vector<float> step_lg((size_t)B * V);
  std::vector<int32_t> toks(B), am(B);
  for (int s = 0; s < n_steps; ++s) {
    for (int i = 0; i < B; ++i) toks[i] = ids[order[i]][prompt_len[order[i]] + s];
    rb.decode(order, toks, step_lg.data(), am.data());
    for (int i = 0; i < B; ++i) {
      const float* row = &step_lg[(size_t)i * V];
      std::copy(row, row + V, &batched[order[i]][(size_t)s * V]);
      EXPECT_EQ(am[i], (int32_t)(std::max_element(row, row + V) - row));
    }
  }
  // the same steps as CUDA graphs (groups and moves padded to one per sequence; steps 0 and 4 complete
  // a group of the 100- and 64-token prompts): the same bits, and replays
  {
    cuda::model_runner rg(*m, cp, 128);
    rg.set_cuda_graphs(true);
    for (int b = 0; b < B; ++b)
      ASSERT_EQ(rg.forward(std::span<const int32_t>(ids[b].data(), prompt_len[b]), 0, {}, lg.data(), b), 1);
    size_t same = 0;
    for (int s = 0; s < n_steps; ++s) {
      for (int i = 0; i < B; ++i) toks[i] = ids[order[i]][prompt_len[order[i]] + s];
      rg.decode(order, toks, step_lg.data(), am.data());
      for (int i = 0; i < B; ++i)
        same += std::equal(step_lg.begin() + (size_t)i * V, step_lg.begin() + (size_t)(i + 1) * V,
                           batched[order[i]].begin() + (size_t)s * V);
    }
    std::printf("[ kivi graph vs direct ] %zu of %d rows identical; %d steps: %d captured, %d instantiations\n", same,
                B * n_steps, n_steps, rg.graph_captures(), rg.graph_instantiations());
    EXPECT_EQ(same, (size_t)(B * n_steps));
    EXPECT_GE(rg.graph_instantiations(), 1);
    EXPECT_LT(rg.graph_captures(), n_steps) << "no step was replayed";
    for (int b = 0; b < B; ++b) EXPECT_EQ(rg.n_pos(b), prompt_len[b] + n_steps);
  }
  cuda::model_runner r1(*m, one, 128);
  for (int b = 0; b < B; ++b) {
    r1.clear();
    ASSERT_EQ(r1.forward(std::span<const int32_t>(ids[b].data(), prompt_len[b]), 0, {}, lg.data()), 1);
    std::vector<float> single((size_t)n_steps * V);
    for (int s = 0; s < n_steps; ++s)
      r1.forward(std::span<const int32_t>(&ids[b][prompt_len[b] + s], 1), prompt_len[b] + s, {},
                 &single[(size_t)s * V]);
    const diff d = compare(batched[b], single, V);
    std::printf("[ kivi batched vs single ] sequence %d (%d prompt tokens): rel rms %.3e, argmax same %d/%d\n", b,
                prompt_len[b], d.rel, d.argmax_same, d.rows);
    EXPECT_LE(d.rel, 6e-2) << "sequence " << b;
  }
}

// fill_synthetic's KIVI path (the benchmark's cache fill): a filled sequence then decodes; a cleared
// one starts again from position 0 with its residual reset.
TEST(CudaModelKiviBatched, SyntheticFillThenDecode) {
  KVQ_REQUIRE_GPU();
  KVQ_REQUIRE_DATA(mp, kTinylit);
  auto m = model::load(mp);
  const int V = m->hparams().n_vocab;
  cuda::model_runner r(*m, kivi_of(*m, kv_cache_type::q4a, 2048, 4, 2), 64);
  r.fill_synthetic(0, 1000, 5);
  r.fill_synthetic(0, 77, 6);
  EXPECT_EQ(r.n_pos(0), 1077);
  std::vector<float> lg((size_t)2 * V);
  std::vector<int32_t> am(2);
  r.forward(std::vector<int32_t>{1, 5, 9}, 0, {}, lg.data(), 1);
  r.decode(std::vector<int32_t>{0, 1}, std::vector<int32_t>{3, 4}, lg.data(), am.data());
  EXPECT_EQ(r.n_pos(0), 1078);
  EXPECT_EQ(r.n_pos(1), 4);
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(am[i], (int32_t)(std::max_element(lg.begin() + (size_t)i * V, lg.begin() + (size_t)(i + 1) * V) -
                               (lg.begin() + (size_t)i * V)));
  r.clear_seq(0);
  EXPECT_EQ(r.n_pos(0), 0);
  r.forward(std::vector<int32_t>{1, 5, 9}, 0, {}, lg.data(), 0);
  // sequence 0 now holds what sequence 1 held before its decode step: the same last logits
  std::vector<float> a(V), b(V);
  r.forward(std::vector<int32_t>{7}, 3, {}, a.data(), 0);
  cuda::model_runner r2(*m, kivi_of(*m, kv_cache_type::q4a, 2048, 4, 1), 64);
  r2.forward(std::vector<int32_t>{1, 5, 9}, 0, {}, lg.data(), 0);
  r2.forward(std::vector<int32_t>{7}, 3, {}, b.data(), 0);
  EXPECT_LE(compare(a, b, V).rel, 1e-5);
}

}  // namespace
}  // namespace kvq
