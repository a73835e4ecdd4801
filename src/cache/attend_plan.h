// Private: the one attend planner of the CPU caches (dense, compressed, certified).
//
// A batched attend (kv_cache::attend_batch; attend() is a batch of one) is cut into work items
// (sequence, kv head, query tile, key chunk). The chunks split a long key range (split-K, as
// flash-decoding does: Dao et al. 2023, "Flash-Decoding for long-context inference"; the
// load-balanced scheduler of FlashInfer, Ye et al. 2025) when a sequence's tiles alone cannot keep the threads
// busy. Each chunk accumulates its own attn_state per (query token, query head); chunk 0 writes
// into the caller's output rows, chunks 1.. into scratch, and finish() merges them in chunk order
// and normalises. How a cache walks its storage inside one item (ring pieces, the compressed body,
// exact windows) stays with the cache: the planner owns tiling, chunking, scheduling and merging.
//
// Canonical merge order (issue 15 item 5): the key rows are cut into segments of segment_rows()
// at fixed multiples of it (row numbers, not batch-relative), and a query's attention is the
// left-to-right merge of one state per segment, whatever the batch: a split sequence has one
// chunk per segment (merged in order by finish_token), an unsplit one walks the segments of its
// one chunk with one accumulate() each (for_each_segment). Inside a segment a cache continues one
// state over views that start at fixed rows, so the kernels' key blocks (32 / 64 rows from a
// view's start) fall on the same rows too. So a query's output does not depend on the batch, its
// tile, the thread count or whether the sequence was split: one-shot prefill and any chunking give
// the same bits (tests/cache/test_kv_cache_reliability.cpp, prefill_is_bit_exact_across_splits).
//
// Chunks depend on the sequence itself (its tokens, its key rows, kv heads) and the thread count
// only, never on the other sequences of the batch, so a sequence's output is the same bit for bit
// whichever batch it is attended in.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"
#include "kvq/thread_pool.h"

namespace kvq {

// One sequence as the planner sees it.
struct attend_plan_seq {
  int n_tokens = 1;  // queries, >= 1
  // Key rows [split_lo, split_hi) the chunks partition (the cache's row numbering: positions for a
  // dense cache, body rows for the compressed one). Empty: one chunk.
  int split_lo = 0, split_hi = 0;
  int max_tile = 16;  // queries per work item, >= 1
};

struct attend_plan_options {
  bool split = true;      // false: one chunk per sequence (kernels that need every key at once)
  int chunk_align = 32;   // segment_rows() is a multiple of this (rows)
  int min_chunk = 1024;   // segment_rows(): min_chunk rounded up to chunk_align; ranges under two stay whole
};

// Work item: queries [ta, tb) of sequence `seq` (index in the batch) for kv head `kv_head`, key
// rows [row_lo, row_hi) of chunk `chunk`: one segment (segment_rows() rows at a multiple of it, cut
// to the split range) when the sequence is split, else the whole split range.
struct attend_item {
  int seq = 0, kv_head = 0, ta = 0, tb = 0, chunk = 0;
  int row_lo = 0, row_hi = 0;
};

class attend_planner {
 public:
  // Plans seqs[0, n_seqs) for n_kv_head kv heads, n_head query heads (a multiple of n_kv_head) of
  // head_dim, on n_threads threads. Invalidates the states of the previous plan.
  void plan(const attend_plan_seq* seqs, int n_seqs, int n_kv_head, int n_head, int head_dim, int n_threads,
            const attend_plan_options& opt = {});

  int64_t n_items() const { return n_items_; }
  int n_seqs() const { return (int)seq_.size(); }
  int n_chunks(int b) const { return seq_[(size_t)b].n_chunks; }
  // Rows of a segment (the unit of the canonical merge order, see the top of this file).
  int segment_rows() const { return seg_; }
  // fn(lo, hi) for the segments of rows [lo, hi) (cut at the multiples of segment_rows()), in order.
  template <class Fn>
  void for_each_segment(int lo, int hi, Fn&& fn) const {
    for (int a = lo; a < hi;) {
      const int b = std::min(hi, (a / seg_ + 1) * seg_);
      fn(a, b);
      a = b;
    }
  }
  // The batch's tokens are numbered across sequences: sequence b holds [tok0(b), tok0(b + 1)).
  int tok0(int b) const { return tok0_[(size_t)b]; }
  int n_tokens() const { return tok0_.back(); }
  // Sequence of batch token tg.
  int seq_of_token(int tg) const;
  attend_item item(int64_t it) const;

  // Runs fn(const attend_item&) over every item, dynamically scheduled (causal prefill items differ
  // in cost); on the calling thread alone when `work` (multiply-adds) is under
  // thread_pool::min_parallel_work.
  template <class Fn>
  void run(thread_pool& pool, int64_t work, Fn&& fn) const {
    if (n_items_ <= 0) return;
    if (work < thread_pool::min_parallel_work) {
      for (int64_t i = 0; i < n_items_; ++i) fn(item(i));
      return;
    }
    std::atomic<int64_t> next{0};
    pool.run_on_all([&](int, int) {
      for (int64_t i = next.fetch_add(1); i < n_items_; i = next.fetch_add(1)) fn(item(i));
    });
  }

  // Resets the states of item w's queries in its chunk; chunk 0 accumulates into out (sequence
  // w.seq's output, [n_tokens, n_head, head_dim]), later chunks into scratch. Returns the chunk's
  // states, indexed [t * n_head + query head] over the sequence's tokens.
  attn_state* begin(const attend_item& w, float* out);
  // Runs fn(attn_state* local) on zeroed per-thread states of item w's tile, laid out
  // [t - w.ta][g] (g < n_head / n_kv_head, as attn_query_view's n_group), then merges them into
  // sts (begin()'s states). One call per key segment keeps each segment's partial sums separate.
  template <class Fn>
  void accumulate(const attend_item& w, attn_state* sts, Fn&& fn) const {
    thread_local std::vector<attn_state> local;
    thread_local std::vector<float> local_o;
    const int ng = n_head_ / n_kv_head_, nloc = (w.tb - w.ta) * ng;
    local.resize((size_t)nloc);
    local_o.resize((size_t)nloc * head_dim_);
    for (int i = 0; i < nloc; ++i) local[(size_t)i] = attn_state::empty(&local_o[(size_t)i * head_dim_], head_dim_);
    fn(local.data());
    for (int t = w.ta; t < w.tb; ++t)
      for (int g = 0; g < ng; ++g)
        sts[(size_t)t * n_head_ + (size_t)w.kv_head * ng + g].merge(local[(size_t)(t - w.ta) * ng + g]);
  }
  // Merges the chunks of batch token tg (sequence b = seq_of_token(tg)) in chunk order and writes
  // the normalised outputs of its n_head queries to out_b + t * n_head * head_dim (out_b: the
  // sequence's output, t = tg - tok0(b)).
  void finish_token(int tg, float* out_b);

 private:
  struct seq_plan {
    int n_tokens = 0, tile = 1, n_tiles = 1, n_chunks = 1, first_seg = 0, split_lo = 0, split_hi = 0;
    int64_t item0 = 0, state0 = 0, scratch0 = 0;
  };
  std::vector<seq_plan> seq_;
  std::vector<int> tok0_{0};
  std::vector<attn_state> states_;  // per sequence [n_chunks][n_tokens * n_head]
  std::vector<float> scratch_o_;    // chunks 1..: [n_chunks - 1][n_tokens * n_head][head_dim]
  int64_t n_items_ = 0;
  int n_kv_head_ = 1, n_head_ = 1, head_dim_ = 0, seg_ = 1024;
};

}  // namespace kvq
