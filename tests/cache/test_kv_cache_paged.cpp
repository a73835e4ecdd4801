// The paged caches (kv_cache_params::page_size > 0): attention over pages equals the contiguous
// cache bit for bit (page sizes 16 / 64 / 256, odd lengths, several sequences interleaved and
// batched, a sequence cleared and its pages reused, a split-K sequence, a sliding-window layer
// beside paged ones), pages are taken on demand and returned, a saved and loaded prefix continues
// as the saved sequence for every format (and copy on write keeps the saver's pages), pins hold
// pages, and bad parameters are named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvq/error.h"
#include "kvq/kv_cache.h"

namespace kvq {
namespace {

constexpr int kHd = 64, kNh = 2, kHeads = 4;  // GQA: 2 query heads per kv head
constexpr float kScale = 0.125f;

// K/V of one sequence's positions [0, n): [n, kNh, kHd], K with per-channel offsets as real keys.
struct stream {
  std::vector<float> k, v;
  stream(uint32_t seed, int n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> off(kHd);
    for (auto& o : off) o = 2.0f * nd(rng);
    k.resize((size_t)n * kNh * kHd);
    v.resize(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = off[i % kHd] + nd(rng);
      v[i] = nd(rng);
    }
  }
  const float* kp(int pos) const { return k.data() + (size_t)pos * kNh * kHd; }
  const float* vp(int pos) const { return v.data() + (size_t)pos * kNh * kHd; }
};

std::vector<float> queries(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.5f);
  std::vector<float> q((size_t)n * kHeads * kHd);
  for (auto& x : q) x = nd(rng);
  return q;
}

kv_cache_params params(const char* tk, const char* tv, int n_ctx, int n_seq, int page) {
  kv_cache_params p;
  p.n_layer = 2;
  p.n_kv_head = kNh;
  p.head_dim = kHd;
  p.n_ctx = n_ctx;
  p.n_seq = n_seq;
  p.type_k = parse_kv_cache_type(tk);
  p.type_v = parse_kv_cache_type(tv, "V");
  p.page_size = page;
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One step of the model's order: every layer appends each sequence's chunk, then attends the
// chunk's queries of all of them in one attend_batch. Returns the outputs, [layer][seq in step].
struct chunk {
  int seq, n;
};
std::vector<std::vector<float>> step(kv_cache& c, const std::vector<chunk>& b, const std::vector<stream>& data,
                                     const std::vector<int>& stream_of, uint32_t qseed, thread_pool& pool) {
  std::vector<std::vector<float>> outs;
  for (int il = 0; il < c.params().n_layer; ++il) {
    std::vector<std::vector<float>> q(b.size()), o(b.size());
    std::vector<attend_seq> seqs;
    for (size_t i = 0; i < b.size(); ++i) {
      const stream& s = data[(size_t)stream_of[(size_t)b[i].seq]];
      const int pos = c.n_pos(b[i].seq);  // (advances when the last layer has appended)
      c.append(il, b[i].seq, b[i].n, s.kp(pos), s.vp(pos));
      q[i] = queries(b[i].n, qseed + 97 * il + 13 * (uint32_t)i);
      o[i].assign(q[i].size(), NAN);
      seqs.push_back({b[i].seq, pos, b[i].n, q[i].data(), o[i].data()});
    }
    c.attend_batch(il, seqs.data(), (int)seqs.size(), kHeads, kScale, pool);
    for (auto& x : o) outs.push_back(std::move(x));
  }
  return outs;
}

// Interleaved sequences of odd lengths: seq 0 a prompt then decode, seq 1 one token at a time,
// cleared after step 3 and restarted on other data (pages go back and are taken again), seq 2 a
// long prompt in chunks (> 2048 keys: its decode attends are split into key chunks).
std::vector<std::vector<float>> script(kv_cache& c, thread_pool& pool) {
  std::vector<stream> data;
  for (uint32_t s = 0; s < 4; ++s) data.emplace_back(100 + s, 2200);
  std::vector<int> stream_of = {0, 1, 2};
  const std::vector<std::vector<chunk>> steps = {
      {{0, 97}, {1, 1}, {2, 523}},  {{0, 1}, {1, 17}, {2, 523}}, {{0, 1}, {1, 1}, {2, 523}},
      {{1, 1}, {2, 523}},           {{0, 300}, {1, 33}},          {{0, 1}, {1, 1}, {2, 1}},
      {{2, 1}, {1, 64}, {0, 17}},   {{0, 1}, {1, 1}, {2, 1}},
  };
  std::vector<std::vector<float>> all;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (i == 4) {
      c.clear(1);
      stream_of[1] = 3;
    }
    for (auto& o : step(c, steps[i], data, stream_of, 1000 + (uint32_t)i, pool)) all.push_back(std::move(o));
  }
  return all;
}

struct config {
  const char* k;
  const char* v;
  int sink = 0, exact_recent = 0;
  bool windowed = false;  // layer 1 a sliding-window layer (a ring beside the paged layer 0)
};

TEST(kv_cache_paged, attention_equals_the_contiguous_cache_bit_for_bit) {
  thread_pool pool(2);
  const config configs[] = {
      {"f16", "f16"},          {"bf16", "f32", 0, 0, true}, {"q8", "q8"}, {"q4", "q4", 0, 16},
      {"kivi4", "q4a", 4, 0},  {"q4", "f16", 4, 0, true},   {"q2a", "q4"},
  };
  for (int page : {16, 64, 256}) {
    for (const config& cf : configs) {
      SCOPED_TRACE(std::string(cf.k) + "/" + cf.v + " page " + std::to_string(page));
      auto p = params(cf.k, cf.v, 2200, 3, 0);
      p.sink = cf.sink;
      p.exact_recent = cf.exact_recent;
      if (std::string(cf.k).rfind("kivi", 0) == 0) p.kivi_group = std::min(32, page);
      if (cf.windowed) p.layers = {{0, 0, 0}, {48, 0, 0}};
      p.n_ubatch = 523;  // the longest chunk (a sliding-window ring holds one)
      auto contiguous = make_kv_cache(p);
      p.page_size = page;
      auto paged = make_kv_cache(p);
      EXPECT_EQ(paged->describe(), contiguous->describe());
      const auto a = script(*contiguous, pool), b = script(*paged, pool);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        bool finite = true;
        for (float x : b[i]) finite = finite && std::isfinite(x);
        EXPECT_TRUE(finite) << "output " << i;
        EXPECT_TRUE(same_bits(a[i], b[i])) << "output " << i << " differs from the contiguous cache";
      }
      // every page of the cleared sequence went back: the pool holds the live sequences' pages only
      const kv_page_info pi = paged->page_info();
      int held = 0;
      for (int s = 0; s < 3; ++s) held += (int)paged->seq_pages(s).size() + paged->seq_stage_pages(s);
      EXPECT_EQ(pi.n_pages - pi.n_free, held);
      EXPECT_EQ(pi.n_seq_held, held);
      EXPECT_EQ(pi.page_bytes, kv_page_bytes(p));
      for (int s = 0; s < 3; ++s) paged->clear(s);
      EXPECT_EQ(paged->page_info().n_free, pi.n_pages);
    }
  }
}

