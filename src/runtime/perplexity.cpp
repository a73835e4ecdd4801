// kvq perplexity: llama.cpp's chunked perplexity protocol and KL divergence (see perplexity.h).
#include "kvq/perplexity.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kvq/error.h"
#include "runtime/forward_engine.h"
#include "runtime/perplexity_kl.h"

namespace kvq {

using namespace ppl_detail;

// -b 0: llama.cpp's default n_batch (llama-perplexity evaluates a chunk in batches of at most 2048).
constexpr int kDefaultBatch = 2048;

std::string read_text_file(const std::string& path, const std::string& op) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail_input("[" + op + "] text file '" + path + "' is a directory, not a file");
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) {  // the OS reason, as the model loader gives it (gguf_file::open)
    const int e = errno;
    fail(errc::io, "[" + op + "] cannot open text file '" + path + "': " +
                       (e != 0 ? std::strerror(e) : "unknown reason"));
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  if (s.empty()) fail_input("[" + op + "] text file '" + path + "' is empty");
  return s;
}

std::vector<int32_t> perplexity_tokenize(const tokenizer& tok, const std::string& text, const std::string& op) {
  if (text.empty()) fail_input("[" + op + "] the text is empty");
  // llama.cpp: common_tokenize(ctx, text, add_special = true, parse_special = false).
  std::vector<int32_t> ids = tok.encode(text, tok.add_bos_default(), /*parse_special=*/false);
  if (tok.add_eos_default() && tok.eos() >= 0) ids.push_back(tok.eos());
  return ids;
}

int32_t perplexity_bos(const tokenizer& tok) { return tok.add_bos_default() ? tok.bos() : -1; }

