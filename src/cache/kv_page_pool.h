// Private: the page pool of the paged CPU caches (kv_cache_params::page_size > 0; docs/architecture.md,
// "Paged KV cache"). Bookkeeping only: page ids, reference counts and one page table per sequence
// (vLLM's block table, Kwon et al. 2023, "PagedAttention", SOSP '23, §4.2-4.3). The caches own the
// page storage (per layer [n_pages, n_kv_head, page_size, row]) and map a sequence's row r to page
// table(seq)[r / page_size], slot r % page_size.
//
// References: each sequence whose table lists a page holds one, each pin (a prefix cache) one more;
// a page with no reference is free. A page with more than one reference is shared and never
// written: sequences share only full pages, and a truncate that leaves a shared page partly kept
// copies it first (copy on write). One exception: a saved prefix (kv_prefix_paged) pins its
// sequence's partly filled last page, which that sequence goes on filling past the saved rows (the
// saved rows never change); a sequence that loads the prefix gets a copy of that page.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvq/error.h"
#include "kvq/kv_cache.h"

namespace kvq {

class kv_page_pool {
 public:
  // page_size 0: not paged (every other call but on() is then invalid).
  void init(int page_size, int n_pages, int n_seq, int max_pages_per_seq) {
    P_ = page_size;
    max_per_seq_ = max_pages_per_seq;
    refs_.assign((size_t)n_pages, 0);
    pins_.assign((size_t)n_pages, 0);
    free_.clear();
    for (int i = n_pages - 1; i >= 0; --i) free_.push_back(i);  // lowest id taken first
    table_.assign((size_t)n_seq, {});
    stage_.assign((size_t)n_seq, {});
  }
  bool on() const { return P_ > 0; }
  int page_size() const { return P_; }
  int n_pages() const { return (int)refs_.size(); }
  int n_free() const { return (int)free_.size(); }
  int max_pages_per_seq() const { return max_per_seq_; }
  const std::vector<int>& table(int seq) const { return table_[(size_t)seq]; }
  int page_of(int seq, size_t row) const { return table_[(size_t)seq][row / (size_t)P_]; }
  int pages_for_rows(int rows) const { return rows <= 0 ? 0 : (rows + P_ - 1) / P_; }
  // kv_cache::page_info of a cache on this pool ({} when not paged); page_bytes as the cache counts them.
  kv_page_info info(size_t page_bytes) const {
    if (!on()) return {};
    return {P_, n_pages(), n_free(), n_seq_held(), max_per_seq_, page_bytes};
  }
  // kv_cache::pages_for: pages a sequence of n positions (at most n_ctx) holds (0 when not paged).
  int pages_for(int n, int n_ctx) const {
    return on() ? std::min(pages_for_rows(std::min(n, n_ctx)), max_per_seq_) : 0;
  }
  // Staging pages: pages seq holds beside its table for rows that are not body rows (a compressed
  // cache's channel-calibration rows, kv_cache_quant), never shared or pinned; taken and dropped
  // whole, so that they come out of the same budget as the body.
  const std::vector<int>& stage(int seq) const { return stage_[(size_t)seq]; }
  // invalid_input (op first) unless seq can hold n staging pages from the free pages.
  void check_stage(const char* op, int seq, int n) const {
    const int need = n - (int)stage(seq).size();
    if (need > n_free())
      fail_input(std::string("[kv_cache] ") + op + ": seq " + std::to_string(seq) + " needs " + std::to_string(need) +
                 " more pages for its channel-calibration rows, the pool has " + std::to_string(n_free()) + " free of " +
                 std::to_string(n_pages()) + " (raise n_pages / --kv-budget, or end sequences)");
  }
  // Takes pages until seq holds n staging pages (check_stage first).
  void stage_grow(int seq, int n) {
    auto& t = stage_[(size_t)seq];
    while ((int)t.size() < n) {
      KVQ_ASSERT(!free_.empty());
      const int pg = free_.back();
      free_.pop_back();
      refs_[(size_t)pg] = 1;
      t.push_back(pg);
    }
  }
  // Drops seq's staging pages beyond its first n.
  void stage_shrink(int seq, int n) {
    auto& t = stage_[(size_t)seq];
    while ((int)t.size() > std::max(n, 0)) {
      unref(t.back());
      t.pop_back();
    }
  }
  // Pages referenced by at least one sequence (not only pinned).
  int n_seq_held() const {
    int n = 0;
    for (size_t i = 0; i < refs_.size(); ++i) n += refs_[i] > pins_[i];
    return n;
  }

