// The attend planner (attend_plan.h).
#include "cache/attend_plan.h"

#include <algorithm>

#include "kvq/error.h"

namespace kvq {

void attend_planner::plan(const attend_plan_seq* seqs, int n_seqs, int n_kv_head, int n_head, int head_dim,
                          int n_threads, const attend_plan_options& opt) {
  KVQ_ASSERT(n_seqs >= 0 && n_kv_head >= 1 && n_head % n_kv_head == 0 && head_dim >= 1);
  KVQ_ASSERT(opt.chunk_align >= 1 && opt.min_chunk >= 1);
  n_kv_head_ = n_kv_head;
  n_head_ = n_head;
  head_dim_ = head_dim;
  seg_ = (opt.min_chunk + opt.chunk_align - 1) / opt.chunk_align * opt.chunk_align;
  seq_.assign((size_t)n_seqs, {});
  tok0_.assign((size_t)n_seqs + 1, 0);
  // About 4 items per thread: enough to balance causal tiles of unequal cost.
  const int64_t want = 4LL * std::max(1, n_threads);
  int64_t items = 0, states = 0, scratch = 0;
  for (int b = 0; b < n_seqs; ++b) {
    const attend_plan_seq& in = seqs[b];
    KVQ_ASSERT(in.n_tokens >= 1 && in.max_tile >= 1);
    seq_plan& pl = seq_[(size_t)b];
    pl.n_tokens = in.n_tokens;
    pl.tile = std::min(in.n_tokens, in.max_tile);
    pl.n_tiles = (in.n_tokens + pl.tile - 1) / pl.tile;
    pl.split_lo = in.split_lo;
    pl.split_hi = std::max(in.split_lo, in.split_hi);
    const int len = pl.split_hi - pl.split_lo;
    pl.n_chunks = 1;
    if (opt.split && len >= 2 * seg_) {
      // split when chunks of at least `target` rows (this sequence's (item, row) work over about
      // `want` items) would be more than one; then one chunk per segment (the merge order stays
      // that of the segments, attend_plan.h)
      const int64_t target = std::max<int64_t>(seg_, (int64_t)n_kv_head * pl.n_tiles * len / want);
      if ((len + target - 1) / target > 1) {
        pl.first_seg = pl.split_lo / seg_;
        pl.n_chunks = (pl.split_hi + seg_ - 1) / seg_ - pl.first_seg;
      }
    }
    pl.item0 = items;
    items += (int64_t)n_kv_head * pl.n_tiles * pl.n_chunks;
    pl.state0 = states;
    states += (int64_t)pl.n_chunks * in.n_tokens * n_head;
    pl.scratch0 = scratch;
    scratch += (int64_t)(pl.n_chunks - 1) * in.n_tokens * n_head;
    tok0_[(size_t)b + 1] = tok0_[(size_t)b] + in.n_tokens;
  }
  n_items_ = items;
  states_.resize((size_t)states);
  scratch_o_.resize((size_t)scratch * head_dim);
}

int attend_planner::seq_of_token(int tg) const {
  return (int)(std::upper_bound(tok0_.begin(), tok0_.end() - 1, tg) - tok0_.begin()) - 1;
}

attend_item attend_planner::item(int64_t it) const {
  // the sequence of item `it`: the last whose first item is <= it
  const int b = (int)(std::upper_bound(seq_.begin(), seq_.end(), it,
                                       [](int64_t v, const seq_plan& p) { return v < p.item0; }) -
                      seq_.begin()) - 1;
  const seq_plan& pl = seq_[(size_t)b];
  const int64_t i = it - pl.item0;
  attend_item w;
  w.seq = b;
  w.chunk = (int)(i % pl.n_chunks);
  const int tl = (int)(i / pl.n_chunks % pl.n_tiles);
  w.kv_head = (int)(i / pl.n_chunks / pl.n_tiles);
  w.ta = tl * pl.tile;
  w.tb = std::min(pl.n_tokens, w.ta + pl.tile);
  if (pl.n_chunks == 1) {
    w.row_lo = pl.split_lo;
    w.row_hi = pl.split_hi;
  } else {
    w.row_lo = std::max(pl.split_lo, (pl.first_seg + w.chunk) * seg_);
    w.row_hi = std::min(pl.split_hi, (pl.first_seg + w.chunk + 1) * seg_);
  }
  return w;
}

attn_state* attend_planner::begin(const attend_item& w, float* out) {
  const seq_plan& pl = seq_[(size_t)w.seq];
  const size_t nqs = (size_t)pl.n_tokens * n_head_;
  attn_state* sts = &states_[(size_t)pl.state0 + (size_t)w.chunk * nqs];
  const int ng = n_head_ / n_kv_head_;
  for (int t = w.ta; t < w.tb; ++t)
    for (int g = 0; g < ng; ++g) {
      const size_t i = (size_t)t * n_head_ + (size_t)w.kv_head * ng + g;
      float* o = w.chunk == 0 ? out + i * head_dim_
                              : &scratch_o_[((size_t)pl.scratch0 + (size_t)(w.chunk - 1) * nqs + i) * head_dim_];
      sts[i] = attn_state::empty(o, head_dim_);
    }
  return sts;
}

void attend_planner::finish_token(int tg, float* out_b) {
  const int b = seq_of_token(tg);
  const seq_plan& pl = seq_[(size_t)b];
  const int t = tg - tok0_[(size_t)b];
  const size_t nqs = (size_t)pl.n_tokens * n_head_;
  for (int hq = 0; hq < n_head_; ++hq) {
    const size_t i = (size_t)t * n_head_ + hq;
    attn_state& s0 = states_[(size_t)pl.state0 + i];
    for (int c = 1; c < pl.n_chunks; ++c) s0.merge(states_[(size_t)pl.state0 + (size_t)c * nqs + i]);
    s0.finalize(out_b + i * head_dim_);
  }
}

}  // namespace kvq
