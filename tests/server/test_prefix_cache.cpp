// The server's prefix store (src/server/prefix_cache.h) on stand-in states of known bytes: the
// saved bytes stay within max_bytes, also for the states along one long prompt, each an inner node
// of the next (issue 16: one 1,959-token prompt left 101 MB against a cap of 6.8 MB), and a
// request still finds the deepest state that is left.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

#include "server/prefix_cache.h"

namespace kvq::server_detail {
namespace {

struct fake_prefix final : kv_prefix {
  fake_prefix(int n, size_t b) : n_(n), b_(b) {}
  int n_pos() const override { return n_; }
  int n_pages() const override { return 0; }
  int n_full_pages() const override { return 0; }
  size_t bytes() const override { return b_; }
  int n_;
  size_t b_;
};

TEST(PrefixCache, StatesAlongOnePromptStayWithinTheCap) {
  const int block = 16, n_blocks = 40;
  const size_t state_bytes = 1000, cap = 4500;  // four states fit
  prefix_cache pc(block, cap);
  std::vector<int32_t> prompt(block * n_blocks);
  std::iota(prompt.begin(), prompt.end(), 7);
  int saved = 0;
  for (int j = 1; j <= n_blocks; ++j) {  // as the scheduler saves a prefilling prompt, chunk by chunk
    pc.insert(prompt.data(), j * block, [&] {
      ++saved;
      return std::make_shared<fake_prefix>(j * block, state_bytes);
    });
    EXPECT_LE(pc.bytes(), cap) << "after " << j << " chunks";
  }
  EXPECT_EQ(saved, n_blocks);
  EXPECT_EQ(pc.bytes(), 4 * state_bytes);
  // the deepest state (the last one saved) is kept, and found for the whole prompt
  EXPECT_TRUE(pc.contains(prompt.data(), n_blocks * block));
  auto m = pc.match(prompt.data(), (int)prompt.size());
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->n_pos(), n_blocks * block);
  // a state larger than the cap alone is not kept (nor its new path), the others stay
  std::vector<int32_t> other(block, 3);
  pc.insert(other.data(), block, [&] { return std::make_shared<fake_prefix>(block, cap + 1); });
  EXPECT_FALSE(pc.contains(other.data(), block));
  EXPECT_EQ(pc.bytes(), 4 * state_bytes);
  EXPECT_EQ(pc.match(other.data(), block), nullptr);
  // evicting everything leaves no node behind
  while (pc.evict_one(nullptr)) {
  }
  EXPECT_EQ(pc.bytes(), 0u);
  EXPECT_EQ(pc.n_nodes(), 0);
  EXPECT_EQ(pc.match(prompt.data(), (int)prompt.size()), nullptr);
}

// Two prompts sharing a system prompt: a leaf's state goes before an inner node's of the same use,
// and an inner node that lost its state still leads to the states below it.
TEST(PrefixCache, LeavesGoFirstAndInnerNodesKeepThePath) {
  const int block = 4;
  prefix_cache pc(block, 1u << 20);
  std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<int32_t> b = {1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97, 96};
  for (int n : {4, 8, 12}) pc.insert(a.data(), n, [&] { return std::make_shared<fake_prefix>(n, 10); });
  pc.insert(b.data(), 12, [&] { return std::make_shared<fake_prefix>(12, 10); });
  EXPECT_EQ(pc.bytes(), 40u);
  // a's states were used before b's insert touched the shared path (blocks 0, 1): a's leaf is the
  // least recently used state
  ASSERT_TRUE(pc.evict_one(nullptr));
  EXPECT_FALSE(pc.contains(a.data(), 12));
  EXPECT_TRUE(pc.contains(b.data(), 12));
  EXPECT_TRUE(pc.contains(a.data(), 8));
  // next: the shared inner states (used at b's insert, like b's leaf: the leaf first)
  ASSERT_TRUE(pc.evict_one(nullptr));
  EXPECT_FALSE(pc.contains(b.data(), 12));
  EXPECT_TRUE(pc.contains(a.data(), 8));
  ASSERT_TRUE(pc.evict_one(nullptr));  // the deeper of the two shared states
  EXPECT_FALSE(pc.contains(a.data(), 8));
  auto m = pc.match(b.data(), 12);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->n_pos(), 4);
  EXPECT_EQ(pc.bytes(), 10u);
}

}  // namespace
}  // namespace kvq::server_detail
