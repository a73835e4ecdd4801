// kvq eval-passkey: passkey retrieval on real text (see passkey.h).
#include "kvq/passkey.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <memory>

#include "kvq/error.h"
#include "kvq/thread_pool.h"
#include "runtime/forward_engine.h"

namespace kvq {

namespace {

const char* kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n";
const char* kQuestion = "\n\nWhat is the pass key? The pass key is";

std::string needle_text(const std::string& key) {
  return " The pass key is " + key + ". Remember it. " + key + " is the pass key.";
}

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A generator state for trial `trial` of cell (length, depth): the seed and the cell mixed in.
uint64_t trial_state(uint64_t seed, int length, double depth, int trial) {
  uint64_t s = seed;
  uint64_t st = splitmix64(s);
  for (uint64_t v : {(uint64_t)length, (uint64_t)std::llround(depth * 1000), (uint64_t)trial}) {
    st ^= v + 0x9E3779B97F4A7C15ull + (st << 6) + (st >> 2);
    splitmix64(st);
  }
  return st;
}

// Uniform in [0, n) (n > 0); the modulo bias of a 64-bit draw is below 2^-40 for the n used here.
uint64_t uniform(uint64_t& s, uint64_t n) { return splitmix64(s) % n; }

bool ends_sentence(const std::string& piece) {
  if (piece.find('\n') != std::string::npos) return true;
  size_t e = piece.find_last_not_of(' ');
  if (e == std::string::npos) return false;
  const char c = piece[e];
  return c == '.' || c == '!' || c == '?';
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The answer is complete once a digit run is followed by another character.
bool answer_done(const std::string& s) {
  const size_t d = std::find_if(s.begin(), s.end(), is_digit) - s.begin();
  if (d == s.size()) return false;
  return std::find_if_not(s.begin() + (std::ptrdiff_t)d, s.end(), is_digit) != s.end();
}

std::string tag() { return "[eval_passkey] "; }

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

}  // namespace

passkey_text passkey_prepare(const tokenizer& tok, const std::string& haystack_text, const std::string& name) {
  if (haystack_text.empty()) fail_input(tag() + "haystack '" + name + "' is empty");
  passkey_text t;
  t.name = name;
  t.haystack = tok.encode(haystack_text, false, /*parse_special=*/false);
  t.sentence_end.resize(t.haystack.size());
  for (size_t i = 0; i < t.haystack.size(); ++i) t.sentence_end[i] = ends_sentence(tok.token_to_piece(t.haystack[i]));
  t.intro = tok.encode(kIntro, false, false);
  t.question = tok.encode(kQuestion, false, false);
  t.bos = tok.add_bos_default() ? tok.bos() : -1;
  return t;
}

bool passkey_correct(const std::string& key, const std::string& answer) {
  return !key.empty() && answer.find(key) != std::string::npos;
}

passkey_prompt passkey_make_prompt(const tokenizer& tok, const passkey_text& text, int length, double depth,
                                   int trial, const passkey_params& p) {
  if (!(depth >= 0 && depth <= 100))
    fail_input(tag() + "depth " + num(depth) + " % is outside [0, 100]");
  if (p.n_answer < 1) fail_input(tag() + "answer tokens " + std::to_string(p.n_answer) + " must be >= 1");
  if (p.snap_window < 0) fail_input(tag() + "snap window " + std::to_string(p.snap_window) + " must be >= 0");
  passkey_prompt r;
  uint64_t st = trial_state(p.seed, length, depth, trial);
  const int n_digits = 5 + (int)uniform(st, 3);
  r.key.push_back((char)('1' + uniform(st, 9)));
  for (int i = 1; i < n_digits; ++i) r.key.push_back((char)('0' + uniform(st, 10)));
  const std::vector<int32_t> needle = tok.encode(needle_text(r.key), false, false);
  r.needle_len = (int)needle.size();

  const int n_prompt = length - p.n_answer;
  const int n_fixed = (text.bos >= 0 ? 1 : 0) + (int)text.intro.size() + r.needle_len + (int)text.question.size();
  r.n_hay = n_prompt - n_fixed;
  if (r.n_hay < 1)
    fail_input(tag() + "length " + std::to_string(length) + " leaves no room for a haystack: the fixed text takes " +
               std::to_string(n_fixed) + " tokens and the answer " + std::to_string(p.n_answer));
  const int64_t n_text = (int64_t)text.haystack.size();
  if (n_text < r.n_hay)
    fail_input(tag() + "haystack '" + text.name + "' has " + std::to_string(n_text) + " tokens, fewer than the " +
               std::to_string(r.n_hay) + " a " + std::to_string(length) +
               "-token prompt needs (use a longer text or a shorter length)");

  // Excerpt: a random start, moved forward to the next sentence start while the excerpt still fits.
  const int64_t last = n_text - r.n_hay;  // largest start
  int64_t off = (int64_t)uniform(st, (uint64_t)last + 1);
  for (int64_t o = off; o <= last && o > 0; ++o)
    if (text.sentence_end[o - 1]) { off = o; break; }
  r.hay_offset = off;
  const int32_t* hay = text.haystack.data() + off;

  r.split_target = (int)std::llround(depth / 100.0 * r.n_hay);
  r.split = r.split_target;
  for (int s = r.split_target; s >= 0 && r.split_target - s <= p.snap_window; --s)
    if (s == 0 || text.sentence_end[off + s - 1]) { r.split = s; break; }

  r.ids.reserve(n_prompt);
  if (text.bos >= 0) r.ids.push_back(text.bos);
  r.ids.insert(r.ids.end(), text.intro.begin(), text.intro.end());
  r.hay_begin = (int)r.ids.size();
  r.ids.insert(r.ids.end(), hay, hay + r.split);
  r.needle_pos = (int)r.ids.size();
  r.ids.insert(r.ids.end(), needle.begin(), needle.end());
  r.ids.insert(r.ids.end(), hay + r.split, hay + r.n_hay);
  r.ids.insert(r.ids.end(), text.question.begin(), text.question.end());
  if ((int)r.ids.size() != n_prompt)
    fail(errc::internal, tag() + "prompt has " + std::to_string(r.ids.size()) + " tokens, expected " +
                             std::to_string(n_prompt));
  return r;
}

namespace {

// The cache of one length: one prompt batch in the sliding-window layers' rings.
kv_cache_params cache_params_for(const model& m, int length, const passkey_params& p) {
  kv_cache_params cp = m.cache_params(length, p.cache);
  cp.n_ubatch = std::max(cp.n_ubatch, p.n_batch);
  return cp;
}

}  // namespace

void passkey_check(const model& m, const passkey_params& p) {
  const model_hparams& hp = m.hparams();
  if (p.lengths.empty()) fail_input(tag() + "no context lengths given (--lengths)");
  if (p.depths.empty()) fail_input(tag() + "no depths given (--depths)");
  if (p.trials < 1) fail_input(tag() + "trials " + std::to_string(p.trials) + " must be >= 1");
  if (p.n_batch < 1) fail_input(tag() + "batch size -b " + std::to_string(p.n_batch) + " must be >= 1");
  if (p.n_answer < 1) fail_input(tag() + "answer tokens " + std::to_string(p.n_answer) + " must be >= 1");
  if (p.n_ctx < 0) fail_input(tag() + "context size -c " + std::to_string(p.n_ctx) + " must be >= 0");
  if (p.n_ctx > hp.n_ctx_train)
    fail_input(tag() + "context size -c " + std::to_string(p.n_ctx) + " exceeds the model's training context " +
               std::to_string(hp.n_ctx_train) + " (" + hp.arch + ".context_length)");
  for (double d : p.depths)
    if (!(d >= 0 && d <= 100)) fail_input(tag() + "depth " + num(d) + " % is outside [0, 100]");
  for (size_t i = 0; i < p.depths.size(); ++i)
    if (std::find(p.depths.begin(), p.depths.begin() + (std::ptrdiff_t)i, p.depths[i]) != p.depths.begin() + (std::ptrdiff_t)i)
      fail_input(tag() + "depth " + num(p.depths[i]) + " is given twice");
  for (size_t i = 0; i < p.lengths.size(); ++i) {
    const int L = p.lengths[i];
    if (std::find(p.lengths.begin(), p.lengths.begin() + (std::ptrdiff_t)i, L) != p.lengths.begin() + (std::ptrdiff_t)i)
      fail_input(tag() + "length " + std::to_string(L) + " is given twice");
    if (L > hp.n_ctx_train)
      fail_input(tag() + "length " + std::to_string(L) + " exceeds the model's training context " +
                 std::to_string(hp.n_ctx_train) + " (" + hp.arch + ".context_length)");
    if (p.n_ctx > 0 && L > p.n_ctx)
      fail_input(tag() + "length " + std::to_string(L) + " exceeds the context size -c " + std::to_string(p.n_ctx));
    if (L <= p.n_answer) fail_input(tag() + "length " + std::to_string(L) + " must exceed the answer tokens");
  }
  for (int L : p.lengths) forward_engine_check(m, cache_params_for(m, L, p), p.device, std::min(p.n_batch, L));
}

passkey_result eval_passkey(model& m, const tokenizer& tok, const passkey_text& text, const passkey_params& p,
                            const passkey_progress& progress) {
  using clock = std::chrono::steady_clock;
  passkey_check(m, p);
  passkey_result r;
  r.haystack = text.name;
  r.haystack_tokens = (int64_t)text.haystack.size();

  // Every prompt first: a haystack too short for the longest length fails before any evaluation.
  struct job {
    int length;
    double depth;
    int trial;
    passkey_prompt prompt;
  };
  std::vector<job> jobs;
  for (int L : p.lengths)
    for (double d : p.depths)
      for (int t = 0; t < p.trials; ++t) jobs.push_back({L, d, t, passkey_make_prompt(tok, text, L, d, t, p)});

  const int n_vocab = m.hparams().n_vocab;
  std::vector<float> logits(n_vocab);  // [n_vocab] of the last token
  thread_pool pool(p.n_threads);
  std::unique_ptr<forward_engine> eng;  // the cache (CPU) or the model and its cache (GPU) of one length
  int cache_len = -1;
  const auto t0 = clock::now();
  int64_t prefilled = 0;
  double prefill_s = 0;
  for (size_t ji = 0; ji < jobs.size(); ++ji) {
    const job& jb = jobs[ji];
    if (jb.length != cache_len) {
      eng.reset();
      const kv_cache_params cp = cache_params_for(m, jb.length, p);
      eng = std::make_unique<forward_engine>(m, cp, p.device, std::min(p.n_batch, jb.length));
      cache_len = jb.length;
      if (r.kv_describe.empty()) {
        r.kv_describe = eng->describe();
        r.kv_bytes_per_token = kv_bytes_per_token(cp);
        kv_cache_params f16 = cp;
        f16.type_k = f16.type_v = kv_cache_type::f16;
        r.kv_bytes_per_token_f16 = kv_bytes_per_token(f16);
      }
    } else {
      eng->clear();
    }
    const auto ts = clock::now();
    const std::vector<int32_t>& ids = jb.prompt.ids;
    const int n = (int)ids.size();
    for (int i = 0; i < n; i += p.n_batch) {
      const int nb = std::min(p.n_batch, n - i);
      eng->forward(std::span<const int32_t>(ids.data() + i, nb), i, {}, logits.data(), pool);
    }
    prefill_s += std::chrono::duration<double>(clock::now() - ts).count();
    prefilled += n;
    std::vector<int32_t> answer;
    std::string text_ans;
    for (int k = 0; k < p.n_answer; ++k) {
      const int32_t id = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
      if (tok.is_eog(id)) break;
      answer.push_back(id);
      text_ans = tok.decode(answer);
      if (answer_done(text_ans) || k + 1 == p.n_answer) break;
      eng->forward(std::span<const int32_t>(&id, 1), n + k, {}, logits.data(), pool);
    }
    passkey_trial tr;
    tr.length = jb.length;
    tr.depth = jb.depth;
    tr.trial = jb.trial;
    tr.key = jb.prompt.key;
    tr.answer = text_ans;
    tr.correct = passkey_correct(tr.key, tr.answer);
    tr.needle_pos = jb.prompt.needle_pos;
    tr.n_prompt = n;
    tr.seconds = std::chrono::duration<double>(clock::now() - ts).count();
    r.trials.push_back(tr);
    if (progress)
      progress((int)ji + 1, (int)jobs.size(), prefilled, std::chrono::duration<double>(clock::now() - t0).count());
  }
  r.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.prefill_tokens_per_s = prefill_s > 0 ? prefilled / prefill_s : 0;

  int total_correct = 0;
  for (int L : p.lengths)
    for (double d : p.depths) {
      passkey_cell c;
      c.length = L;
      c.depth = d;
      for (const passkey_trial& t : r.trials)
        if (t.length == L && t.depth == d) {
          ++c.n_trials;
          c.n_correct += t.correct;
        }
      c.accuracy = c.n_trials > 0 ? (double)c.n_correct / c.n_trials : 0;
      total_correct += c.n_correct;
      r.cells.push_back(c);
    }
  r.accuracy = r.trials.empty() ? 0 : (double)total_correct / (double)r.trials.size();
  return r;
}

}  // namespace kvq
