// Prefix reuse for the server: the full pages of prompts already run, indexed by their tokens, so
// that a request whose prompt starts with the same tokens (a shared system prompt) takes those
// pages instead of recomputing them (kv_cache::share_prefix). A radix tree of page-sized token
// blocks as SGLang's RadixAttention (Zheng et al. 2024, "SGLang", §3) and vLLM's automatic prefix
// caching keep it: node j of a path holds the page of tokens [j * page_size, (j + 1) * page_size)
// given every block before it, compared token by token (no hash is trusted). Each node pins its
// page (kv_cache::pin_page), so a cached page outlives the request that wrote it until evicted,
// least recently used leaf first, when admission needs free pages.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "kvq/kv_cache.h"

namespace kvq::server_detail {

class prefix_cache {
 public:
  explicit prefix_cache(kv_cache& cache) : cache_(cache), page_(cache.page_info().page_size) {}
  ~prefix_cache();  // unpins every page

  // Pages of the longest run of cached blocks that starts `tokens` (at most n_tokens / page_size);
  // marks them used.
  std::vector<int> match(const int32_t* tokens, int n_tokens);
  // Caches the first n_pages full blocks of `tokens`, held by a sequence on pages[0, n_pages)
  // (those positions already appended): blocks not cached yet are added and their pages pinned.
  void insert(const int32_t* tokens, int n_pages, const std::vector<int>& pages);
  // Unpins the least recently used leaf whose page is not in `keep`; false when there is none.
  bool evict_one(const std::vector<int>& keep);
  int n_nodes() const { return (int)live_; }

 private:
  struct node {
    int parent = -1;                // -1: a block at position 0
    std::vector<int32_t> tokens;    // [page_size]
    int page = -1;                  // pinned
    int n_children = 0;
    uint64_t used = 0;              // last use (tick_)
    bool live = false;
  };
  int find(int parent, const int32_t* block) const;
  static uint64_t hash(int parent, const int32_t* block, int n);

  kv_cache& cache_;
  int page_ = 0;
  std::vector<node> nodes_;
  std::vector<int> free_nodes_;
  std::multimap<uint64_t, int> index_;  // hash(parent, block) -> node
  uint64_t tick_ = 0;
  size_t live_ = 0;
};

}  // namespace kvq::server_detail
