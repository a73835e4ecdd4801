// Issue 15 item 5: a model's results must not depend on how a prompt is split into batches (-b,
// chunked prefill, the server's chunks). Every cache type, with and without exact windows, on
// stories260K: the logits of every position, prompt forwarded in one batch and in chunks of
// 1 / 3 / 7 / 16 tokens, are the same bits (the merge order of attention partitions is canonical,
// attend_plan.h; the channel statistics, the default K channel scale among them, are calibrated on
// a sequence's first channel_calib positions however they arrive, docs/formats.md). Before that
// calibration they came from the first append, whose size is the chunk: the default options failed.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/quant.h"
#include "kvq/thread_pool.h"
#include "support/data_dir.h"
#include "support/model_text.h"

namespace kvq {
namespace {

const char* kStories = "models/stories260K/stories260K.gguf";
const char* kTinyStories = "data/tinystories-val-794k/tinystories_val.txt";

// Logits [n, n_vocab] of tokens[0, n) forwarded in chunks of `chunk` (0: one batch).
std::vector<float> logits_in_chunks(model& m, const std::vector<int32_t>& tokens, const kv_cache_params& cp,
                                    int chunk, thread_pool& pool) {
  auto cache = make_kv_cache(cp);
  const int n = (int)tokens.size(), nv = m.hparams().n_vocab;
  std::vector<float> out((size_t)n * nv);
  if (chunk == 0) chunk = n;
  for (int t0 = 0; t0 < n; t0 += chunk) {
    const int c = std::min(chunk, n - t0);
    m.forward(std::span<const int32_t>(tokens.data() + t0, c), t0, 0, *cache, pool, out.data() + (size_t)t0 * nv,
              /*all_logits=*/true);
  }
  return out;
}

// One batch against chunks of 1 / 3 / 7 / 16 tokens: every logit the same bits.
void expect_split_invariant(model& m, const std::vector<int32_t>& tokens, const kv_cache_params& p,
                            thread_pool& pool) {
  const auto one = logits_in_chunks(m, tokens, p, 0, pool);
  for (int chunk : {1, 3, 7, 16}) {
    const auto got = logits_in_chunks(m, tokens, p, chunk, pool);
    ASSERT_EQ(got.size(), one.size());
    size_t first = got.size();
    for (size_t i = 0; i < got.size() && first == got.size(); ++i)
      if (std::memcmp(&got[i], &one[i], sizeof(float)) != 0) first = i;
    EXPECT_EQ(first, got.size()) << "chunks of " << chunk << ": first differing logit at position "
                                 << first / m.hparams().n_vocab << ", " << got[first % got.size()] << " vs "
                                 << one[first % got.size()];
  }
}

TEST(PrefillSplit, LogitsAreBitIdenticalForEveryCacheTypeAndSplit) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kTinyStories);
  test::model_text l = test::load_model_text(mp, tp);
  // 300 positions: past the default calibration positions (256), several KIVI groups and exact-window
  // turnovers
  const std::vector<int32_t> tokens(l.ids.begin(), l.ids.begin() + 300);
  thread_pool pool(2);
  struct opts {
    int sink, recent;
  };
  int n_checked = 0;
  for (const std::string& t : kv_type_names()) {
    for (const opts o : {opts{0, 0}, opts{4, 16}}) {
      kv_cache_params cp;
      cp.type_k = cp.type_v = parse_kv_cache_type(t);
      if (cp.type_k == kv_cache_type::certified) continue;  // (its own kernel: cert18's tests)
      cp.sink = o.sink;
      cp.exact_recent = o.recent;
      const kv_cache_params p = l.m->cache_params(512, cp);
      SCOPED_TRACE(t + " sink " + std::to_string(o.sink) + " recent " + std::to_string(o.recent));
      expect_split_invariant(*l.m, tokens, p, pool);
      ++n_checked;
    }
  }
  EXPECT_GE(n_checked, 20);
}

// The options as the tools give them (kv_auto_windows: sink 4, recent 32 for the per-token types;
// the K channel scale on for per-token K) and channel_scale on both sides (K and V statistics) with
// calibration positions that fall inside a chunk (100: 3 x 33 + 1, 7 x 14 + 2, 16 x 6 + 4).
TEST(PrefillSplit, LogitsAreBitIdenticalWithDefaultOptionsAndChannelScale) {
  KVQ_REQUIRE_DATA(mp, kStories);
  KVQ_REQUIRE_DATA(tp, kTinyStories);
  test::model_text l = test::load_model_text(mp, tp);
  const std::vector<int32_t> tokens(l.ids.begin(), l.ids.begin() + 300);
  thread_pool pool(2);
  int n_checked = 0;
  for (const std::string& t : kv_type_names()) {
    for (const bool both : {false, true}) {
      kv_cache_params cp;
      cp.type_k = cp.type_v = parse_kv_cache_type(t);
      if (cp.type_k == kv_cache_type::certified) continue;
      const kv_windows w = kv_auto_windows(cp);
      cp.sink = w.sink;
      cp.exact_recent = w.exact_recent;
      if (both) {
        kv_format f;
        if (!kv_cache_type_format(cp.type_k, &f) || kv_traits(f).layout == kv_layout::dense) continue;
        cp.channel_scale = true;
        cp.channel_calib = 100;
      }
      const kv_cache_params p = l.m->cache_params(512, cp);
      SCOPED_TRACE(t + (both ? " channel_scale, 100 positions" : " defaults") + ", sink " + std::to_string(cp.sink) +
                   " recent " + std::to_string(cp.exact_recent));
      expect_split_invariant(*l.m, tokens, p, pool);
      ++n_checked;
    }
  }
  EXPECT_GE(n_checked, 20);
}

}  // namespace
}  // namespace kvq
