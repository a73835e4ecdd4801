// kvq kv-error: replay KV formats on captured real Q/K/V (see include/kvq/kv_error.h).
#include "kvq/kv_error.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "kvq/error.h"

namespace kvq {

namespace {

// Q/K/V of every layer for one chunk. q: [n_layer][n_ctx, n_head, head_dim];
// k, v: [n_layer][n_ctx, n_kv_head, head_dim].
struct capture {
  std::vector<std::vector<float>> q, k, v;
};

// Per layer, appends K (and V, or the shared `v_all` for every layer) and attends with the captured
// queries, as the model does (each layer's attend right after its own append: kv_cache.h, append);
// out[il]: [n_ctx, n_head, head_dim].
void replay(kv_cache& cache, const capture& cap, const std::vector<float>* v_all, int n, int n_head, float scale,
            thread_pool& pool, std::vector<std::vector<float>>& out) {
  const int L = (int)cap.k.size();
  cache.clear(0);
  for (int il = 0; il < L; ++il) {
    cache.append(il, 0, n, cap.k[il].data(), v_all ? v_all->data() : cap.v[il].data());
    cache.attend(il, 0, 0, n, n_head, cap.q[il].data(), scale, out[il].data(), pool);
  }
}

// The cache parameters of one chunk: every chunk is appended in one batch of n_ctx tokens, so the
// rings of sliding-window layers hold one such batch (n_ubatch >= n_ctx).
kv_cache_params chunk_params(const model& m, int n_ctx, const kv_cache_params& options = {}) {
  kv_cache_params cp = m.cache_params(n_ctx, options);
  cp.n_ubatch = std::max(cp.n_ubatch, n_ctx);
  return cp;
}

}  // namespace

void kv_error_check(const model& m, const kv_error_params& p) {
  const model_hparams& hp = m.hparams();
  const int n = p.n_ctx;
  if (p.formats.empty()) fail_input("[kv_error] no KV formats to compare (give -ctk/-ctv or --types)");
  if (n < 2 || n > hp.n_ctx_train)
    fail_input("[kv_error] context size -c " + std::to_string(n) + " must be in [2, " +
               std::to_string(hp.n_ctx_train) + "] (the model's context)");
  if (p.n_chunks < 1) fail_input("[kv_error] --chunks " + std::to_string(p.n_chunks) + " must be >= 1");
  for (const auto& fp : p.formats) {
    const kv_cache_params cp = chunk_params(m, n, fp);
    validate(cp);
    if (p.tv) {
      kv_cache_params pp = cp;
      pp.type_v = kv_cache_type::f32;
      validate(pp);
    }
  }
}

kv_error_result kv_error(model& m, std::span<const int32_t> tokens, int32_t bos, const kv_error_params& p,
                         const kv_error_progress& progress) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const model_hparams& hp = m.hparams();
  kv_error_result r;
  const int L = hp.n_layer, H = hp.n_head, G = hp.n_kv_head, D = hp.head_dim, n = p.n_ctx;
  kv_error_check(m, p);
  if ((int64_t)tokens.size() < n)
    fail_input("[kv_error] the text has " + std::to_string(tokens.size()) + " tokens, fewer than one chunk of -c " +
               std::to_string(n) + " tokens");
  r.n_layer = L;
  r.n_head = H;
  r.n_kv_head = G;
  r.head_dim = D;
  r.n_ctx = n;
  r.n_chunk = (int)std::min<int64_t>(p.n_chunks, (int64_t)tokens.size() / n);
  r.n_queries = (int64_t)r.n_chunk * n;
  r.has_tv = p.tv;

