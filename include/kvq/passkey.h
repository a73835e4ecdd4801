// Passkey retrieval (a needle in a haystack) on real text, per KV-cache configuration.
//
// The task of Mohtashami & Jaggi, "Landmark Attention: Random-Access Infinite Context Length for
// Transformers" (2023), section 4.2, with the depth sweep of Kamradt's "needle in a haystack"
// (2023) and of the KIVI and long-context KV-quantization papers: a random 5-7 digit key is hidden
// at a chosen depth of a long prompt and the model is asked for it at the end. The filler is real
// text (wikitext-2, the held-out novels) instead of the paper's repeated "The grass is green..."
// lines, so the haystack's attention pattern is that of natural text.
//
// A prompt of `length` tokens (the context the cache must hold, answer included) is, in tokens:
//
//   [BOS] intro  haystack[0, s)  needle  haystack[s, n_hay)  question   | n_answer generated
//
//   intro    = "There is an important info hidden inside a lot of irrelevant text. Find it and
//               memorize it. I will quiz you about the important information there.\n\n"
//   needle   = " The pass key is KEY. Remember it. KEY is the pass key."
//   question = "\n\nWhat is the pass key? The pass key is"
//
// n_prompt = length - n_answer, n_hay = n_prompt - the other tokens. The haystack excerpt is
// n_hay consecutive tokens of the tokenized text starting at a random sentence start; the needle
// goes after excerpt token s, where s is depth % of n_hay (rounded), moved back to the nearest
// sentence end (a token whose text ends in '.', '!', '?', or holds a newline) at most
// `snap_window` tokens earlier, so that the needle starts a sentence as in Kamradt's test. The
// pieces are tokenized separately and concatenated (the needle's and question's tokens never
// merge with the haystack's).
//
// The answer is the greedy continuation (argmax) of at most n_answer tokens, stopped early at an
// end-of-generation token or at the first non-digit after a digit. A trial is correct when the
// key's digits appear in the answer's text (as LongBench's passkey scoring does).
//
// Determinism: the key (5-7 digits, first digit nonzero) and the excerpt's start of trial t of the
// cell (length, depth) come from a splitmix64 stream seeded by (seed, length, depth, t), so a cell's
// prompts do not depend on which other cells run, and every cache configuration sees the same
// prompts for the same seed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/tokenizer.h"

namespace kvq {

// The haystack and the fixed pieces, tokenized once (passkey_prepare).
struct passkey_text {
  std::string name;                   // the haystack's name in messages (its file path)
  std::vector<int32_t> haystack;      // [n_tokens] the text's tokens, no BOS
  std::vector<uint8_t> sentence_end;  // [n_tokens] 1 where the token ends a sentence (see above)
  std::vector<int32_t> intro, question;
  int32_t bos = -1;                   // prepended when >= 0 (the vocabulary adds BOS)
};

// One generated prompt.
struct passkey_prompt {
  std::vector<int32_t> ids;  // [length - n_answer] tokens
  std::string key;           // the key's digits
  int needle_pos = 0;        // index in ids of the needle's first token
  int needle_len = 0;        // tokens of the needle
  int hay_begin = 0;         // index in ids of the first haystack token
  int n_hay = 0;             // haystack tokens in the prompt (both sides of the needle)
  int split = 0;             // haystack tokens before the needle (s above)
  int split_target = 0;      // round(depth / 100 * n_hay), before moving back to a sentence end
  int64_t hay_offset = 0;    // index in passkey_text::haystack of the excerpt's first token
};

struct passkey_params {
  std::vector<int> lengths = {4096};              // context lengths in tokens (prompt + answer)
  std::vector<double> depths = {0, 25, 50, 75, 100};  // needle depths, % of the haystack
  int trials = 2;                                 // prompts per (length, depth)
  uint64_t seed = 1;
  int n_answer = 12;        // greedy tokens at most (digits are one token each with Qwen2 / Gemma 3)
  int snap_window = 64;     // tokens the needle may move back to a sentence end; 0: exact depth
  int n_ctx = 0;            // the context limit -c; 0: the model's training context
  int n_batch = 512;        // prompt tokens per prefill pass
  int n_threads = 0;        // 0: all hardware threads
  kv_cache_params cache;    // types and options (shapes and n_ctx are filled per length)
  // cpu: the CPU engine; cuda: every layer on the GPU (cuda::model_runner, kvq/cuda_model.h), one
  // runner per length: f16 / q8 / q4 caches without exact windows (check_supported's errors for
  // the rest), unsupported "[cuda] ..." without CUDA or a GPU.
  compute_device device = compute_device::cpu;
};

struct passkey_trial {
  int length = 0;
  double depth = 0;
  int trial = 0;
  std::string key, answer;  // answer: the generated text
  bool correct = false;
  int needle_pos = 0;       // token index of the needle in the prompt
  int n_prompt = 0;
  double seconds = 0;       // prefill + answer
};

struct passkey_cell {
  int length = 0;
  double depth = 0;
  int n_trials = 0, n_correct = 0;
  double accuracy = 0;  // n_correct / n_trials, in [0, 1]
};

struct passkey_result {
  std::string haystack;
  int64_t haystack_tokens = 0;
  std::vector<passkey_cell> cells;    // lengths outer, depths inner, in the order given
  std::vector<passkey_trial> trials;  // every trial, in run order
  double accuracy = 0;                // over all trials
  std::string kv_describe;
  double kv_bytes_per_token = 0, kv_bytes_per_token_f16 = 0;
  double seconds = 0, prefill_tokens_per_s = 0;
};

// Called after each trial: trials done, total, prompt tokens prefilled so far, seconds.
using passkey_progress = std::function<void(int done, int total, int64_t tokens, double seconds)>;

// Tokenizes the haystack text and the fixed pieces. Errors (invalid_input): empty text.
passkey_text passkey_prepare(const tokenizer& tok, const std::string& haystack_text, const std::string& name);

// Builds trial `trial` of the cell (length, depth) as described above. Errors (invalid_input,
// "[eval_passkey] ..."): depth outside [0, 100], n_answer < 1, a length too short for the fixed
// pieces, a haystack with fewer tokens than n_hay (naming passkey_text::name).
passkey_prompt passkey_make_prompt(const tokenizer& tok, const passkey_text& text, int length, double depth,
                                   int trial, const passkey_params& p);

// The scoring rule: true when `key` occurs in `answer`.
bool passkey_correct(const std::string& key, const std::string& answer);

// Validates `p` against the model before any work: no lengths or depths, a length above the
// training context or above p.n_ctx (when set), trials < 1, n_batch < 1, n_answer < 1, a depth
// outside [0, 100], a cache configuration make_kv_cache refuses (invalid_input); with
// device == cuda, what the GPU path does not run and a missing GPU (unsupported, as
// cuda::check_supported and cuda::require).
void passkey_check(const model& m, const passkey_params& p);

// Runs every trial of every (length, depth) cell with one cache per length (cleared between
// trials), prefilling in batches of n_batch. Errors: those of passkey_check and passkey_make_prompt
// (all prompts are built before any evaluation, so a short haystack fails at once).
passkey_result eval_passkey(model& m, const tokenizer& tok, const passkey_text& text, const passkey_params& p,
                            const passkey_progress& progress = {});

}  // namespace kvq