namespace {

nlohmann::json file_header(const model& m, const perplexity_params& p, int n_chunk, int n_scored, int top_k,
                           uint64_t hash, int64_t n_tokens) {
  const model_hparams& hp = m.hparams();
  return {{"format", "kvq-kld"}, {"version", 1},     {"model", hp.name},        {"arch", hp.arch},
          {"n_vocab", hp.n_vocab}, {"n_embd", hp.n_embd}, {"n_layer", hp.n_layer}, {"n_ctx", p.n_ctx},
          {"n_chunk", n_chunk},  {"n_scored_per_chunk", n_scored}, {"top_k", top_k},
          {"tokens_fnv1a64", hex64(hash)}, {"n_tokens", n_tokens},
          {"type_k", kv_cache_type_name(p.cache.type_k)}, {"type_v", kv_cache_type_name(p.cache.type_v)}};
}

[[noreturn]] void base_mismatch(const std::string& f, const std::string& what, const std::string& file_v,
                                const std::string& run_v) {
  fail_input("[perplexity] KL base file '" + f + "' was made with " + what + " " + file_v + ", this run has " + run_v +
             " (make a new base with --kl-base)");
}

// Checks a base file's model and context against this run (no text needed); returns its codec.
kl_codec check_base_model(kl_file_reader& r, const model& m, const perplexity_params& p) {
  const nlohmann::json& h = r.header();
  const model_hparams& hp = m.hparams();
  const std::string& f = r.path();
  try {
    if (h.at("arch").get<std::string>() != hp.arch) base_mismatch(f, "architecture", h.at("arch"), hp.arch);
    // the name as the header stores it (kl_header_text)
    const std::string name = nlohmann::json::parse(kl_header_text(hp.name)).get<std::string>();
    if (h.at("model").get<std::string>() != name)
      base_mismatch(f, "model", "'" + h.at("model").get<std::string>() + "'", "'" + name + "'");
    if (h.at("n_vocab").get<int>() != hp.n_vocab)
      base_mismatch(f, "a vocabulary of", std::to_string(h.at("n_vocab").get<int>()), std::to_string(hp.n_vocab));
    if (h.at("n_embd").get<int>() != hp.n_embd || h.at("n_layer").get<int>() != hp.n_layer)
      base_mismatch(f, "model shape n_embd/n_layer",
                    std::to_string(h.at("n_embd").get<int>()) + "/" + std::to_string(h.at("n_layer").get<int>()),
                    std::to_string(hp.n_embd) + "/" + std::to_string(hp.n_layer));
    if (h.at("n_ctx").get<int>() != p.n_ctx)
      base_mismatch(f, "context size -c", std::to_string(h.at("n_ctx").get<int>()), std::to_string(p.n_ctx));
    kl_codec c;
    c.n_vocab = hp.n_vocab;
    c.top_k = h.at("top_k").get<int>();
    if (c.top_k < 0 || c.top_k > hp.n_vocab)
      fail_input("[perplexity] KL base file '" + f + "': top_k " + std::to_string(c.top_k) + " is out of range");
    return c;
  } catch (const nlohmann::json::exception& e) {
    fail_input("[perplexity] KL base file '" + f + "': header field missing or of the wrong type: " + e.what());
  }
}

// Checks a base file against this run's text; returns its codec.
kl_codec check_base_file(kl_file_reader& r, const model& m, const perplexity_params& p, int n_chunk, int n_scored,
                         uint64_t hash, int64_t n_tokens) {
  const kl_codec c = check_base_model(r, m, p);
  const nlohmann::json& h = r.header();
  const std::string& f = r.path();
  try {
    if (h.at("tokens_fnv1a64").get<std::string>() != hex64(hash) || h.at("n_tokens").get<int64_t>() != n_tokens)
      base_mismatch(f, "a different text or tokenizer: tokens",
                    std::to_string(h.at("n_tokens").get<int64_t>()) + " (hash " +
                        h.at("tokens_fnv1a64").get<std::string>() + ")",
                    std::to_string(n_tokens) + " (hash " + hex64(hash) + ")");
    if (h.at("n_scored_per_chunk").get<int>() != n_scored)
      base_mismatch(f, "scored tokens per chunk", std::to_string(h.at("n_scored_per_chunk").get<int>()),
                    std::to_string(n_scored));
    if (h.at("n_chunk").get<int>() < n_chunk)
      fail_input("[perplexity] KL base file '" + f + "' holds " + std::to_string(h.at("n_chunk").get<int>()) +
                 " chunks but this run evaluates " + std::to_string(n_chunk) + " (use --chunks " +
                 std::to_string(h.at("n_chunk").get<int>()) + " or fewer)");
    const uint64_t need = (uint64_t)h.at("n_chunk").get<int>() * (uint64_t)n_scored * c.record_bytes();
    if (r.remaining_bytes() != need)
      fail_input("[perplexity] KL base file '" + f + "' has " + std::to_string(r.remaining_bytes()) +
                 " bytes of records, expected " + std::to_string(need) + " (truncated or corrupt)");
    return c;
  } catch (const nlohmann::json::exception& e) {
    fail_input("[perplexity] KL base file '" + f + "': header field missing or of the wrong type: " + e.what());
  }
}

struct kld_accum {
  std::vector<float> kld;
  double sum_kld = 0, sum_kld2 = 0;
  int64_t same = 0, n = 0;
  double sum_dp = 0, sum_dp2 = 0, sum_dp4 = 0;
  double sum_nll_base = 0, sum_nll_base2 = 0;
  double sum_d = 0, sum_d2 = 0;  // nll_test - nll_base
};

ppl_stats make_ppl(double sum, double sum2, int64_t n) {
  ppl_stats s;
  s.n_scored = n;
  if (n == 0) return s;
  const double mean = sum / n;
  s.nll_mean = mean;
  s.ppl = std::exp(mean);
  const double var = sum2 / n - mean * mean;
  s.ppl_err = (var > 0 && n > 1) ? std::sqrt(var / (n - 1)) * s.ppl : 0;
  return s;
}

kld_stats finish_kld(kld_accum& a) {
  kld_stats s;
  const double n = (double)a.n;
  s.n = a.n;
  if (a.n == 0) return s;
  s.mean = a.sum_kld / n;
  const double var = a.sum_kld2 / n - s.mean * s.mean;
  s.mean_err = (var > 0 && a.n > 1) ? std::sqrt(var / (n - 1)) : 0;
  std::sort(a.kld.begin(), a.kld.end());
  s.min = a.kld.front();
  s.max = a.kld.back();
  s.median = quantile_sorted(a.kld, 0.5);
  s.p90 = quantile_sorted(a.kld, 0.9);
  s.p99 = quantile_sorted(a.kld, 0.99);
  s.p99_9 = quantile_sorted(a.kld, 0.999);
  const double pt = (double)a.same / n;
  s.same_top1_pct = 100 * pt;
  s.same_top1_err = a.n > 1 ? 100 * std::sqrt(pt * (1 - pt) / (n - 1)) : 0;
  const double ms = a.sum_dp2 / n;
  s.rms_dp_pct = 100 * std::sqrt(ms);
  // error of the RMS by the delta method on mean(dp^2)
  const double var_dp2 = a.sum_dp4 / n - ms * ms;
  const double ms_err = (var_dp2 > 0 && a.n > 1) ? std::sqrt(var_dp2 / (n - 1)) : 0;
  s.rms_dp_err = ms > 0 ? 100 * ms_err / (2 * std::sqrt(ms)) : 0;
  const ppl_stats b = make_ppl(a.sum_nll_base, a.sum_nll_base2, a.n);
  s.ppl_base = b.ppl;
  s.ppl_base_err = b.ppl_err;
  const double md = a.sum_d / n, vd = a.sum_d2 / n - md * md;
  const double md_err = (vd > 0 && a.n > 1) ? std::sqrt(vd / (n - 1)) : 0;
  s.dppl_pct = 100 * (std::exp(md) - 1);
  s.dppl_err = 100 * std::exp(md) * md_err;
  return s;
}

}  // namespace