TEST(kv_cache_paged, pages_are_taken_on_demand_and_returned) {
  auto p = params("f16", "f16", 512, 2, 16);
  p.n_pages = 10;
  auto c = make_kv_cache(p);
  const size_t page_bytes = (size_t)2 * kNh * 16 * kHd * 2 * 2;  // layers x kv heads x rows x head_dim x (K, V) x f16
  EXPECT_EQ(kv_page_bytes(p), page_bytes);
  EXPECT_EQ(c->bytes(), 10 * page_bytes);
  EXPECT_EQ(kv_bytes_at_ctx(p), c->bytes());
  kv_page_info pi = c->page_info();
  EXPECT_EQ(pi.page_size, 16);
  EXPECT_EQ(pi.n_pages, 10);
  EXPECT_EQ(pi.n_free, 10);
  EXPECT_EQ(pi.max_pages_per_seq, 32);
  EXPECT_EQ(c->pages_for(100), 7);
  EXPECT_EQ(c->pages_for(5000), 32);
  const stream s(7, 200);
  for (int il = 0; il < 2; ++il) c->append(il, 0, 100, s.kp(0), s.vp(0));
  EXPECT_EQ(c->page_info().n_free, 3);
  EXPECT_EQ(c->seq_pages(0).size(), 7u);
  EXPECT_EQ(c->bytes_used(), 7 * page_bytes);
  // 50 more positions need 4 pages: refused before anything is written
  try {
    c->append(0, 1, 50, s.kp(0), s.vp(0));
    ADD_FAILURE() << "no error for an exhausted pool";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("[kv_cache] append: seq 1 needs 4 more pages of 16 rows, the pool has 3 free of 10"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(c->n_pos(1), 0);
  EXPECT_EQ(c->page_info().n_free, 3);
  c->truncate(0, 33);  // 3 pages kept
  EXPECT_EQ(c->page_info().n_free, 7);
  for (int il = 0; il < 2; ++il) c->append(il, 1, 50, s.kp(0), s.vp(0));
  EXPECT_EQ(c->page_info().n_free, 3);
  c->clear(0);
  c->clear(1);
  EXPECT_EQ(c->page_info().n_free, 10);
  EXPECT_EQ(c->bytes_used(), 0u);
  // the compressed cache: the sink and tail take no page
  auto pq = params("q4", "q4", 512, 1, 16);
  pq.sink = 4;
  pq.exact_recent = 8;
  pq.channel_calib = 16;  // (the K channel scale's positions are kept exact until they have arrived)
  auto q = make_kv_cache(pq);
  for (int il = 0; il < 2; ++il) q->append(il, 0, 40, s.kp(0), s.vp(0));
  EXPECT_EQ(q->seq_pages(0).size(), 2u);  // 28 body rows
  EXPECT_EQ(kv_bytes_at_ctx(pq), q->bytes());
}

// save_prefix / load_prefix (the server's prefix reuse) for every format: a sequence loaded from
// the state another one saved after two chunks of 24 gives, chunk for chunk, the bits that one gave
// after saving, while holding state outside the pages (the K channel scale, KIVI's groups and
// residual, exact sink / recent rows, a sliding-window layer's ring) and ending inside a page
// (copied: the saver writes on in its own page, the loader in the copy).
TEST(kv_cache_paged, a_loaded_prefix_continues_as_the_saved_sequence) {
  thread_pool pool(2);
  struct save_config {
    const char* k;
    const char* v;
    int sink, exact_recent;
    bool windowed;
    int page;
  };
  for (const save_config& cf : {save_config{"f16", "f16", 0, 0, false, 16}, save_config{"q8", "q8", 0, 0, false, 16},
                                save_config{"q4", "q4", 0, 0, false, 32}, save_config{"kivi4", "q4a", 4, 0, false, 32},
                                save_config{"kivi2", "kivi2", 0, 0, false, 64}, save_config{"q4", "q4", 4, 8, false, 16},
                                save_config{"f16", "f16", 0, 0, true, 16}, save_config{"q4", "q4", 0, 0, true, 32}}) {
    SCOPED_TRACE(std::string(cf.k) + "/" + cf.v + " sink " + std::to_string(cf.sink) + " recent " +
                 std::to_string(cf.exact_recent) + (cf.windowed ? " windowed" : "") + " page " + std::to_string(cf.page));
    auto p = params(cf.k, cf.v, 300, 3, cf.page);
    p.sink = cf.sink;
    p.exact_recent = cf.exact_recent;
    p.channel_calib = 8;  // (q8 / q4 K channel scale: calibrated, with body pages, before the truncate to page - 3)
    if (cf.windowed) p.layers = {{0, 0, 0}, {40, 0, 0}};
    auto c = make_kv_cache(p);
    ASSERT_TRUE(c->can_save_prefix());
    const std::vector<stream> data = {stream(9, 300)};
    const std::vector<int> stream_of = {0, 0, 0};
    step(*c, {{0, 24}}, data, stream_of, 1, pool);
    step(*c, {{0, 24}}, data, stream_of, 2, pool);
    auto px = c->save_prefix(0);
    EXPECT_EQ(px->n_pos(), 48);
    EXPECT_EQ((size_t)px->n_pages(), c->seq_pages(0).size());
    EXPECT_LE(px->n_full_pages(), px->n_pages());
    if (cf.sink > 0 || cf.windowed) {
      EXPECT_GT(px->bytes(), 0u);
    }
    std::vector<std::vector<float>> cold, warm;
    for (int n : {24, 24, 1, 1, 7}) {
      for (auto& o : step(*c, {{0, n}}, data, stream_of, 10 + n, pool)) cold.push_back(o);
    }
    const int free_before = c->page_info().n_free;
    c->load_prefix(1, *px);
    EXPECT_EQ(c->n_pos(1), 48);
    EXPECT_EQ(c->page_info().n_free, free_before - (px->n_pages() - px->n_full_pages()));  // the copy
    for (int n : {24, 24, 1, 1, 7}) {
      for (auto& o : step(*c, {{1, n}}, data, stream_of, 10 + n, pool)) warm.push_back(o);
    }
    ASSERT_EQ(cold.size(), warm.size());
    for (size_t i = 0; i < cold.size(); ++i) EXPECT_TRUE(same_bits(cold[i], warm[i])) << "output " << i;
    // both continue alike (neither wrote on the other's rows)
    const auto q = queries(1, 77);
    auto attend_last = [&](int seq) {
      std::vector<float> o(q.size(), NAN);
      c->attend(0, seq, c->n_pos(seq) - 1, 1, kHeads, q.data(), kScale, o.data(), pool);
      return o;
    };
    EXPECT_TRUE(same_bits(attend_last(0), attend_last(1)));
    // copy on write: seq 1, truncated inside the first page it shares with seq 0 and appended on,
    // writes on a copy of that page; seq 0's outputs keep their bits
    if (px->n_full_pages() > 0 && !cf.windowed) {
      const int page0 = c->seq_pages(0)[0];
      ASSERT_EQ(c->seq_pages(1)[0], page0);
      const auto before0 = attend_last(0);
      c->truncate(1, cf.page - 3);
      const std::vector<int> kept = c->seq_pages(1);  // none where exact rows take the first positions
      if (cf.sink == 0 && std::string(cf.k).rfind("kivi", 0) != 0) {
        ASSERT_FALSE(kept.empty());
      }
      if (!kept.empty()) {
        EXPECT_NE(kept[0], page0);
      }
      step(*c, {{1, 20}}, data, stream_of, 60, pool);
      EXPECT_TRUE(same_bits(attend_last(0), before0));
    }
    // errors name the op; nothing changes
    EXPECT_THROW(c->load_prefix(1, *px), error);  // not empty
    EXPECT_THROW(c->save_prefix(2), error);       // empty
    auto other = make_kv_cache(p);
    EXPECT_THROW(other->load_prefix(0, *px), error);  // another cache's prefix
    // the prefix pins its pages until it goes; a page pinned by hand outlives both
    const int pinned = c->seq_pages(0)[0];  // one of the prefix's pages
    c->pin_page(pinned);
    for (int s = 0; s < 3; ++s) c->clear(s);
    EXPECT_EQ(c->page_info().n_free, c->page_info().n_pages - px->n_pages());
    px.reset();
    EXPECT_EQ(c->page_info().n_free, c->page_info().n_pages - 1);
    EXPECT_EQ(c->page_info().n_seq_held, 0);
    c->unpin_page(pinned);
    EXPECT_EQ(c->page_info().n_free, c->page_info().n_pages);
    EXPECT_THROW(c->unpin_page(pinned), error);  // not pinned
    EXPECT_THROW(c->pin_page(pinned), error);    // free: nothing to keep
  }
  auto c = make_kv_cache(params("f16", "f16", 256, 2, 0));  // contiguous: unsupported
  EXPECT_FALSE(c->can_save_prefix());
  EXPECT_EQ(c->page_info().n_pages, 0);
  EXPECT_THROW(c->pin_page(0), error);
  try {
    c->save_prefix(0);
    ADD_FAILURE() << "no error";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::unsupported);
    EXPECT_NE(std::string(e.what()).find("[kv_cache] save_prefix"), std::string::npos) << e.what();
  }
}

TEST(kv_cache_paged, invalid_params_are_named) {
  auto expect = [](kv_cache_params p, errc code, const std::string& want) {
    try {
      make_kv_cache(p);
      ADD_FAILURE() << "no error for " << want;
    } catch (const error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  auto p = params("f16", "f16", 256, 2, -1);
  expect(p, errc::invalid_input, "[kv_cache] page_size and n_pages must be >= 0 (0 = contiguous / a full pool), got page_size -1");
  p = params("kivi4", "kivi4", 256, 2, 16);
  expect(p, errc::invalid_input, "[kv_cache] page_size 16 must be a multiple of kivi_group 32");
  p = params("certified", "certified", 256, 2, 16);
  expect(p, errc::unsupported, "[kv_cache] certified cache: paged storage (page_size 16) is not supported");
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// The K channel scale's staging rows (q4's first channel_calib positions, kept as given: f16 and a residual,
// kHd * kNh * 4 bytes a position per layer and side, twice f16's) are in pages of the pool, taken
// as the positions arrive and returned once the sequence is calibrated: the cache allocates the
// pool and the per-sequence exact rows and statistics, nothing per sequence for staging (issue 16:
// 6.3 MB a slot on Qwen2.5-0.5B beside the budget). A truncate back below the calibrated positions,
// whose exact rows are gone, is refused by name.
TEST(kv_cache_paged, staging_rows_take_pool_pages_and_return_them) {
  auto p = params("q4", "q4", 600, 2, 64);
  p.channel_calib = 256;
  auto c = make_kv_cache(p);
  const size_t stage_pos = (size_t)kNh * kHd * 4;  // one side, one layer: f16 and int16 residual
  // a page's bytes of a layer and side (kNh heads x 64 rows of 32 B) hold one run of 32 positions of
  // one kv head's f16 rows or residuals: a block of 32 positions takes kNh x 2 pages (8 positions a
  // page, as f32 rows took)
  const size_t region = (size_t)kNh * 64 * kv_code_bytes(kv_format::q4, kHd);
  const int rows = (int)(region / (kHd * 2)), block = kNh * 2;
  ASSERT_EQ(rows, 32);
  auto pages = [&](int n) { return (n + rows - 1) / rows * block; };
  EXPECT_EQ(c->stage_pages_for(100), pages(100));   // 16 (4 blocks)
  EXPECT_EQ(c->stage_pages_for(5000), pages(256));  // 32: every calibration position
  // what the cache allocates: the pool and the 2 sequences' statistics (μ, λ of K) and staging
  // references (position 0 of K and V), no staging array
  const kv_page_info pi0 = c->page_info();
  // a layer and sequence's references: (K, V) x kv heads x head_dim x f32; the statistics: layers x
  // seqs x (μ, λ) x kv heads x head_dim x f32, and every layer and sequence's references
  const size_t ref = (size_t)2 * kNh * kHd * 4;
  const size_t stats = (size_t)2 * 2 * 2 * kNh * kHd * 4 + 2 * 2 * ref;
  EXPECT_EQ(c->bytes(), (size_t)pi0.n_pages * pi0.page_bytes + stats);
  EXPECT_LT(c->bytes(), (size_t)pi0.n_pages * pi0.page_bytes + 2 * 2 * 2 * 256 * stage_pos);
  // the default pool: every sequence at n_ctx and its staging pages on the way there
  EXPECT_EQ(pi0.n_pages, 2 * (c->pages_for(600) + 32));
  const stream s(11, 600);
  for (int il = 0; il < 2; ++il) c->append(il, 0, 100, s.kp(0), s.vp(0));
  EXPECT_EQ(c->seq_stage_pages(0), pages(100));
  EXPECT_EQ(c->seq_pages(0).size(), 0u);  // nothing compressed yet
  EXPECT_EQ(c->page_info().n_seq_held, pages(100));
  EXPECT_EQ(c->bytes_used(), pages(100) * pi0.page_bytes + 2 * ref);
  c->truncate(0, 50);  // still staging: back to 2 blocks
  EXPECT_EQ(c->seq_stage_pages(0), pages(50));
  for (int il = 0; il < 2; ++il) c->append(il, 0, 250, s.kp(50), s.vp(50));  // 300: calibrated
  EXPECT_EQ(c->seq_stage_pages(0), 0);
  EXPECT_EQ(c->seq_pages(0).size(), (size_t)c->pages_for(300));
  EXPECT_EQ(c->page_info().n_seq_held, c->pages_for(300));
  try {
    c->truncate(0, 100);
    ADD_FAILURE() << "no error for a truncate below the calibrated positions";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("[kv_cache] truncate: seq 0 would keep 100 of the 256 positions its channel "
                                         "statistics were calibrated on"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(c->n_pos(0), 300);
  c->truncate(0, 256);  // at the calibrated positions: allowed
  EXPECT_EQ(c->n_pos(0), 256);
  c->truncate(0, 0);
  EXPECT_EQ(c->page_info().n_free, pi0.n_pages);
  // an exhausted pool refuses the staging rows before anything is written
  auto q = p;
  q.n_pages = 10;
  auto small = make_kv_cache(q);
  try {
    small->append(0, 1, 100, s.kp(0), s.vp(0));
    ADD_FAILURE() << "no error for an exhausted pool";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("[kv_cache] append: seq 1 needs 16 more pages for its channel-calibration "
                                         "rows, the pool has 10 free of 10"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(small->n_pos(1), 0);
  EXPECT_EQ(small->page_info().n_free, 10);
}

}  // namespace
}  // namespace kvq
