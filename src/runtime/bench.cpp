// kvq bench: decode/prefill speed and KV bytes of KV formats against depth (see kvq/bench.h).
#include "kvq/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <new>

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
  cp.type_k = cp.type_v = kv_cache_type::f32;
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

// Re-tags an error of a lower layer ("[kv_cache] unknown K cache type ...") as bench's, keeping its
// code, so that every message of kvq bench starts with "[bench]".
[[noreturn]] void rethrow_as_bench(const error& e, const std::string& context) {
  std::string msg = e.what();
  if (msg.rfind("[bench]", 0) == 0) throw e;
  if (!msg.empty() && msg[0] == '[') {
    const size_t close = msg.find("] ");
    if (close != std::string::npos) msg = msg.substr(close + 2);
  }
  throw error(e.code(), "[bench] " + context + msg);
}

std::string format_name(const kv_cache_params& f) {
  const std::string k = kv_cache_type_name(f.type_k), v = kv_cache_type_name(f.type_v);
  return (k == v ? k : k + "/" + v) + (f.sink > 0 ? "+sink" + std::to_string(f.sink) : "") +
         (f.exact_recent > 0 ? "+recent" + std::to_string(f.exact_recent) : "");
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// f16 first (the baseline of every ratio), then the requested formats in order.
std::vector<kv_cache_params> with_baseline(const bench_params& p, std::vector<bool>* baseline_only) {
  std::vector<kv_cache_params> formats;
  bool has_f16 = false;
  for (const auto& f : p.formats) has_f16 = has_f16 || (f.type_k == kv_cache_type::f16 && f.type_v == kv_cache_type::f16);
  if (!has_f16 && !p.formats.empty()) {
    kv_cache_params f16 = p.formats.front();
    f16.type_k = f16.type_v = kv_cache_type::f16;
    f16.sink = f16.exact_recent = 0;  // a dense cache has no windows (the first format's auto ones)
    formats.push_back(f16);
    if (baseline_only) baseline_only->push_back(true);
  }
  for (const auto& f : p.formats) {
    formats.push_back(f);
    if (baseline_only) baseline_only->push_back(false);
  }
  return formats;
}

// Positions past the depth that the protocol appends: the larger of n_decode and n_prefill, plus one
// for the untimed decode step (round 0 after a depth, or the one after the warm-up's prefill at 0).
int64_t timed_positions(const bench_params& p) {
  return std::max<int64_t>(p.n_decode, p.n_prefill) + 1;
}

}  // namespace

int bench_check(const kv_cache_params& shape, const bench_params& p) {
  if (p.formats.empty()) fail_input("[bench] no KV formats to run");
  if (p.depths.empty()) fail_input("[bench] no depths to run (--depths)");
  if (p.n_decode < 1) fail_input("[bench] -n " + std::to_string(p.n_decode) + " decode steps must be >= 1");
  if (p.n_prefill < 0) fail_input("[bench] prefill tokens " + std::to_string(p.n_prefill) + " must be >= 0");
  if (p.prefill_repeats < 1)
    fail_input("[bench] prefill repeats " + std::to_string(p.prefill_repeats) + " must be >= 1");
  if (p.n_batch < 1) fail_input("[bench] batch " + std::to_string(p.n_batch) + " must be >= 1");
  if (p.n_ctx < 0) fail_input("[bench] cache n_ctx " + std::to_string(p.n_ctx) + " must be >= 0 (0: automatic)");
  if (p.n_ctx_train < 0) fail_input("[bench] training context " + std::to_string(p.n_ctx_train) + " must be >= 0");
  if (p.fill != "real" && p.fill != "synthetic")
    fail_input("[bench] --fill '" + p.fill + "' must be real or synthetic");
  for (int d : p.depths)
    if (d < 0) fail_input("[bench] --depths " + std::to_string(d) + ": a depth must be >= 0");
  const int64_t timed = timed_positions(p);
  const std::string timed_what = std::to_string(timed) + " timed positions (max of " +
                                 std::to_string(p.n_decode) + " decode steps and " + std::to_string(p.n_prefill) +
                                 " prefill tokens, + 1 untimed decode step)";
  const int64_t deepest = *std::max_element(p.depths.begin(), p.depths.end());
  int64_t n_ctx = p.n_ctx > 0 ? p.n_ctx : deepest + timed;
  if (p.n_ctx > 0 && deepest + timed > n_ctx)
    fail_input("[bench] --depths " + std::to_string(deepest) + ": depth + " + timed_what + " = " +
               std::to_string(deepest + timed) + " does not fit the cache n_ctx " + std::to_string(n_ctx) + " (-c); " +
               (n_ctx >= timed ? "the deepest depth it allows is " + std::to_string(n_ctx - timed)
                               : "no depth fits: -c must be >= " + std::to_string(timed) + " (or 0: automatic)"));
  if (n_ctx > std::numeric_limits<int>::max())
    fail_input("[bench] --depths " + std::to_string(deepest) + ": depth + " + timed_what +
               " exceeds the largest position a cache holds (" + std::to_string(std::numeric_limits<int>::max()) + ")");
  double per_token = 0;  // all formats together
  std::string names;
  for (kv_cache_params f : with_baseline(p, nullptr)) {
    f.n_layer = shape.n_layer;
    f.n_kv_head = shape.n_kv_head;
    f.head_dim = shape.head_dim;
    f.n_ctx = (int)n_ctx;
    f.n_seq = 1;
    try {
      per_token += kv_bytes_per_token(f);  // validates type, options and head_dim on a 1-position cache
    } catch (const error& e) {
      rethrow_as_bench(e, "KV format '" + format_name(f) + "': ");
    }
    names += (names.empty() ? "" : ", ") + format_name(f);
  }
  if (p.max_kv_bytes > 0 && per_token * (double)n_ctx > (double)p.max_kv_bytes) {
    const int64_t fits = (int64_t)std::floor((double)p.max_kv_bytes / per_token) - timed;
    fail_input("[bench] --depths " + std::to_string(deepest) + ": the caches of " + names + " at n_ctx " +
               std::to_string(n_ctx) + " (depth + " + std::to_string(timed) + " timed positions) need " +
               gib(per_token * (double)n_ctx) + ", more than the limit of " + gib((double)p.max_kv_bytes) +
               (fits >= 0 ? "; the deepest depth that fits is " + std::to_string(fits) : std::string("; no depth fits")));
  }
  return (int)n_ctx;
}