  // Validate every format (and its exact-V probe variant) before any work.
  const int F = (int)p.formats.size();
  std::vector<std::unique_ptr<kv_cache>> caches, probes;
  kv_cache_params f16p = chunk_params(m, n);
  f16p.type_k = f16p.type_v = kv_cache_type::f16;
  const double f16_bpt = kv_bytes_per_token(f16p);
  for (const auto& fp : p.formats) {
    const kv_cache_params cp = chunk_params(m, n, fp);
    caches.push_back(make_kv_cache(cp));
    kv_error_format f;
    f.type_k = kv_cache_type_name(cp.type_k);
    f.type_v = kv_cache_type_name(cp.type_v);
    f.describe = caches.back()->describe();
    f.bytes_per_token = kv_bytes_per_token(cp);
    f.ratio_vs_f16 = f.bytes_per_token > 0 ? f16_bpt / f.bytes_per_token : 0;
    r.formats.push_back(std::move(f));
    if (p.tv) {
      kv_cache_params pp = cp;
      pp.type_v = kv_cache_type::f32;
      probes.push_back(make_kv_cache(pp));
    }
  }
  kv_cache_params refp = chunk_params(m, n);
  refp.type_k = refp.type_v = kv_cache_type::f32;
  auto ref_cache = make_kv_cache(refp);
  auto capture_cache = make_kv_cache(refp);

  thread_pool pool(p.n_threads);
  capture cap;
  cap.q.assign(L, std::vector<float>((size_t)n * H * D));
  cap.k.assign(L, std::vector<float>((size_t)n * G * D));
  cap.v.assign(L, std::vector<float>((size_t)n * G * D));
  std::vector<std::vector<float>> o_ref(L, std::vector<float>((size_t)n * H * D)), o_fmt = o_ref;
  std::vector<double> ref2((size_t)L * H, 0.0);                            // [n_layer, n_head]
  std::vector<std::vector<double>> err2(F, std::vector<double>((size_t)L * H, 0.0));
  std::vector<std::vector<double>> tv_sum(F, std::vector<double>((size_t)L * H, 0.0));
  const int n_blocks = (n + D - 1) / D;
  std::vector<std::vector<double>> tv_acc;  // per format: [n_layer, n_ctx, n_head] Σ_j |Δp| of one chunk
  std::vector<float> onehot;                // [n_ctx, n_kv_head, head_dim]
  std::vector<float> logits(hp.n_vocab);
  const int total = r.n_chunk * (1 + F + (p.tv ? n_blocks * (1 + F) : 0));
  int done = 0;
  auto step = [&] {
    ++done;
    if (progress) progress(done, total);
  };

