// kvq bench: decode/prefill speed and KV bytes of KV formats against depth (see kvq/bench.h).
#include "kvq/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "kvq/error.h"

namespace kvq {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Token source: the text repeated, or pseudo-random ids.
struct token_source {
  std::span<const int32_t> text;
  int n_vocab = 1;
  uint64_t seed = 1;
  int32_t at(int64_t i) const {
    if (!text.empty()) return text[(size_t)(i % (int64_t)text.size())];
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (int32_t)((z ^ (z >> 31)) % (uint64_t)n_vocab);
  }
  void fill(int64_t start, int n, std::vector<int32_t>& out) const {
    out.resize(n);
    for (int i = 0; i < n; ++i) out[i] = at(start + i);
  }
};

// Per layer and channel statistics of K and V (after RoPE) measured on a real prefill; synthetic
// rows are mean + std * z with z from a fixed pool of standard normal values.
struct kv_stats {
  int L = 0, G = 0, D = 0;
  std::vector<float> k_mean, k_std, v_mean, v_std;  // [n_layer, n_kv_head * head_dim]
  std::vector<float> pool;                           // standard normals
};

kv_stats measure_kv_stats(model& m, const token_source& src, thread_pool& pool, uint64_t seed) {
  const model_hparams& hp = m.hparams();
  kv_stats s;
  s.L = hp.n_layer;
  s.G = hp.n_kv_head;
  s.D = hp.head_dim;
  const int C = s.G * s.D;
  const int n = std::min(256, std::max(16, hp.n_ctx_train));
  std::vector<double> sk((size_t)s.L * C), sk2(sk.size()), sv(sk.size()), sv2(sk.size());
  m.set_attn_observer([&](int il, int, int nt, const float*, const float* k, const float* v) {
    for (int t = 0; t < nt; ++t)
      for (int c = 0; c < C; ++c) {
        const double a = k[(size_t)t * C + c], b = v[(size_t)t * C + c];
        sk[(size_t)il * C + c] += a;
        sk2[(size_t)il * C + c] += a * a;
        sv[(size_t)il * C + c] += b;
        sv2[(size_t)il * C + c] += b * b;
      }
  });
  kv_cache_params cp = m.cache_params(n);
  cp.type_k = cp.type_v = "f32";
  auto cache = make_kv_cache(cp);
  std::vector<int32_t> toks;
  src.fill(0, n, toks);
  std::vector<float> logits(hp.n_vocab);
  try {
    m.forward(toks, 0, 0, *cache, pool, logits.data(), false);
  } catch (...) {
    m.set_attn_observer({});
    throw;
  }
  m.set_attn_observer({});
  auto finish = [&](const std::vector<double>& s1, const std::vector<double>& s2, std::vector<float>& mean,
                    std::vector<float>& sd) {
    mean.resize(s1.size());
    sd.resize(s1.size());
    for (size_t i = 0; i < s1.size(); ++i) {
      const double mu = s1[i] / n, var = std::max(0.0, s2[i] / n - mu * mu);
      mean[i] = (float)mu;
      sd[i] = (float)std::sqrt(var);
    }
  };
  finish(sk, sk2, s.k_mean, s.k_std);
  finish(sv, sv2, s.v_mean, s.v_std);
  // Box-Muller pool (a prime length so that rows start at varying offsets).
  s.pool.resize(65521);
  uint64_t z = seed | 1;
  auto uni = [&] {
    z ^= z << 13;
    z ^= z >> 7;
    z ^= z << 17;
    return ((double)(z >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  };
  for (size_t i = 0; i < s.pool.size(); i += 2) {
    const double r = std::sqrt(-2 * std::log(uni())), th = 6.283185307179586 * uni();
    s.pool[i] = (float)(r * std::cos(th));
    if (i + 1 < s.pool.size()) s.pool[i + 1] = (float)(r * std::sin(th));
  }
  return s;
}

// Appends synthetic K/V for positions [from, to) of sequence 0, n_batch rows per append.
void fill_synthetic(kv_cache& cache, const kv_stats& s, int from, int to, int n_batch, std::vector<float>& kb,
                    std::vector<float>& vb) {
  const int C = s.G * s.D;
  const size_t P = s.pool.size();
  for (int p = from; p < to; p += n_batch) {
    const int nb = std::min(n_batch, to - p);
    kb.resize((size_t)nb * C);
    vb.resize((size_t)nb * C);
    for (int il = 0; il < s.L; ++il) {
      for (int t = 0; t < nb; ++t) {
        const uint64_t row = (uint64_t)(p + t) * 2654435761ull + (uint64_t)il * 40503ull;
        size_t o = (size_t)(row % P);
        const float* km = &s.k_mean[(size_t)il * C];
        const float* ks = &s.k_std[(size_t)il * C];
        const float* vm = &s.v_mean[(size_t)il * C];
        const float* vs = &s.v_std[(size_t)il * C];
        for (int c = 0; c < C; ++c) {
          kb[(size_t)t * C + c] = km[c] + ks[c] * s.pool[o];
          o = o + 1 == P ? 0 : o + 1;
          vb[(size_t)t * C + c] = vm[c] + vs[c] * s.pool[o];
          o = o + 1 == P ? 0 : o + 1;
        }
      }
      cache.append(il, 0, nb, kb.data(), vb.data());
    }
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

bench_result bench(model& m, std::span<const int32_t> tokens, const bench_params& p, const bench_progress& progress) {
  const model_hparams& hp = m.hparams();
  bench_result r;
  if (p.formats.empty()) fail_input("[bench] no KV formats to run");
  if (p.depths.empty()) fail_input("[bench] no depths to run");
  for (int d : p.depths)
    if (d < 0) fail_input("[bench] depth " + std::to_string(d) + " must be >= 0");
  if (p.n_decode < 1) fail_input("[bench] -n " + std::to_string(p.n_decode) + " decode steps must be >= 1");
  if (p.n_prefill < 0) fail_input("[bench] prefill tokens " + std::to_string(p.n_prefill) + " must be >= 0");
  if (p.n_batch < 1) fail_input("[bench] batch " + std::to_string(p.n_batch) + " must be >= 1");
  if (p.fill != "real" && p.fill != "synthetic")
    fail_input("[bench] --fill '" + p.fill + "' must be real or synthetic");
  for (int32_t t : tokens)
    if (t < 0 || t >= hp.n_vocab) fail_input("[bench] token id " + std::to_string(t) + " is outside the vocabulary");
  std::vector<int> depths = p.depths;
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  r.fill = p.fill;
  r.n_ctx = depths.back() + std::max(p.n_decode + 1, p.n_prefill);

  // f16 first (the baseline of every ratio), then the requested formats in order.
  std::vector<kv_cache_params> formats;
  std::vector<bool> baseline_only;
  bool has_f16 = false;
  for (const auto& f : p.formats) has_f16 = has_f16 || (f.type_k == "f16" && f.type_v == "f16");
  if (!has_f16) {
    kv_cache_params f16 = p.formats.front();
    f16.type_k = f16.type_v = "f16";
    formats.push_back(f16);
    baseline_only.push_back(true);
  }
  for (const auto& f : p.formats) {
    formats.push_back(f);
    baseline_only.push_back(false);
  }
  const kv_cache_params shape = m.cache_params(r.n_ctx);
  for (auto& f : formats) {
    f.n_layer = shape.n_layer;
    f.n_kv_head = shape.n_kv_head;
    f.head_dim = shape.head_dim;
    f.n_ctx = r.n_ctx;
    f.n_seq = 1;
    kv_bytes_per_token(f);  // validates the type and options before any work
  }
  r.model_desc = hp.arch + ", " + std::to_string(hp.n_layer) + " layers, n_embd " + std::to_string(hp.n_embd) +
                 ", " + std::to_string(hp.n_head) + "/" + std::to_string(hp.n_kv_head) + " heads, head_dim " +
                 std::to_string(hp.head_dim) + ", vocab " + std::to_string(hp.n_vocab) +
                 (hp.name.empty() ? std::string() : " (" + hp.name + ")");

  thread_pool pool(p.n_threads);
  r.n_threads = pool.size();
  token_source src{tokens, hp.n_vocab, p.seed};
  kv_stats stats;
  if (p.fill == "synthetic") {
    if (progress) progress("measuring K/V statistics on a real prefill");
    stats = measure_kv_stats(m, src, pool, p.seed);
  }
  std::vector<float> logits(hp.n_vocab), kb, vb;  // [n_vocab]: last token only
  std::vector<int32_t> toks;
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };

  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const kv_cache_params& cp = formats[fi];
    const std::string name = cp.type_k == cp.type_v ? cp.type_k : cp.type_k + "/" + cp.type_v;
    std::unique_ptr<kv_cache> cache = make_kv_cache(cp);
    int filled = 0;
    for (int d : depths) {
      bench_row row;
      row.type_k = cp.type_k;
      row.type_v = cp.type_v;
      row.describe = cache->describe();
      row.baseline_only = baseline_only[fi];
      row.depth = d;
      row.beyond_train_ctx = d + std::max(p.n_decode + 1, p.n_prefill) > hp.n_ctx_train;
      row.kv_bytes_per_token = kv_bytes_per_token(cp);

      // 1. fill to depth d
      say(name + " depth " + std::to_string(d) + ": fill (" + p.fill + ")");
      const auto tf = clock_type::now();
      if (filled > d) {  // cannot happen with ascending depths; kept for safety
        cache->clear(0);
        filled = 0;
      }
      if (p.fill == "real") {
        for (int pos = filled; pos < d; pos += p.n_batch) {
          const int nb = std::min(p.n_batch, d - pos);
          src.fill(pos, nb, toks);
          m.forward(toks, pos, 0, *cache, pool, logits.data(), false);
        }
      } else {
        fill_synthetic(*cache, stats, filled, d, p.n_batch, kb, vb);
      }
      filled = d;
      row.fill_seconds = seconds_since(tf);
      row.kv_bytes_used = cache->bytes_used();
      row.kv_bytes_allocated = cache->bytes();

      // 2. prefill n_prefill tokens at depth d
      if (p.n_prefill > 0) {
        say(name + " depth " + std::to_string(d) + ": prefill " + std::to_string(p.n_prefill));
        src.fill(d, p.n_prefill, toks);
        const auto t0 = clock_type::now();
        m.forward(toks, d, 0, *cache, pool, logits.data(), false);
        const double s = seconds_since(t0);
        row.prefill_tokens_per_s = s > 0 ? p.n_prefill / s : 0;
        cache->truncate(0, d);
      }

      // 3. decode: a warm-up step, then n_decode timed steps
      say(name + " depth " + std::to_string(d) + ": decode " + std::to_string(p.n_decode));
      std::vector<double> steps;
      double total = 0;
      for (int i = 0; i <= p.n_decode; ++i) {
        const int32_t id = src.at(d + i);
        const auto t0 = clock_type::now();
        m.forward(std::span<const int32_t>(&id, 1), d + i, 0, *cache, pool, logits.data(), false);
        const double s = seconds_since(t0);
        if (i > 0) {
          steps.push_back(s);
          total += s;
        }
      }
      cache->truncate(0, d);
      const double med = median(steps);
      row.decode_ms_median = 1e3 * med;
      row.decode_ms_min = 1e3 * *std::min_element(steps.begin(), steps.end());
      row.decode_ms_max = 1e3 * *std::max_element(steps.begin(), steps.end());
      row.decode_tokens_per_s = med > 0 ? 1.0 / med : 0;
      row.decode_tokens_per_s_mean = total > 0 ? p.n_decode / total : 0;
      r.rows.push_back(row);
    }
  }

  // Ratios to f16 at the same depth.
  std::map<int, const bench_row*> f16_at;
  for (const auto& row : r.rows)
    if (row.type_k == "f16" && row.type_v == "f16" && !f16_at.count(row.depth)) f16_at[row.depth] = &row;
  for (auto& row : r.rows) {
    const bench_row* b = f16_at.at(row.depth);
    row.decode_speedup_vs_f16 = b->decode_tokens_per_s > 0 ? row.decode_tokens_per_s / b->decode_tokens_per_s : 0;
    row.prefill_speedup_vs_f16 =
        b->prefill_tokens_per_s > 0 ? row.prefill_tokens_per_s / b->prefill_tokens_per_s : 0;
    row.kv_bytes_ratio_vs_f16 = row.kv_bytes_used > 0 ? (double)b->kv_bytes_used / (double)row.kv_bytes_used
                                : row.kv_bytes_per_token > 0 ? b->kv_bytes_per_token / row.kv_bytes_per_token
                                                             : 0;  // depth 0: per-token sizes
  }
  return r;
}

}  // namespace kvq