  // invalid_input (op first) unless seq's table can cover rows [0, rows) from the free pages.
  void check_grow(const char* op, int seq, int rows) const {
    const int need = pages_for_rows(rows) - (int)table(seq).size();
    if (need > n_free())
      fail_input(std::string("[kv_cache] ") + op + ": seq " + std::to_string(seq) + " needs " + std::to_string(need) +
                 " more pages of " + std::to_string(P_) + " rows, the pool has " + std::to_string(n_free()) +
                 " free of " + std::to_string(n_pages()) + " (raise n_pages / --kv-budget, or end sequences)");
  }
  // Takes pages until seq's table covers rows [0, rows) (check_grow first).
  void grow(int seq, int rows) {
    auto& t = table_[(size_t)seq];
    while ((int)t.size() < pages_for_rows(rows)) {
      KVQ_ASSERT(!free_.empty());
      const int pg = free_.back();
      free_.pop_back();
      refs_[(size_t)pg] = 1;
      t.push_back(pg);
    }
  }
  // Whether keeping rows [0, rows) of seq leaves a shared page partly kept (shrink then needs a free page).
  bool needs_copy(int seq, int rows) const {
    const auto& t = table(seq);
    const int j = rows / P_;
    return rows % P_ != 0 && j < (int)t.size() && refs_[(size_t)t[(size_t)j]] > 1;
  }
  // Drops seq's pages beyond rows [0, rows). When the last kept page is shared and partly kept, it
  // is replaced by a fresh page and {old, new} is returned for the cache to copy (else {-1, -1});
  // check needs_copy() against n_free() first.
  std::pair<int, int> shrink(int seq, int rows) {
    auto& t = table_[(size_t)seq];
    const int keep = pages_for_rows(rows);
    while ((int)t.size() > keep) {
      unref(t.back());
      t.pop_back();
    }
    if (!needs_copy(seq, rows)) return {-1, -1};
    KVQ_ASSERT(!free_.empty());
    const int old = t.back(), pg = free_.back();
    free_.pop_back();
    refs_[(size_t)pg] = 1;
    t.back() = pg;
    unref(old);
    return {old, pg};
  }
  // seq (empty table) takes references to pages[0, n) as its first n pages (adopt_rows checks).
  void adopt(int seq, const int* pages, int n) {
    auto& t = table_[(size_t)seq];
    for (int i = 0; i < n; ++i) {
      ++refs_[(size_t)pages[i]];
      t.push_back(pages[i]);
    }
  }
  void pin(int page) {
    check_held("pin_page", page);
    ++refs_[(size_t)page];
    ++pins_[(size_t)page];
  }
  void unpin(int page) {
    if (page < 0 || page >= n_pages() || pins_[(size_t)page] == 0)
      fail_input("[kv_cache] unpin_page: page " + std::to_string(page) + " is not pinned");
    --pins_[(size_t)page];
    unref(page);
  }

  // seq (empty table) takes references to `pages`, which cover rows [0, rows) (load_prefix). A
  // partly covered last page is replaced by a fresh page and {old, new} is returned for the cache
  // to copy (else {-1, -1}). invalid_input (op first) for a non-empty seq, or no free page for the
  // copy; nothing is changed then.
  std::pair<int, int> adopt_rows(const char* op, int seq, const std::vector<int>& pages, int rows) {
    KVQ_ASSERT((int)pages.size() == pages_for_rows(rows));
    if (!table(seq).empty())
      fail_input(std::string("[kv_cache] ") + op + ": seq " + std::to_string(seq) + " is not empty");
    if (rows % P_ != 0 && free_.empty())
      fail_input(std::string("[kv_cache] ") + op + ": seq " + std::to_string(seq) + " needs a free page for its copy of a "
                 "partly filled page; the pool has none of " + std::to_string(n_pages()));
    for (int pg : pages) check_held(op, pg);
    adopt(seq, pages.data(), (int)pages.size());
    return shrink(seq, rows);
  }

 private:
  void check_held(const char* op, int page) const {
    if (page < 0 || page >= n_pages())
      fail_input(std::string("[kv_cache] ") + op + ": page " + std::to_string(page) + " out of range [0, " +
                 std::to_string(n_pages()) + ")");
    if (refs_[(size_t)page] == 0)
      fail_input(std::string("[kv_cache] ") + op + ": page " + std::to_string(page) + " is free (no sequence or pin holds it)");
  }
  void unref(int page) {
    KVQ_ASSERT(refs_[(size_t)page] > 0);
    if (--refs_[(size_t)page] == 0) free_.push_back(page);
  }

