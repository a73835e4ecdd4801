// kvq eval-passkey's prompt generator (include/kvq/passkey.h): the needle at the requested depth
// in tokens, the pieces in order, determinism by seed, the scoring rule and bad input. The prompts
// are checked by rebuilding them from their parts (the haystack excerpt, the needle tokenized on
// its own), not against stored values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "kvq/error.h"
#include "kvq/passkey.h"
#include "kvq/perplexity.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

const char* kStories = "models/stories260K/stories260K.gguf";
const char* kText = "data/tinystories-val-794k/tinystories_val.txt";

struct fixture {
  std::unique_ptr<model> m;
  std::unique_ptr<tokenizer> tok;
  passkey_text text;
};

fixture load(const std::string& mp, const std::string& tp, size_t max_bytes = 200000) {
  fixture f;
  f.m = model::load(mp);
  f.tok = tokenizer::from_gguf(f.m->gguf());
  f.text = passkey_prepare(*f.tok, read_text_file(tp).substr(0, max_bytes), tp);
  return f;
}

std::vector<int32_t> slice(const std::vector<int32_t>& v, size_t a, size_t b) {
  return std::vector<int32_t>(v.begin() + (std::ptrdiff_t)a, v.begin() + (std::ptrdiff_t)b);
}

bool ends_sentence(const tokenizer& tok, int32_t id) {
  const std::string s = tok.token_to_piece(id);
  if (s.find('\n') != std::string::npos) return true;
  const size_t e = s.find_last_not_of(' ');
  return e != std::string::npos && (s[e] == '.' || s[e] == '!' || s[e] == '?');
}

// The prompt is BOS, intro, haystack[off, off+split), needle, haystack[off+split, off+n_hay),
// question; with snap_window 0 the split is exactly round(depth * n_hay / 100).
TEST(Passkey, NeedleAtRequestedDepthInTokens) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kText);
  fixture f = load(mp, tp);
  passkey_params p;
  p.snap_window = 0;
  for (int length : {300, 1000}) {
    for (double depth : {0.0, 10.0, 25.0, 33.3, 50.0, 75.0, 90.0, 100.0}) {
      SCOPED_TRACE("length " + std::to_string(length) + " depth " + std::to_string(depth));
      const passkey_prompt pr = passkey_make_prompt(*f.tok, f.text, length, depth, 0, p);
      ASSERT_EQ((int)pr.ids.size(), length - p.n_answer);
      const std::vector<int32_t> needle =
          f.tok->encode(" The pass key is " + pr.key + ". Remember it. " + pr.key + " is the pass key.", false, false);
      ASSERT_EQ(pr.needle_len, (int)needle.size());
      const int split = pr.needle_pos - pr.hay_begin;
      EXPECT_EQ(split, (int)std::lround(depth / 100.0 * pr.n_hay));
      EXPECT_NEAR(100.0 * split / pr.n_hay, depth, 100.0 / pr.n_hay);
      // pieces in order
      size_t at = 0;
      ASSERT_EQ(pr.ids[at++], f.tok->bos());
      EXPECT_EQ(slice(pr.ids, at, at + f.text.intro.size()), f.text.intro);
      at += f.text.intro.size();
      EXPECT_EQ((int)at, pr.hay_begin);
      const auto& h = f.text.haystack;
      EXPECT_EQ(slice(pr.ids, at, at + split), slice(h, pr.hay_offset, pr.hay_offset + split));
      EXPECT_EQ(slice(pr.ids, pr.needle_pos, pr.needle_pos + pr.needle_len), needle);
      at = pr.needle_pos + pr.needle_len;
      const size_t rest = pr.n_hay - split;
      EXPECT_EQ(slice(pr.ids, at, at + rest), slice(h, pr.hay_offset + split, pr.hay_offset + pr.n_hay));
      at += rest;
      EXPECT_EQ(slice(pr.ids, at, pr.ids.size()), f.text.question);
      const std::string q = f.tok->decode(f.text.question);  // SPM decodes with a leading space
      EXPECT_TRUE(q == "\n\nWhat is the pass key? The pass key is" || q == " \n\nWhat is the pass key? The pass key is") << q;
      // the excerpt starts a sentence (or the text)
      EXPECT_TRUE(pr.hay_offset == 0 || ends_sentence(*f.tok, h[pr.hay_offset - 1]));
    }
  }
}

