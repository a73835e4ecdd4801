#include "server/prefix_cache.h"

#include <algorithm>
#include <cstring>

namespace kvq::server_detail {

prefix_cache::~prefix_cache() {
  for (const node& n : nodes_)
    if (n.live) cache_.unpin_page(n.page);
}

uint64_t prefix_cache::hash(int parent, const int32_t* block, int n) {
  uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)parent;  // FNV-1a
  for (int i = 0; i < n; ++i) h = (h ^ (uint32_t)block[i]) * 1099511628211ull;
  return h;
}

int prefix_cache::find(int parent, const int32_t* block) const {
  auto [a, b] = index_.equal_range(hash(parent, block, page_));
  for (auto it = a; it != b; ++it) {
    const node& n = nodes_[(size_t)it->second];
    if (n.parent == parent && std::memcmp(n.tokens.data(), block, (size_t)page_ * sizeof(int32_t)) == 0) return it->second;
  }
  return -1;
}

std::vector<int> prefix_cache::match(const int32_t* tokens, int n_tokens) {
  std::vector<int> pages;
  ++tick_;
  int parent = -1;
  for (int j = 0; (j + 1) * page_ <= n_tokens; ++j) {
    const int id = find(parent, tokens + (size_t)j * page_);
    if (id < 0) break;
    nodes_[(size_t)id].used = tick_;
    pages.push_back(nodes_[(size_t)id].page);
    parent = id;
  }
  return pages;
}

void prefix_cache::insert(const int32_t* tokens, int n_pages, const std::vector<int>& pages) {
  ++tick_;
  int parent = -1;
  for (int j = 0; j < n_pages && j < (int)pages.size(); ++j) {
    const int32_t* block = tokens + (size_t)j * page_;
    int id = find(parent, block);
    if (id < 0) {
      cache_.pin_page(pages[(size_t)j]);
      if (free_nodes_.empty()) {
        id = (int)nodes_.size();
        nodes_.emplace_back();
      } else {
        id = free_nodes_.back();
        free_nodes_.pop_back();
      }
      node& n = nodes_[(size_t)id];
      n.parent = parent;
      n.tokens.assign(block, block + page_);
      n.page = pages[(size_t)j];
      n.n_children = 0;
      n.live = true;
      ++live_;
      if (parent >= 0) ++nodes_[(size_t)parent].n_children;
      index_.emplace(hash(parent, block, page_), id);
    }
    nodes_[(size_t)id].used = tick_;
    parent = id;
  }
}

bool prefix_cache::evict_one(const std::vector<int>& keep) {
  int best = -1;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const node& n = nodes_[i];
    if (!n.live || n.n_children > 0 || std::find(keep.begin(), keep.end(), n.page) != keep.end()) continue;
    if (best < 0 || n.used < nodes_[(size_t)best].used) best = (int)i;
  }
  if (best < 0) return false;
  node& n = nodes_[(size_t)best];
  auto [a, b] = index_.equal_range(hash(n.parent, n.tokens.data(), page_));
  for (auto it = a; it != b; ++it)
    if (it->second == best) {
      index_.erase(it);
      break;
    }
  if (n.parent >= 0) --nodes_[(size_t)n.parent].n_children;
  cache_.unpin_page(n.page);
  n.live = false;
  n.tokens.clear();
  free_nodes_.push_back(best);
  --live_;
  return true;
}

}  // namespace kvq::server_detail
