// The attend planner (src/cache/attend_plan.h): items cover every (sequence, kv head, query, key
// row) exactly once, a sequence's chunks do not depend on its batch, and the chunk merge equals a
// float64 softmax over all keys.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "cache/attend_plan.h"
#include "kvq/thread_pool.h"

namespace kvq {
namespace {

std::vector<attend_plan_seq> random_seqs(std::mt19937& rng, int n) {
  std::vector<attend_plan_seq> s((size_t)n);
  for (auto& x : s) {
    x.n_tokens = std::uniform_int_distribution<int>(1, 40)(rng);
    x.split_lo = std::uniform_int_distribution<int>(0, 300)(rng);
    x.split_hi = x.split_lo + std::uniform_int_distribution<int>(0, 9000)(rng);
    x.max_tile = std::uniform_int_distribution<int>(1, 16)(rng);
  }
  return s;
}

// (seq, kv head) -> chunks as (row_lo, row_hi), from the items of a plan
std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> chunks_of(const attend_planner& pl) {
  std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> m;
  for (int64_t i = 0; i < pl.n_items(); ++i) {
    const attend_item w = pl.item(i);
    if (w.ta != 0) continue;
    auto& v = m[{w.seq, w.kv_head}];
    if ((int)v.size() <= w.chunk) v.resize((size_t)w.chunk + 1);
    v[(size_t)w.chunk] = {w.row_lo, w.row_hi};
  }
  return m;
}

TEST(attend_plan, items_cover_every_query_and_key_row_once) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int n_seqs = std::uniform_int_distribution<int>(1, 6)(rng), nh = 1 + trial % 3, threads = 1 + trial % 8;
    const auto seqs = random_seqs(rng, n_seqs);
    attend_planner pl;
    pl.plan(seqs.data(), n_seqs, nh, 4 * nh, 8, threads);
    // count (seq, kv head, token) x rows: every token of every head sees [split_lo, split_hi) once
    std::map<std::tuple<int, int, int>, std::vector<int>> cover;
    for (int64_t i = 0; i < pl.n_items(); ++i) {
      const attend_item w = pl.item(i);
      ASSERT_LT(w.ta, w.tb);
      ASSERT_LE(w.tb - w.ta, seqs[(size_t)w.seq].max_tile);
      for (int t = w.ta; t < w.tb; ++t) {
        auto& c = cover[{w.seq, w.kv_head, t}];
        const auto& s = seqs[(size_t)w.seq];
        c.resize((size_t)(s.split_hi - s.split_lo));
        for (int r = w.row_lo; r < w.row_hi; ++r) ++c[(size_t)(r - s.split_lo)];
      }
    }
    int n_tok = 0;
    for (int b = 0; b < n_seqs; ++b) {
      EXPECT_EQ(pl.tok0(b), n_tok);
      n_tok += seqs[(size_t)b].n_tokens;
      for (int h = 0; h < nh; ++h)
        for (int t = 0; t < seqs[(size_t)b].n_tokens; ++t) {
          auto it = cover.find({b, h, t});
          ASSERT_NE(it, cover.end()) << "seq " << b << " head " << h << " token " << t << " has no item";
          for (size_t r = 0; r < it->second.size(); ++r) ASSERT_EQ(it->second[r], 1) << "row " << r;
        }
    }
    EXPECT_EQ(pl.n_tokens(), n_tok);
    for (int tg = 0; tg < n_tok; ++tg) EXPECT_LE(pl.tok0(pl.seq_of_token(tg)), tg);
  }
}

