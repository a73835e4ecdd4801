// kvq bench --device cuda (include/kvq/bench_cuda.h): batched decode steps of the model on the GPU.
#include "kvq/bench_cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>
#include <memory>
#include <numeric>
#include <random>

#include "kvq/cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"

namespace kvq {

namespace {

std::unique_ptr<cuda::model_runner> make_runner(const model_hparams& hp, const model* m, kv_cache_params cp, int n_seq,
                                                int n_ctx, uint64_t seed, int max_batch = 0) {
  cp.n_seq = n_seq;
  cp.n_ctx = n_ctx;
  cp.n_layer = hp.n_layer;
  cp.n_kv_head = hp.n_kv_head;
  cp.head_dim = hp.head_dim;
  const int mb = max_batch > 0 ? max_batch : n_seq;
  if (m) return std::make_unique<cuda::model_runner>(*m, cp, mb);
  return std::make_unique<cuda::model_runner>(hp, cp, mb, seed);
}

size_t weights_read_per_step(const cuda::model_runner& r, const model_hparams& hp) {
  const size_t table = (size_t)hp.n_vocab * hp.n_embd * 2;  // f16 embedding table
  return r.weight_bytes() - (hp.tied_output ? 0 : table);   // untied: only B rows of the table are read
}

// Fills n_seq sequences to depth, runs the warm-up and timed steps; fills the row's timings.
void measure(cuda::model_runner& r, const model_hparams& hp, int n_seq, int depth, const bench_cuda_params& p,
             double copy_bw, bench_cuda_row& row) {
  using clock = std::chrono::steady_clock;
  const auto f0 = clock::now();
  for (int b = 0; b < n_seq; ++b) r.fill_synthetic(b, depth, p.seed + (uint64_t)b);
  row.fill_seconds = std::chrono::duration<double>(clock::now() - f0).count();
  std::vector<int32_t> seqs(n_seq), toks(n_seq);
  std::iota(seqs.begin(), seqs.end(), 0);
  std::mt19937 rng((uint32_t)p.seed);
  for (int32_t& t : toks) t = (int32_t)(rng() % (uint32_t)hp.n_vocab);
  const int P = r.page_info().page_size;  // (kivi4: 32)
  row.kv_bytes_read = (size_t)n_seq * (size_t)((depth + 1 + P - 1) / P) * r.kv_bytes_per_page();
  auto steps = [&] {
    std::vector<double> ms;
    for (int s = 0; s < p.n_warmup + p.n_decode; ++s) {
      const auto t0 = clock::now();
      r.decode(seqs, toks, nullptr, toks.data());
      const double t = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
      if (s >= p.n_warmup) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms;
  };
  r.set_cuda_graphs(false);
  const std::vector<double> ms = steps();
  row.step_ms_median = ms[ms.size() / 2];
  row.step_ms_min = ms.front();
  row.step_ms_max = ms.back();
  row.tokens_per_s = n_seq / (row.step_ms_median * 1e-3);
  if (p.graphs) {
    r.set_cuda_graphs(true);
    const std::vector<double> mg = steps();
    row.graph_ms_median = mg[mg.size() / 2];
    r.set_cuda_graphs(false);
  }
  row.weight_bytes_read = weights_read_per_step(r, hp);
  row.kv_bytes_allocated = r.kv_bytes();
  row.bound_ms = (double)(row.weight_bytes_read + row.kv_bytes_read) / copy_bw * 1e3;
  row.x_bound = row.step_ms_median / row.bound_ms;
  row.graph_x_bound = row.graph_ms_median / row.bound_ms;
  row.describe = r.describe();
}

// One prompt of p.prefill_depths through forward() in chunks, tiled then per token (bench_cuda.h).
bench_cuda_prefill_row measure_prefill(const model_hparams& hp, const model* m, const kv_cache_params& f, int P,
                                       const bench_cuda_params& p) {
  using clock = std::chrono::steady_clock;
  bench_cuda_prefill_row row;
  row.type = kv_cache_type_name(f.type_k);
  row.prompt = P;
  row.chunk = std::min(p.prefill_chunk, P);
  auto r = make_runner(hp, m, f, 1, P, p.seed, row.chunk);
  row.describe = r->describe();
  std::mt19937 rng((uint32_t)p.seed + (uint32_t)P);
  std::vector<int32_t> toks(P);
  for (int32_t& t : toks) t = (int32_t)(rng() % (uint32_t)hp.n_vocab);
  std::vector<float> lg_tiled(hp.n_vocab), lg_tok(hp.n_vocab);
  auto prompt = [&](float* lg) {
    r->clear();
    const auto t0 = clock::now();
    for (int c0 = 0; c0 < P; c0 += row.chunk) {
      const int c = std::min(row.chunk, P - c0);
      r->forward(std::span<const int32_t>(toks.data() + c0, c), c0, {}, lg);
    }
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  r->set_tiled_prefill(true);
  r->set_kivi_query_tiles(true);  // KIVI: its query tiles in this column (the default prompt path is per-token's)
  r->clear();
  r->forward(std::span<const int32_t>(toks.data(), row.chunk), 0, {}, lg_tiled.data());  // warm-up (cuBLAS, clocks)
  const int before = r->tiled_prefills();
  row.tiled_seconds = prompt(lg_tiled.data());
  row.tiled_tokens_per_s = P / row.tiled_seconds;
  if (row.chunk >= 64 && r->tiled_prefills() == before)
    fail(errc::internal, "[bench] the tiled prefill kernel did not run");
  if (P <= p.prefill_per_token_max) {
    r->set_tiled_prefill(false);
    row.per_token_seconds = prompt(lg_tok.data());
    row.per_token_tokens_per_s = P / row.per_token_seconds;
    row.speedup = row.tiled_tokens_per_s / row.per_token_tokens_per_s;
    double num = 0, den = 0;
    for (int i = 0; i < hp.n_vocab; ++i) {
      num += ((double)lg_tiled[i] - lg_tok[i]) * ((double)lg_tiled[i] - lg_tok[i]);
      den += (double)lg_tok[i] * lg_tok[i];
    }
    row.logits_rel_rms = std::sqrt(num / std::max(den, 1e-300));
  }
  return row;
}

}  // namespace

bench_cuda_result bench_cuda(const model_hparams& hp, const model* m, const bench_cuda_params& p,
                             const std::function<void(const std::string&)>& progress) {
  auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  if (p.formats.empty()) fail_input("[bench] no KV formats");
  if ((p.batches.empty() || p.depths.empty()) && p.prefill_depths.empty())
    fail_input("[bench] no batches or no depths (and no prefill lengths)");
  for (int d : p.prefill_depths)
    if (d < 1) fail_input("[bench] prefill length " + std::to_string(d) + " must be >= 1");
  if (p.prefill_chunk < 1) fail_input("[bench] prefill chunk " + std::to_string(p.prefill_chunk) + " must be >= 1");
  for (int b : p.batches)
    if (b < 1) fail_input("[bench] batch " + std::to_string(b) + " must be >= 1");
  for (int d : p.depths)
    if (d < 0) fail_input("[bench] depth " + std::to_string(d) + " must be >= 0");
  if (p.n_decode < 1) fail_input("[bench] decode steps " + std::to_string(p.n_decode) + " must be >= 1");
  if (p.n_warmup < 0) fail_input("[bench] warm-up steps " + std::to_string(p.n_warmup) + " must be >= 0");
  if (p.capacity_ctx < 0) fail_input("[bench] capacity context " + std::to_string(p.capacity_ctx) + " must be >= 0");
  const int timed = (p.n_warmup + p.n_decode) * (p.graphs ? 2 : 1);
  for (const kv_cache_params& f : p.formats) {
    kv_cache_params cp = f;
    cp.n_ctx = 1;
    cp.n_seq = 1;
    cp.n_layer = hp.n_layer;
    cp.n_kv_head = hp.n_kv_head;
    cp.head_dim = hp.head_dim;
    cuda::check_supported(hp, cp, 1);  // every format before any work
  }
  cuda::require();

  bench_cuda_result res;
  res.device = cuda::device_name();
  res.model_desc = hp.arch + ", " + std::to_string(hp.n_layer) + " layers, n_embd " + std::to_string(hp.n_embd) + ", " +
                   std::to_string(hp.n_head) + " q / " + std::to_string(hp.n_kv_head) + " kv heads, head_dim " +
                   std::to_string(hp.head_dim) + ", n_ff " + std::to_string(hp.n_ff) + ", vocab " +
                   std::to_string(hp.n_vocab) + (m ? ", the model's weights in f16" : ", random f16 weights");
  cuda::memory_info(&res.mem_free_start, &res.mem_total);
  say("copy bandwidth");
  res.copy_bandwidth = cuda::copy_bandwidth(size_t(4) << 30, 20);

  for (int B : p.batches)
    for (int D : p.depths) {
      const size_t first = res.rows.size();
      for (const kv_cache_params& f : p.formats) {
        bench_cuda_row row;
        row.type = kv_cache_type_name(f.type_k);
        row.batch = B;
        row.depth = D;
        say(row.type + " batch " + std::to_string(B) + " depth " + std::to_string(D));
        auto r = make_runner(hp, m, f, B, D + timed, p.seed);
        measure(*r, hp, B, D, p, res.copy_bandwidth, row);
        res.rows.push_back(row);
      }
      for (size_t i = first; i < res.rows.size(); ++i)
        for (size_t j = first; j < res.rows.size(); ++j)
          if (res.rows[j].type == "f16")
            res.rows[i].speedup_vs_f16 = res.rows[i].tokens_per_s / res.rows[j].tokens_per_s;
    }

  for (int P : p.prefill_depths)
    for (const kv_cache_params& f : p.formats) {
      say(std::string(kv_cache_type_name(f.type_k)) + " prefill " + std::to_string(P));
      res.prefill.push_back(measure_prefill(hp, m, f, P, p));
    }

  if (p.capacity_ctx > 0) {
    const size_t first = res.rows.size();
    for (const kv_cache_params& f : p.formats) {
      bench_cuda_row row;
      row.type = kv_cache_type_name(f.type_k);
      row.capacity = true;
      row.depth = p.capacity_ctx;
      const int n_ctx = p.capacity_ctx + timed;
      say(row.type + " capacity at " + std::to_string(p.capacity_ctx));
      size_t per_page = 0, free_b = 0, total_b = 0, probe_pool = 0;
      {
        auto probe = make_runner(hp, m, f, 1, 16, p.seed);
        per_page = probe->kv_bytes_per_page();
        probe_pool = probe->kv_bytes();
        cuda::memory_info(&free_b, &total_b);
      }
      const size_t per_seq = (size_t)((n_ctx + 15) / 16) * per_page;
      const size_t avail = free_b + probe_pool > p.reserve_bytes ? free_b + probe_pool - p.reserve_bytes : 0;
      int N = (int)(avail / per_seq);
      std::unique_ptr<cuda::model_runner> r;
      while (N >= 1 && !r) {
        try {
          r = make_runner(hp, m, f, N, n_ctx, p.seed);
        } catch (const error& e) {
          if (std::string(e.what()).find("out of device memory") == std::string::npos) throw;
          --N;  // the estimate left too little for the activations: one fewer
        }
      }
      if (!r)
        fail_input("[bench] not one sequence of " + std::to_string(p.capacity_ctx) + " positions fits (" + row.type +
                   ")");
      row.batch = N;
      measure(*r, hp, N, p.capacity_ctx, p, res.copy_bandwidth, row);
      res.rows.push_back(row);
    }
    for (size_t i = first; i < res.rows.size(); ++i)
      for (size_t j = first; j < res.rows.size(); ++j)
        if (res.rows[j].type == "f16") res.rows[i].speedup_vs_f16 = res.rows[i].tokens_per_s / res.rows[j].tokens_per_s;
  }
  return res;
}

}  // namespace kvq