  for (int c = 0; c < r.n_chunk; ++c) {
    std::vector<int32_t> chunk(tokens.begin() + (int64_t)c * n, tokens.begin() + (int64_t)(c + 1) * n);
    if (bos >= 0) chunk[0] = bos;
    m.set_attn_observer([&](int il, int pos0, int nt, const float* q, const float* k, const float* v) {
      std::copy(q, q + (size_t)nt * H * D, cap.q[il].begin() + (size_t)pos0 * H * D);
      std::copy(k, k + (size_t)nt * G * D, cap.k[il].begin() + (size_t)pos0 * G * D);
      std::copy(v, v + (size_t)nt * G * D, cap.v[il].begin() + (size_t)pos0 * G * D);
    });
    try {
      capture_cache->clear(0);
      m.forward(chunk, 0, 0, *capture_cache, pool, logits.data(), false);
    } catch (...) {
      m.set_attn_observer({});
      throw;
    }
    m.set_attn_observer({});

    // Attention outputs: f32 reference, then each format.
    replay(*ref_cache, cap, nullptr, n, H, hp.attn_scale, pool, o_ref);
    for (int il = 0; il < L; ++il)
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < H; ++h) {
          const float* a = &o_ref[il][((size_t)t * H + h) * D];
          double s = 0;
          for (int d = 0; d < D; ++d) s += (double)a[d] * a[d];
          ref2[(size_t)il * H + h] += s;
        }
    step();
    for (int f = 0; f < F; ++f) {
      replay(*caches[f], cap, nullptr, n, H, hp.attn_scale, pool, o_fmt);
      for (int il = 0; il < L; ++il)
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < H; ++h) {
            const float* a = &o_ref[il][((size_t)t * H + h) * D];
            const float* b = &o_fmt[il][((size_t)t * H + h) * D];
            double s = 0;
            for (int d = 0; d < D; ++d) s += ((double)b[d] - a[d]) * ((double)b[d] - a[d]);
            err2[f][(size_t)il * H + h] += s;
          }
      step();
    }
    if (!p.tv) continue;

    // Attention probabilities, head_dim keys per pass (one-hot V), reference and each format.
    tv_acc.assign(F, std::vector<double>((size_t)L * n * H, 0.0));
    onehot.assign((size_t)n * G * D, 0.0f);
    for (int b = 0; b < n_blocks; ++b) {
      std::fill(onehot.begin(), onehot.end(), 0.0f);
      const int j0 = b * D, j1 = std::min(n, j0 + D);
      for (int j = j0; j < j1; ++j)
        for (int g = 0; g < G; ++g) onehot[((size_t)j * G + g) * D + (j - j0)] = 1.0f;
      replay(*ref_cache, cap, &onehot, n, H, hp.attn_scale, pool, o_ref);
      step();
      for (int f = 0; f < F; ++f) {
        replay(*probes[f], cap, &onehot, n, H, hp.attn_scale, pool, o_fmt);
        for (int il = 0; il < L; ++il)
          for (int t = j0; t < n; ++t)  // queries before the block see none of its keys
            for (int h = 0; h < H; ++h) {
              const float* a = &o_ref[il][((size_t)t * H + h) * D];
              const float* x = &o_fmt[il][((size_t)t * H + h) * D];
              double s = 0;
              for (int d = 0; d < j1 - j0; ++d) s += std::fabs((double)x[d] - a[d]);
              tv_acc[f][((size_t)il * n + t) * H + h] += s;
            }
        step();
      }
    }
    for (int f = 0; f < F; ++f)
      for (int il = 0; il < L; ++il)
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < H; ++h) tv_sum[f][(size_t)il * H + h] += 0.5 * tv_acc[f][((size_t)il * n + t) * H + h];
  }

  for (int f = 0; f < F; ++f) {
    kv_error_format& o = r.formats[f];
    o.rel_err.resize((size_t)L * H);
    o.tv.resize((size_t)L * H);
    o.layer_rel_err.assign(L, 0.0);
    o.layer_tv.assign(L, 0.0);
    std::vector<kv_error_head> heads;
    for (int il = 0; il < L; ++il)
      for (int h = 0; h < H; ++h) {
        const size_t i = (size_t)il * H + h;
        o.rel_err[i] = ref2[i] > 0 ? std::sqrt(err2[f][i] / ref2[i]) : std::sqrt(err2[f][i]);
        o.tv[i] = tv_sum[f][i] / (double)r.n_queries;
        o.layer_rel_err[il] += o.rel_err[i] / H;
        o.layer_tv[il] += o.tv[i] / H;
        o.max_rel_err = std::max(o.max_rel_err, o.rel_err[i]);
        o.max_tv = std::max(o.max_tv, o.tv[i]);
        heads.push_back({il, h, o.rel_err[i], o.tv[i]});
      }
    o.mean_rel_err = std::accumulate(o.rel_err.begin(), o.rel_err.end(), 0.0) / (double)(L * H);
    o.mean_tv = std::accumulate(o.tv.begin(), o.tv.end(), 0.0) / (double)(L * H);
    std::stable_sort(heads.begin(), heads.end(),
                     [](const kv_error_head& a, const kv_error_head& b) { return a.rel_err > b.rel_err; });
    heads.resize(std::min<size_t>(heads.size(), 5));
    o.worst = heads;
  }
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return r;
}

}  // namespace kvq