  int P_ = 0, max_per_seq_ = 0;
  std::vector<int> refs_;                // [n_pages] references: sequence tables + pins
  std::vector<int> pins_;                // [n_pages] pins
  std::vector<int> free_;                // free page ids (taken from the back)
  std::vector<std::vector<int>> table_;  // [n_seq] page ids in row order
  std::vector<std::vector<int>> stage_;  // [n_seq] staging page ids in order
};

// The kv_prefix of the paged caches (kv_cache::save_prefix): the pages that held a sequence's first
// `rows` rows, pinned, and byte copies of the sequence's regions outside pages (each cache lists
// them in one fixed order, for saving and loading alike).
class kv_prefix_paged final : public kv_prefix {
 public:
  kv_prefix_paged(const void* owner, kv_page_pool& pool, int n_pos, int rows, std::vector<int> pages)
      : owner_(owner), pool_(pool), n_pos_(n_pos), rows_(rows), pages_(std::move(pages)) {
    for (int pg : pages_) pool_.pin(pg);
  }
  ~kv_prefix_paged() override {
    for (int pg : pages_) pool_.unpin(pg);
  }
  kv_prefix_paged(const kv_prefix_paged&) = delete;
  kv_prefix_paged& operator=(const kv_prefix_paged&) = delete;
  int n_pos() const override { return n_pos_; }
  int n_pages() const override { return (int)pages_.size(); }
  int n_full_pages() const override { return rows_ / pool_.page_size(); }
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& x : blobs_) b += x.size();
    return b;
  }
  const void* owner() const { return owner_; }
  int rows() const { return rows_; }
  const std::vector<int>& pages() const { return pages_; }
  std::vector<std::vector<uint8_t>>& blobs() { return blobs_; }
  const std::vector<std::vector<uint8_t>>& blobs() const { return blobs_; }

 private:
  const void* owner_;
  kv_page_pool& pool_;
  int n_pos_ = 0, rows_ = 0;
  std::vector<int> pages_;
  std::vector<std::vector<uint8_t>> blobs_;
};

// A byte region of one sequence's state outside pages (kv_prefix_paged).
struct kv_seq_region {
  uint8_t* p;
  size_t n;
};

// kv_cache::save_prefix of a paged cache (dense and compressed alike): pins seq's pages, which hold
// its rows [0, rows), and copies `regions`, what seq holds outside pages (each cache lists them in
// one fixed order). invalid_input for an empty sequence (n_pos 0).
inline std::shared_ptr<const kv_prefix> kv_save_paged_prefix(const void* owner, kv_page_pool& pool, int seq, int n_pos,
                                                             int rows, const std::vector<kv_seq_region>& regions) {
  if (n_pos == 0) fail_input("[kv_cache] save_prefix: seq " + std::to_string(seq) + " is empty");
  auto px = std::make_shared<kv_prefix_paged>(owner, pool, n_pos, rows, pool.table(seq));
  for (const auto& x : regions) px->blobs().emplace_back(x.p, x.p + x.n);
  return px;
}

// kv_cache::load_prefix of a paged cache: seq (n_pos positions now) takes the pages of `p`, which
// `owner` saved, and its regions (the same list, in the same order, as saved). Returns adopt_rows'
// {from, to}: a partly filled last page the cache copies (copy_page), else {-1, -1}. invalid_input
// for a prefix of another cache, a non-empty seq, or no free page for the copy; nothing is changed then.
inline std::pair<int, int> kv_load_paged_prefix(const void* owner, kv_page_pool& pool, int seq, int n_pos,
                                                const kv_prefix& p, const std::vector<kv_seq_region>& regions) {
  const auto* px = dynamic_cast<const kv_prefix_paged*>(&p);
  if (!px || px->owner() != owner)
    fail_input("[kv_cache] load_prefix: seq " + std::to_string(seq) + ": the prefix was saved by another cache");
  if (n_pos != 0) fail_input("[kv_cache] load_prefix: seq " + std::to_string(seq) + " is not empty");
  const auto copy = pool.adopt_rows("load_prefix", seq, px->pages(), px->rows());
  KVQ_ASSERT(px->blobs().size() == regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    KVQ_ASSERT(px->blobs()[i].size() == regions[i].n);
    if (regions[i].n) std::memcpy(regions[i].p, px->blobs()[i].data(), regions[i].n);
  }
  return copy;
}

}  // namespace kvq