void perplexity_check(const model& m, const perplexity_params& p) {
  const model_hparams& hp = m.hparams();
  const int V = hp.n_vocab;
  if (p.n_ctx < 4)
    fail_input("[perplexity] context size -c " + std::to_string(p.n_ctx) + " must be >= 4");
  if (p.n_ctx > hp.n_ctx_train)
    fail_input("[perplexity] context size -c " + std::to_string(p.n_ctx) + " exceeds the model's context " +
               std::to_string(hp.n_ctx_train) + " (" + hp.arch + ".context_length)");
  if (p.n_batch < 0) fail_input("[perplexity] batch size -b " + std::to_string(p.n_batch) + " must be >= 0");
  if (p.n_chunks == 0) fail_input("[perplexity] --chunks 0 must be >= 1 (or < 0 for all)");
  if (!p.kl_base_in.empty() && p.compare_type)
    fail_input("[perplexity] give either a KL base file (--kl-compare) or --compare TYPE, not both");
  if (!p.kl_base_in.empty() && !p.kl_base_out.empty()) {
    // Writing the base that is being read would overwrite it (and compare a run with itself).
    namespace fs = std::filesystem;
    std::error_code e1, e2, e3;
    const bool same = fs::equivalent(p.kl_base_in, p.kl_base_out, e1) ||
                      (fs::weakly_canonical(p.kl_base_in, e2) == fs::weakly_canonical(p.kl_base_out, e3) && !e2 && !e3);
    if (same)
      fail_input("[perplexity] --kl-base '" + p.kl_base_out + "' and --kl-compare '" + p.kl_base_in +
                 "' are the same file: writing the base would overwrite the file it is compared against");
  }
  if (p.kl_top_k < -1 || p.kl_top_k > V)
    fail_input("[perplexity] --kl-top-k " + std::to_string(p.kl_top_k) + " must be -1, 0 or in [1, n_vocab " +
               std::to_string(V) + "]");
  // Cache types and options.
  const kv_cache_params cp = m.cache_params(p.n_ctx, p.cache);
  if (p.device == compute_device::cuda && p.compare_type)
    fail_unsupported("[perplexity] --compare with --device cuda is not supported (one GPU runner per run): write a "
                     "KL base file with --kl-base and compare against it with --kl-compare");
  forward_engine_check(m, cp, p.device, std::min(p.n_batch == 0 ? kDefaultBatch : p.n_batch, p.n_ctx));
  if (p.compare_type) {
    kv_cache_params rp = cp;
    rp.type_k = rp.type_v = *p.compare_type;
    validate(rp);
  }
  if (!p.kl_base_in.empty()) {
    kl_file_reader r(p.kl_base_in);
    check_base_model(r, m, p);
  }
}

