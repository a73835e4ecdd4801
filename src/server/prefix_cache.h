// Prefix reuse for the server: the states of prompts already run, indexed by their tokens, so that a
// request whose prompt starts with the same tokens (a shared system prompt) starts from that state
// instead of recomputing it. A radix tree of fixed-size token blocks as SGLang's RadixAttention
// (Zheng et al. 2024, "SGLang", §3) and vLLM's automatic prefix caching keep it: node j of a path
// holds tokens [j * block, (j + 1) * block) given every block before it, compared token by token (no
// hash is trusted), and the cache's saved state of a sequence that held exactly tokens
// [0, (j + 1) * block) (kv_cache::save_prefix: its pages, pinned, and a copy of what it keeps
// outside pages). The block is the scheduler's prefill chunk, so a request that starts from a
// node runs every later chunk as a cold run does. Least recently used states (of leaves first, then
// of inner nodes, which stay on the path) are dropped when admission needs pages or the copies
// outside the pool exceed max_bytes.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "kvq/kv_cache.h"

namespace kvq::server_detail {

class prefix_cache {
 public:
  // block: tokens per node (> 0); max_bytes: most bytes of saved state outside the page pool.
  prefix_cache(int block, size_t max_bytes) : block_(block), max_bytes_(max_bytes) {}

  // The deepest saved state whose tokens start `tokens` (at most n_tokens of them), or null; marks
  // its path used.
  std::shared_ptr<const kv_prefix> match(const int32_t* tokens, int n_tokens);
  // Whether the state after tokens[0, n_tokens) (a multiple of block) is saved.
  bool contains(const int32_t* tokens, int n_tokens) const;
  // Saves the state after tokens[0, n_tokens) (a multiple of block), taken from save() unless it is
  // saved already; missing nodes on its path are added without a state. Then drops least recently
  // used states (never this one) while the saved bytes exceed max_bytes, so bytes() <= max_bytes
  // always: a state larger than max_bytes alone is not kept.
  void insert(const int32_t* tokens, int n_tokens, const std::function<std::shared_ptr<const kv_prefix>()>& save);
  // Drops the least recently used state that is not `keep` (a leaf's before an inner node's of the
  // same use; an inner node stays on the path, a leaf left without a state goes with its bare
  // parents); false when there is none.
  bool evict_one(const kv_prefix* keep);
  int n_nodes() const { return (int)live_; }
  size_t bytes() const { return bytes_; }  // saved state outside the page pool

 private:
  struct node {
    int parent = -1;                        // -1: the block at position 0
    std::vector<int32_t> tokens;            // [block]
    std::shared_ptr<const kv_prefix> state; // null: a node on the path only
    int n_children = 0;
    uint64_t used = 0;                      // last use (tick_)
    bool live = false;
  };
  int find(int parent, const int32_t* block) const;
  uint64_t hash(int parent, const int32_t* block) const;
  void drop(int id);
  void drop_bare_path(int id);  // id, then its parents, while each is a live leaf without a state

  int block_ = 0;
  size_t max_bytes_ = 0, bytes_ = 0;
  std::vector<node> nodes_;
  std::vector<int> free_nodes_;
  std::multimap<uint64_t, int> index_;  // hash(parent, block) -> node
  uint64_t tick_ = 0;
  size_t live_ = 0;
};

}  // namespace kvq::server_detail