// With the default snap window the needle moves back to the nearest sentence end, at most 64
// tokens before the exact depth, and to no earlier one than necessary.
TEST(Passkey, NeedleSnapsBackToSentenceEnd) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kText);
  fixture f = load(mp, tp);
  passkey_params p;  // snap_window 64
  int moved = 0;
  for (int trial = 0; trial < 6; ++trial)
    for (double depth : {0.0, 20.0, 40.0, 60.0, 80.0, 100.0}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + " depth " + std::to_string(depth));
      const passkey_prompt pr = passkey_make_prompt(*f.tok, f.text, 2000, depth, trial, p);
      const int target = (int)std::lround(depth / 100.0 * pr.n_hay);
      const int split = pr.needle_pos - pr.hay_begin;
      EXPECT_EQ(pr.split, split);
      EXPECT_EQ(pr.split_target, target);
      EXPECT_LE(split, target);
      EXPECT_GE(split, target - p.snap_window);
      const auto& h = f.text.haystack;
      const bool at_end = split == 0 || ends_sentence(*f.tok, h[pr.hay_offset + split - 1]);
      bool any_end = false;  // a sentence end in the window: then the split must be on the latest one
      for (int s = target; s >= std::max(0, target - p.snap_window) && !any_end; --s)
        any_end = s == 0 || ends_sentence(*f.tok, h[pr.hay_offset + s - 1]);
      EXPECT_EQ(at_end, any_end);
      for (int s = split + 1; s <= target; ++s) EXPECT_FALSE(ends_sentence(*f.tok, h[pr.hay_offset + s - 1])) << s;
      moved += split != target;
    }
  EXPECT_GT(moved, 0);  // tinystories' sentences are short: most depths move
}

TEST(Passkey, DeterministicBySeed) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kText);
  fixture f = load(mp, tp);
  passkey_params a, b;
  b.seed = 2;
  std::set<std::string> keys;
  std::set<size_t> digits;
  int differ_seed = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const passkey_prompt x = passkey_make_prompt(*f.tok, f.text, 500, 50, trial, a);
    const passkey_prompt y = passkey_make_prompt(*f.tok, f.text, 500, 50, trial, a);
    EXPECT_EQ(x.ids, y.ids);
    EXPECT_EQ(x.key, y.key);
    const passkey_prompt z = passkey_make_prompt(*f.tok, f.text, 500, 50, trial, b);
    differ_seed += z.key != x.key || z.hay_offset != x.hay_offset;
    ASSERT_GE(x.key.size(), 5u);
    ASSERT_LE(x.key.size(), 7u);
    EXPECT_NE(x.key[0], '0');
    EXPECT_TRUE(std::all_of(x.key.begin(), x.key.end(), [](char c) { return c >= '0' && c <= '9'; }));
    keys.insert(x.key);
    digits.insert(x.key.size());
    // the key appears twice in the prompt's text (the needle says it twice)
    const std::string s = f.tok->decode(x.ids);
    const size_t p1 = s.find(x.key), p2 = s.find(x.key, p1 + 1);
    EXPECT_NE(p1, std::string::npos);
    EXPECT_NE(p2, std::string::npos);
  }
  EXPECT_EQ(differ_seed, 40);
  EXPECT_GE(keys.size(), 38u);  // 40 draws from ~9.9 million keys
  EXPECT_EQ(digits.size(), 3u);  // 5, 6 and 7 digits all occur
  // a cell's prompts do not depend on the other cells
  passkey_params c = a;
  c.depths = {50};
  c.lengths = {500};
  EXPECT_EQ(passkey_make_prompt(*f.tok, f.text, 500, 50, 3, c).ids, passkey_make_prompt(*f.tok, f.text, 500, 50, 3, a).ids);
}

TEST(Passkey, ScoringRule) {
  EXPECT_TRUE(passkey_correct("58213", " 58213."));
  EXPECT_TRUE(passkey_correct("58213", "58213"));
  EXPECT_FALSE(passkey_correct("58213", " 5821."));
  EXPECT_FALSE(passkey_correct("58213", " 58 213"));
  EXPECT_FALSE(passkey_correct("", " 1"));
}