perplexity_result perplexity(model& m, std::span<const int32_t> tokens, int32_t bos, const perplexity_params& p,
                             const perplexity_progress& progress) {
  using clock = std::chrono::steady_clock;
  const model_hparams& hp = m.hparams();
  const int V = hp.n_vocab;
  perplexity_result r;

  // ---- validate everything before any evaluation ----
  perplexity_check(m, p);
  for (int32_t t : tokens)
    if (t < 0 || t >= V) fail_input("[perplexity] token id " + std::to_string(t) + " is outside the vocabulary");
  r.n_ctx = p.n_ctx;
  r.n_batch = std::min(p.n_batch == 0 ? kDefaultBatch : p.n_batch, p.n_ctx);
  r.n_tokens = (int64_t)tokens.size();
  const int64_t max_chunks = r.n_tokens / p.n_ctx;
  if (max_chunks < 1)
    fail_input("[perplexity] the text has " + std::to_string(r.n_tokens) + " tokens, fewer than one chunk of -c " +
               std::to_string(p.n_ctx) + " tokens (use a longer text or a smaller -c)");
  r.n_chunk = (int)(p.n_chunks < 0 ? max_chunks : std::min<int64_t>(p.n_chunks, max_chunks));
  const int first = p.n_ctx / 2;
  const int n_scored = p.n_ctx - 1 - first;
  r.n_scored_per_chunk = n_scored;

  kv_cache_params cp = m.cache_params(p.n_ctx, p.cache);
  cp.n_ubatch = std::max(cp.n_ubatch, r.n_batch);  // sliding-window layers' rings hold one batch
  forward_engine eng(m, cp, p.device, r.n_batch);  // --device cuda: the model and its cache on the GPU
  std::unique_ptr<forward_engine> ref_eng;       // --compare (CPU only, checked above)
  if (p.compare_type) {
    kv_cache_params rp = cp;
    rp.type_k = rp.type_v = *p.compare_type;
    ref_eng = std::make_unique<forward_engine>(m, rp, compute_device::cpu, r.n_batch);
  }
  const uint64_t hash = fnv1a64(tokens);
  std::unique_ptr<kl_file_reader> base_in;
  kl_codec in_codec;
  if (!p.kl_base_in.empty()) {
    base_in = std::make_unique<kl_file_reader>(p.kl_base_in);
    in_codec = check_base_file(*base_in, m, p, r.n_chunk, n_scored, hash, r.n_tokens);
  }
  kl_codec out_codec;
  out_codec.n_vocab = V;
  out_codec.top_k = p.kl_top_k == -1 ? (V <= 1024 ? 0 : 128) : p.kl_top_k;
  if (out_codec.top_k == V) out_codec.top_k = 0;
  std::unique_ptr<kl_file_writer> base_out;
  if (!p.kl_base_out.empty())
    base_out = std::make_unique<kl_file_writer>(
        p.kl_base_out, file_header(m, p, r.n_chunk, n_scored, out_codec.top_k, hash, r.n_tokens));
  kl_codec cmp_codec;  // in-process base: full records
  cmp_codec.n_vocab = V;
  cmp_codec.top_k = 0;
  const kl_codec* base_codec = base_in ? &in_codec : ref_eng ? &cmp_codec : nullptr;

  r.kv_describe = eng.describe();
  r.attn_tier = eng.attn_tier();
  r.kv_bytes_per_token = kv_bytes_per_token(cp);
  kv_cache_params f16 = cp;
  f16.type_k = f16.type_v = kv_cache_type::f16;
  r.kv_bytes_per_token_f16 = kv_bytes_per_token(f16);

  thread_pool pool(p.n_threads);
  // Each batch keeps the logits of its scored rows only, so memory is n_batch rows of n_vocab
  // whatever n_ctx (a 16384-token chunk of a 151,936-token vocabulary would need 10 GB).
  const int max_rows = std::min(r.n_batch, n_scored);
  std::vector<float> logits((size_t)std::max(max_rows, 1) * V);                // [rows, n_vocab]
  std::vector<float> ref_logits(ref_eng ? logits.size() : 0);                // [rows, n_vocab]
  std::vector<int> argmax(max_rows);
  std::vector<uint8_t> base_recs(base_codec ? (size_t)max_rows * base_codec->record_bytes() : 0);
  std::vector<uint8_t> out_recs(base_out ? (size_t)max_rows * out_codec.record_bytes() : 0);
  std::vector<kl_token> kl_tok(max_rows);
  std::vector<int> scratch;
  std::vector<int32_t> chunk(p.n_ctx);
  std::vector<uint8_t> out_mask;
  double sum_nll = 0, sum_nll2 = 0;
  int64_t count = 0;
  kld_accum acc;
  if (base_codec) acc.kld.reserve((size_t)r.n_chunk * n_scored);

  const auto t0 = clock::now();
  int64_t evaluated = 0;
  for (int c = 0; c < r.n_chunk; ++c) {
    const int64_t start = (int64_t)c * p.n_ctx;
    std::copy(tokens.begin() + start, tokens.begin() + start + p.n_ctx, chunk.begin());
    if (bos >= 0) chunk[0] = bos;
    eng.clear();
    if (ref_eng) ref_eng->clear();
    for (int i0 = 0; i0 < p.n_ctx; i0 += r.n_batch) {
      const int nb = std::min(r.n_batch, p.n_ctx - i0);
      // scored rows of this batch: positions first .. n_ctx - 2
      const int lo = std::max(i0, first), hi = std::min(i0 + nb, p.n_ctx - 1);  // [lo, hi)
      const int n_rows = std::max(0, hi - lo);
      out_mask.assign(nb, 0);
      for (int t = lo; t < hi; ++t) out_mask[t - i0] = 1;
      const std::span<const int32_t> toks(chunk.data() + i0, nb);
      // rows [lo, hi) of the batch into logits (a batch without scored rows writes its last row,
      // which is ignored)
      eng.forward(toks, i0, out_mask, logits.data(), pool);
      evaluated += nb;
      if (ref_eng) {
        ref_eng->forward(toks, i0, out_mask, ref_logits.data(), pool);
        evaluated += nb;
      }
      if (n_rows == 0) continue;
      // log-softmax of the scored rows, in place
      pool.parallel_for(n_rows, [&](int64_t i, int) {
        float* row = &logits[(size_t)i * V];
        argmax[i] = log_softmax(row, V, row);
      });
      if (ref_eng) {
        pool.parallel_for(n_rows, [&](int64_t i, int) {
          float* row = &ref_logits[(size_t)i * V];
          log_softmax(row, V, row);
        });
        for (int i = 0; i < n_rows; ++i)
          cmp_codec.encode(&ref_logits[(size_t)i * V], chunk[lo + i + 1],
                           &base_recs[(size_t)i * cmp_codec.record_bytes()], scratch);
      } else if (base_in) {
        base_in->read(base_recs.data(), (size_t)n_rows * base_codec->record_bytes());
      }
      if (base_codec) {
        pool.parallel_for(n_rows, [&](int64_t i, int) {
          kl_tok[i] = kl_from_record(*base_codec, &base_recs[(size_t)i * base_codec->record_bytes()],
                                     &logits[(size_t)i * V]);
        });
      }
      for (int i = 0; i < n_rows; ++i) {
        const int obs = chunk[lo + i + 1];
        const double lp = logits[(size_t)i * V + obs];
        sum_nll += -lp;
        sum_nll2 += lp * lp;
        ++count;
        if (base_codec) {
          const kl_token& k = kl_tok[i];
          acc.kld.push_back((float)k.kld);
          acc.sum_kld += k.kld;
          acc.sum_kld2 += k.kld * k.kld;
          acc.same += k.base_argmax == argmax[i];
          const double dp = std::exp(lp) - std::exp(k.base_logp_obs);
          acc.sum_dp += dp;
          acc.sum_dp2 += dp * dp;
          acc.sum_dp4 += dp * dp * dp * dp;
          acc.sum_nll_base += -k.base_logp_obs;
          acc.sum_nll_base2 += k.base_logp_obs * k.base_logp_obs;
          const double d = -lp + k.base_logp_obs;
          acc.sum_d += d;
          acc.sum_d2 += d * d;
          ++acc.n;
        }
      }
      if (base_out) {
        for (int i = 0; i < n_rows; ++i)
          out_codec.encode(&logits[(size_t)i * V], chunk[lo + i + 1], &out_recs[(size_t)i * out_codec.record_bytes()],
                           scratch);
        base_out->write(out_recs.data(), (size_t)n_rows * out_codec.record_bytes());
      }
    }
    r.chunk_ppl.push_back(std::exp(sum_nll / (double)count));
    if (progress)
      progress(c + 1, r.n_chunk, evaluated, std::chrono::duration<double>(clock::now() - t0).count());
  }
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.tokens_per_s = r.seconds > 0 ? evaluated / r.seconds : 0;
  r.ppl = make_ppl(sum_nll, sum_nll2, count);
  if (base_codec) {
    r.has_kld = true;
    r.kld = finish_kld(acc);
    r.kld.top_k = base_codec->top_k;
    if (ref_eng) r.kld.base_desc = ref_eng->describe() + " cache, same run";
    else
      r.kld.base_desc = "file " + p.kl_base_in + " (" + base_in->header().value("type_k", "?") + "/" +
                        base_in->header().value("type_v", "?") + ")";
  }
  if (base_out) {
    base_out->commit();
    r.kl_base_records = (int64_t)r.n_chunk * n_scored;
    r.kl_base_top_k = out_codec.top_k;
    r.kl_base_bytes = base_out->bytes();
  }
  if (kv_cache* c = eng.cpu_cache()) append_certified_report(*c, r.certified);
  if (ref_eng) append_certified_report(*ref_eng->cpu_cache(), r.certified);
  return r;
}

}  // namespace kvq