// A sequence's chunks are the same alone and in any batch (so its output is bit-identical), short
// ranges stay whole, a long one alone on 2 threads is split into its segments (segment_rows()).
TEST(attend_plan, chunks_depend_on_the_sequence_alone) {
  std::mt19937 rng(11);
  attend_plan_options opt;
  for (int trial = 0; trial < 20; ++trial) {
    const auto seqs = random_seqs(rng, 5);
    attend_planner batch;
    batch.plan(seqs.data(), 5, 2, 8, 8, 2, opt);
    const auto in_batch = chunks_of(batch);
    for (int b = 0; b < 5; ++b) {
      attend_planner alone;
      alone.plan(&seqs[(size_t)b], 1, 2, 8, 8, 2, opt);
      const auto a = chunks_of(alone);
      for (int h = 0; h < 2; ++h) EXPECT_EQ(a.at({0, h}), in_batch.at({b, h})) << "seq " << b;
      const int len = seqs[(size_t)b].split_hi - seqs[(size_t)b].split_lo;
      const auto& c = a.at({0, 0});
      if (len < 2 * opt.min_chunk) {
        EXPECT_EQ(c.size(), 1u) << len;
      }
      // chunks are the segments: they end at fixed multiples of segment_rows() (not relative to
      // split_lo), so a query's merge order is the same split or not (attend_plan.h)
      for (size_t i = 0; i + 1 < c.size(); ++i) {
        EXPECT_EQ(c[i].second % alone.segment_rows(), 0);
        EXPECT_EQ(c[i].second, c[i + 1].first);
        if (i > 0) EXPECT_EQ(c[i].second - c[i].first, alone.segment_rows());
      }
    }
  }
  attend_plan_seq one;
  one.split_hi = 8192;
  attend_planner pl;
  pl.plan(&one, 1, 1, 4, 8, 2, opt);
  EXPECT_GE(pl.n_chunks(0), 4);  // 1 item alone would leave a thread idle
  opt.split = false;
  pl.plan(&one, 1, 1, 4, 8, 2, opt);
  EXPECT_EQ(pl.n_chunks(0), 1);
}

// begin / accumulate / finish_token over the planner's chunks (an f32 kernel adding one key at a
// time to attn_state) against a float64 softmax over all keys.
TEST(attend_plan, merged_chunks_equal_a_float64_softmax) {
  const int hd = 16, nh = 2, ng = 3, n_head = nh * ng, n_keys = 5000;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> s((size_t)n_keys * nh), v((size_t)n_keys * nh * hd);  // a score per (key, kv head)
  for (auto& x : s) x = 3.0f * nd(rng);
  for (auto& x : v) x = nd(rng);
  attend_plan_seq seq[2];
  seq[0].n_tokens = 3;
  seq[0].split_hi = n_keys;
  seq[1].n_tokens = 1;
  seq[1].split_lo = 100;
  seq[1].split_hi = 2600;
  attend_planner pl;
  pl.plan(seq, 2, nh, n_head, hd, 4);
  ASSERT_GT(pl.n_chunks(0), 1);
  std::vector<float> out[2] = {std::vector<float>((size_t)3 * n_head * hd), std::vector<float>((size_t)n_head * hd)};
  thread_pool pool(2);
  pl.run(pool, thread_pool::min_parallel_work, [&](const attend_item& w) {
    attn_state* sts = pl.begin(w, out[w.seq].data());
    pl.accumulate(w, sts, [&](attn_state* ls) {
      for (int t = w.ta; t < w.tb; ++t)
        for (int g = 0; g < ng; ++g) {
          attn_state& st = ls[(t - w.ta) * ng + g];
          for (int r = w.row_lo; r < w.row_hi; ++r) {
            const float sc = s[(size_t)r * nh + w.kv_head] + 0.1f * (float)(t + g);
            st.rescale_to(sc);
            const float p = std::exp(sc - st.m);
            st.d += p;
            for (int i = 0; i < hd; ++i) st.o[i] += p * v[((size_t)r * nh + w.kv_head) * hd + i];
          }
        }
    });
  });
  for (int tg = 0; tg < pl.n_tokens(); ++tg) pl.finish_token(tg, out[pl.seq_of_token(tg)].data());
  double worst = 0;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < seq[b].n_tokens; ++t)
      for (int hq = 0; hq < n_head; ++hq) {
        const int h = hq / ng, g = hq % ng;
        double mx = -1e300, den = 0;
        for (int r = seq[b].split_lo; r < seq[b].split_hi; ++r) mx = std::max(mx, (double)s[(size_t)r * nh + h] + 0.1 * (t + g));
        std::vector<double> o(hd, 0.0);
        for (int r = seq[b].split_lo; r < seq[b].split_hi; ++r) {
          const double p = std::exp((double)s[(size_t)r * nh + h] + 0.1 * (t + g) - mx);
          den += p;
          for (int i = 0; i < hd; ++i) o[i] += p * v[((size_t)r * nh + h) * hd + i];
        }
        for (int i = 0; i < hd; ++i)
          worst = std::max(worst, std::abs(out[b][((size_t)t * n_head + hq) * hd + i] - o[i] / den));
      }
  std::printf("[attend_plan] %d chunks, max |f32 merged - f64| %.3g\n", pl.n_chunks(0), worst);
  EXPECT_LT(worst, 1e-5);
}

}  // namespace
}  // namespace kvq
