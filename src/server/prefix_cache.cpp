#include "server/prefix_cache.h"

#include <algorithm>
#include <cstring>

namespace kvq::server_detail {

uint64_t prefix_cache::hash(int parent, const int32_t* block) const {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)parent;  // FNV-1a
  for (int i = 0; i < block_; ++i) h = (h ^ (uint32_t)block[i]) * 1099511628211ull;
  return h;
}

int prefix_cache::find(int parent, const int32_t* block) const {
  auto [a, b] = index_.equal_range(hash(parent, block));
  for (auto it = a; it != b; ++it) {
    const node& n = nodes_[(size_t)it->second];
    if (n.parent == parent && std::memcmp(n.tokens.data(), block, (size_t)block_ * sizeof(int32_t)) == 0) return it->second;
  }
  return -1;
}

std::shared_ptr<const kv_prefix> prefix_cache::match(const int32_t* tokens, int n_tokens) {
  std::shared_ptr<const kv_prefix> best;
  ++tick_;
  int parent = -1;
  for (int j = 0; (j + 1) * block_ <= n_tokens; ++j) {
    const int id = find(parent, tokens + (size_t)j * block_);
    if (id < 0) break;
    nodes_[(size_t)id].used = tick_;
    if (nodes_[(size_t)id].state) best = nodes_[(size_t)id].state;
    parent = id;
  }
  return best;
}

bool prefix_cache::contains(const int32_t* tokens, int n_tokens) const {
  int id = -1;
  for (int j = 0; (j + 1) * block_ <= n_tokens; ++j)
    if ((id = find(id, tokens + (size_t)j * block_)) < 0) return false;
  return id >= 0 && nodes_[(size_t)id].state != nullptr;
}

void prefix_cache::insert(const int32_t* tokens, int n_tokens,
                          const std::function<std::shared_ptr<const kv_prefix>()>& save) {
  ++tick_;
  int parent = -1;
  for (int j = 0; (j + 1) * block_ <= n_tokens; ++j) {
    const int32_t* block = tokens + (size_t)j * block_;
    int id = find(parent, block);
    if (id < 0) {
      if (free_nodes_.empty()) {
        id = (int)nodes_.size();
        nodes_.emplace_back();
      } else {
        id = free_nodes_.back();
        free_nodes_.pop_back();
      }
      node& n = nodes_[(size_t)id];
      n.parent = parent;
      n.tokens.assign(block, block + block_);
      n.state.reset();
      n.n_children = 0;
      n.live = true;
      ++live_;
      if (parent >= 0) ++nodes_[(size_t)parent].n_children;
      index_.emplace(hash(parent, block), id);
    }
    nodes_[(size_t)id].used = tick_;
    parent = id;
  }
  if (parent < 0 || nodes_[(size_t)parent].state) return;
  auto state = save();
  if (state->bytes() > max_bytes_) {  // would not fit even alone: not kept (its path goes too)
    drop_bare_path(parent);
    return;
  }
  nodes_[(size_t)parent].state = std::move(state);
  bytes_ += nodes_[(size_t)parent].state->bytes();
  const kv_prefix* keep = nodes_[(size_t)parent].state.get();
  while (bytes_ > max_bytes_ && evict_one(keep)) {
  }
}

// Drops node id and then its parents while each is a live leaf without a state (it serves nothing).
void prefix_cache::drop_bare_path(int id) {
  while (id >= 0) {
    const node& n = nodes_[(size_t)id];
    if (!n.live || n.state || n.n_children > 0) break;
    const int parent = n.parent;
    drop(id);
    id = parent;
  }
}

void prefix_cache::drop(int id) {
  node& n = nodes_[(size_t)id];
  auto [a, b] = index_.equal_range(hash(n.parent, n.tokens.data()));
  for (auto it = a; it != b; ++it)
    if (it->second == id) {
      index_.erase(it);
      break;
    }
  if (n.parent >= 0) --nodes_[(size_t)n.parent].n_children;
  if (n.state) bytes_ -= n.state->bytes();
  n.state.reset();  // unpins its pages unless a sequence or another holder still references them
  n.live = false;
  n.tokens.clear();
  free_nodes_.push_back(id);
  --live_;
}

bool prefix_cache::evict_one(const kv_prefix* keep) {
  // Least recently used state first; among equal use a leaf before an inner node (its state alone
  // serves its requests) and, along one prompt, the deeper (later made) one first. An inner node
  // keeps its place on the path without its state: the states along one long prompt are all inner
  // nodes but the last, and must be evictable too, or the cap does not hold (issue 16).
  int best = -1;
  auto better = [&](const node& a, int ia, const node& b, int ib) {
    if (a.used != b.used) return a.used < b.used;
    if ((a.n_children == 0) != (b.n_children == 0)) return a.n_children == 0;
    return ia > ib;
  };
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const node& n = nodes_[i];
    if (!n.live || !n.state || (keep && n.state.get() == keep)) continue;
    if (best < 0 || better(n, (int)i, nodes_[(size_t)best], best)) best = (int)i;
  }
  if (best < 0) return false;
  node& b = nodes_[(size_t)best];
  bytes_ -= b.state->bytes();
  b.state.reset();  // unpins its pages unless a sequence or another holder still references them
  // a leaf without a state serves nothing: drop it, and its parents that are left the same way
  drop_bare_path(best);
  return true;
}

}  // namespace kvq::server_detail