bench_result bench(model& m, std::span<const int32_t> tokens, const bench_params& p, const bench_progress& progress) {
  const model_hparams& hp = m.hparams();
  bench_result r;
  r.n_ctx = bench_check(m.cache_params(1), p);
  for (int32_t t : tokens)
    if (t < 0 || t >= hp.n_vocab)
      fail_input("[bench] token id " + std::to_string(t) + " is outside the vocabulary (" + std::to_string(hp.n_vocab) + ")");
  std::vector<int> depths = p.depths;
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  r.fill = p.fill;
  r.n_ctx_train = p.n_ctx_train > 0 ? p.n_ctx_train : hp.n_ctx_train;
  const int timed = (int)timed_positions(p);

  std::vector<bool> baseline_only;
  std::vector<kv_cache_params> formats = with_baseline(p, &baseline_only);
  const size_t F = formats.size();
  for (auto& f : formats) f = m.cache_params(r.n_ctx, f);
  r.model_desc = hp.arch + ", " + std::to_string(hp.n_layer) + " layers, n_embd " + std::to_string(hp.n_embd) +
                 ", " + std::to_string(hp.n_head) + "/" + std::to_string(hp.n_kv_head) + " heads, head_dim " +
                 std::to_string(hp.head_dim) + ", vocab " + std::to_string(hp.n_vocab) +
                 (hp.name.empty() ? std::string() : " (" + hp.name + ")");
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };

  try {
    thread_pool pool(p.n_threads);
    r.n_threads = pool.size();
    token_source src{tokens, hp.n_vocab, p.seed};
    kv_stats stats;
    if (p.fill == "synthetic") {
      say("measuring K/V statistics on a real prefill");
      stats = measure_kv_stats(m, src, pool, p.seed);
    }
    std::vector<float> logits(hp.n_vocab), kb, vb;  // [n_vocab]: last token only
    std::vector<int32_t> toks;
    std::vector<std::unique_ptr<kv_cache>> caches(F);
    std::vector<std::string> names(F), describe(F);
    for (size_t fi = 0; fi < F; ++fi) {
      say("allocating the " + format_name(formats[fi]) + " cache (n_ctx " + std::to_string(r.n_ctx) + ")");
      caches[fi] = make_kv_cache(formats[fi]);
      names[fi] = format_name(formats[fi]);
      describe[fi] = caches[fi]->describe();
    }
    auto decode_step = [&](kv_cache& c, int pos) {
      const int32_t id = src.at(pos);
      m.forward(std::span<const int32_t>(&id, 1), pos, 0, c, pool, logits.data(), false);
    };

    // 0. warm-up, untimed
    say("warm-up");
    src.fill(0, std::max(1, p.n_prefill), toks);
    m.forward(toks, 0, 0, *caches[0], pool, logits.data(), false);
    decode_step(*caches[0], (int)toks.size());
    caches[0]->clear(0);

    std::vector<std::vector<bench_row>> rows(F);  // [format][depth]
    int filled = 0;
    for (int d : depths) {
      const std::string at = " depth " + std::to_string(d);
      std::vector<bench_row> row(F);
      // 1. fill every cache to depth d
      for (size_t fi = 0; fi < F; ++fi) {
        kv_cache& c = *caches[fi];
        bench_row& w = row[fi];
        w.type_k = kv_cache_type_name(formats[fi].type_k);
        w.type_v = kv_cache_type_name(formats[fi].type_v);
        w.describe = describe[fi];
        w.sink = formats[fi].sink;
        w.exact_recent = formats[fi].exact_recent;
        w.baseline_only = baseline_only[fi];
        w.depth = d;
        w.beyond_train_ctx = r.n_ctx_train > 0 && (int64_t)d + timed > r.n_ctx_train;
        w.kv_bytes_per_token = kv_bytes_per_token(formats[fi]);
        const auto tf = clock_type::now();
        auto last_say = clock_type::time_point{};
        for (int pos = filled; pos < d; pos += p.n_batch) {
          if (seconds_since(last_say) >= 1.0) {  // progress at most once a second
            say(names[fi] + at + ": fill (" + p.fill + ") " + std::to_string(pos) + "/" + std::to_string(d));
            last_say = clock_type::now();
          }
          const int nb = std::min(p.n_batch, d - pos);
          if (p.fill == "real") {
            src.fill(pos, nb, toks);
            m.forward(toks, pos, 0, c, pool, logits.data(), false);
          } else {
            fill_synthetic(c, stats, pos, pos + nb, nb, kb, vb);
          }
        }
        w.fill_seconds = seconds_since(tf);
        w.kv_bytes_used = c.bytes_used();
        w.kv_bytes_allocated = c.bytes();
      }
      filled = d;

      // 2. per format an untimed decode step; then prefill rounds, formats in a rotating order
      for (size_t fi = 0; fi < F; ++fi) {
        decode_step(*caches[fi], d);
        caches[fi]->truncate(0, d);
      }
      if (p.n_prefill > 0) {
        say("depth " + std::to_string(d) + ": prefill " + std::to_string(p.n_prefill) + " x " +
            std::to_string(F) + " formats x " + std::to_string(p.prefill_repeats));
        src.fill(d, p.n_prefill, toks);
        std::vector<std::vector<double>> times(F);
        for (int rep = 0; rep < p.prefill_repeats; ++rep)
          for (size_t k = 0; k < F; ++k) {
            const size_t fi = (k + (size_t)rep) % F;
            const auto t0 = clock_type::now();
            m.forward(toks, d, 0, *caches[fi], pool, logits.data(), false);
            times[fi].push_back(seconds_since(t0));
            caches[fi]->truncate(0, d);
          }
        for (size_t fi = 0; fi < F; ++fi) {
          const double med = median(times[fi]);
          row[fi].prefill_tokens_per_s = med > 0 ? p.n_prefill / med : 0;
        }
      }

      // 3. decode rounds: every format one step per round, in a rotating order; round 0 untimed
      say("depth " + std::to_string(d) + ": decode " + std::to_string(p.n_decode) + " x " + std::to_string(F) +
          " formats");
      std::vector<std::vector<double>> steps(F);
      for (int i = 0; i <= p.n_decode; ++i)
        for (size_t k = 0; k < F; ++k) {
          const size_t fi = (k + (size_t)i) % F;
          const auto t0 = clock_type::now();
          decode_step(*caches[fi], d + i);
          if (i > 0) steps[fi].push_back(seconds_since(t0));
        }
      for (size_t fi = 0; fi < F; ++fi) {
        caches[fi]->truncate(0, d);
        bench_row& w = row[fi];
        double total = 0;
        for (double s : steps[fi]) total += s;
        const double med = median(steps[fi]);
        w.decode_ms_median = 1e3 * med;
        w.decode_ms_min = 1e3 * *std::min_element(steps[fi].begin(), steps[fi].end());
        w.decode_ms_max = 1e3 * *std::max_element(steps[fi].begin(), steps[fi].end());
        w.decode_tokens_per_s = med > 0 ? 1.0 / med : 0;
        w.decode_tokens_per_s_mean = total > 0 ? p.n_decode / total : 0;
        rows[fi].push_back(w);
      }
    }
    for (auto& fr : rows)
      for (auto& w : fr) r.rows.push_back(w);
    for (const auto& c : caches) append_certified_report(*c, r.certified);
  } catch (const error& e) {
    rethrow_as_bench(e, "");
  } catch (const std::bad_alloc&) {
    fail_input("[bench] out of memory allocating the caches at n_ctx " + std::to_string(r.n_ctx) +
               " (--depths too deep for this machine; bench_params::max_kv_bytes sets the up-front limit)");
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
    row.kv_bytes_ratio_vs_f16 = row.depth > 0 && row.kv_bytes_used > 0 ? (double)b->kv_bytes_used / (double)row.kv_bytes_used
                                : row.kv_bytes_per_token > 0 ? b->kv_bytes_per_token / row.kv_bytes_per_token
                                                             : 0;  // depth 0: per-token sizes
  }
  return r;
}

}  // namespace kvq