TEST(Passkey, BadInputIsAClearError) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kText);
  fixture f = load(mp, tp, 1500);  // several hundred tokens
  passkey_params p;
  auto msg = [&](auto&& fn) {
    try {
      fn();
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_input);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string short_hay = msg([&] { passkey_make_prompt(*f.tok, f.text, 2000, 50, 0, p); });
  EXPECT_NE(short_hay.find("haystack '" + tp + "' has " + std::to_string(f.text.haystack.size()) + " tokens"),
            std::string::npos)
      << short_hay;
  EXPECT_NE(msg([&] { passkey_make_prompt(*f.tok, f.text, 500, 101, 0, p); }).find("depth 101 % is outside [0, 100]"),
            std::string::npos);
  EXPECT_NE(msg([&] { passkey_make_prompt(*f.tok, f.text, 40, 50, 0, p); }).find("leaves no room for a haystack"),
            std::string::npos);
  const int train = f.m->hparams().n_ctx_train;
  p.lengths = {train + 1};
  EXPECT_NE(msg([&] { passkey_check(*f.m, p); }).find("length " + std::to_string(train + 1) +
                                                     " exceeds the model's training context " + std::to_string(train)),
            std::string::npos);
  p.lengths = {1024};
  p.n_ctx = 512;
  EXPECT_NE(msg([&] { passkey_check(*f.m, p); }).find("length 1024 exceeds the context size -c 512"),
            std::string::npos);
  p.n_ctx = 0;
  p.lengths = {512, 512};
  EXPECT_NE(msg([&] { passkey_check(*f.m, p); }).find("length 512 is given twice"), std::string::npos);
  p.lengths = {512};
  p.depths = {-1};
  EXPECT_NE(msg([&] { passkey_check(*f.m, p); }).find("depth -1 % is outside"), std::string::npos);
  p.depths = {50};
  p.trials = 0;
  EXPECT_NE(msg([&] { passkey_check(*f.m, p); }).find("trials 0 must be >= 1"), std::string::npos);
  // a short haystack fails before any evaluation
  p.trials = 1;
  p.lengths = {2000};
  EXPECT_NE(msg([&] { eval_passkey(*f.m, *f.tok, f.text, p); }).find("fewer than the"), std::string::npos);
}

// eval_passkey on stories260K: one cell per (length, depth) in order, the trial records agree with
// the cells, and the answer is what greedy decoding of the same prompt gives.
TEST(Passkey, EvalCellsAndTrialsAgree) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kText);
  fixture f = load(mp, tp);
  passkey_params p;
  p.lengths = {200, 300};
  p.depths = {0, 100};
  p.trials = 2;
  p.n_threads = 1;
  p.n_batch = 64;
  const passkey_result r = eval_passkey(*f.m, *f.tok, f.text, p);
  ASSERT_EQ(r.cells.size(), 4u);
  ASSERT_EQ(r.trials.size(), 8u);
  int ok = 0;
  for (size_t i = 0; i < r.cells.size(); ++i) {
    const passkey_cell& c = r.cells[i];
    EXPECT_EQ(c.length, p.lengths[i / 2]);
    EXPECT_EQ(c.depth, p.depths[i % 2]);
    EXPECT_EQ(c.n_trials, 2);
    int n = 0;
    for (const passkey_trial& t : r.trials)
      if (t.length == c.length && t.depth == c.depth) n += t.correct;
    EXPECT_EQ(c.n_correct, n);
    ok += n;
  }
  EXPECT_DOUBLE_EQ(r.accuracy, ok / 8.0);
  for (const passkey_trial& t : r.trials) {
    EXPECT_EQ(t.n_prompt, t.length - p.n_answer);
    EXPECT_EQ(t.correct, passkey_correct(t.key, t.answer));
    EXPECT_EQ(t.key, passkey_make_prompt(*f.tok, f.text, t.length, t.depth, t.trial, p).key);
  }
  // the first trial's answer by an independent greedy loop: the whole prompt in one batch
  const passkey_prompt pr = passkey_make_prompt(*f.tok, f.text, 200, 0, 0, p);
  auto cache = make_kv_cache(f.m->cache_params(200));
  thread_pool pool(1);
  std::vector<float> logits(f.m->hparams().n_vocab);
  f.m->forward(pr.ids, 0, 0, *cache, pool, logits.data(), false);
  const int32_t first = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const std::string piece = f.tok->token_to_piece(first);
  ASSERT_FALSE(r.trials[0].answer.empty());
  EXPECT_EQ(r.trials[0].answer.substr(0, piece.size()), piece);
}

}  // namespace
}  // namespace kvq
