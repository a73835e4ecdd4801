// thread_pool: every index runs exactly once whatever the threads do (dynamic chunks, late workers
// skipping a call), thread indices are unique among threads running at once, errors come back to
// the caller, and the pool works across back-to-back calls, calls between which its workers have
// blocked, and destruction while they are blocked.
#include "kvq/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kvq {
namespace {

// Runs parallel_for over n and checks each index ran once and no thread index was in use twice.
void check_cover(thread_pool& pool, int64_t n) {
  std::vector<std::atomic<int>> hits((size_t)n);
  std::vector<std::atomic<int>> busy((size_t)pool.size());
  std::atomic<int> overlaps{0}, bad_tid{0};
  pool.parallel_for(n, [&](int64_t i, int tid) {
    if (tid < 0 || tid >= pool.size()) {
      bad_tid.fetch_add(1);
      return;
    }
    if (busy[(size_t)tid].exchange(1)) overlaps.fetch_add(1);
    hits[(size_t)i].fetch_add(1);
    busy[(size_t)tid].store(0);
  });
  int64_t once = 0;
  for (auto& h : hits) once += h.load() == 1;
  EXPECT_EQ(once, n) << "n " << n << " threads " << pool.size();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(bad_tid.load(), 0);
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
  for (int nt : {1, 2, 3, 8}) {
    thread_pool pool(nt);
    for (int64_t n : {0, 1, 2, 3, 7, 17, 97, 1000, 4099}) check_cover(pool, n);
  }
}

TEST(ThreadPool, BackToBackCallsSumExactly) {
  // 20000 calls microseconds apart (as in decode), each summing 0..n-1: n(n-1)/2 every time.
  thread_pool pool(4);
  const int64_t n = 64;
  int64_t wrong = 0;
  for (int call = 0; call < 20000; ++call) {
    std::atomic<int64_t> sum{0};
    pool.parallel_for(n, [&](int64_t i, int) { sum.fetch_add(i + call, std::memory_order_relaxed); });
    wrong += sum.load() != n * (n - 1) / 2 + n * call;
  }
  EXPECT_EQ(wrong, 0);
}

TEST(ThreadPool, RunOnAllWithAnAtomicCounterDoesAllWork) {
  thread_pool pool(3);
  for (int call = 0; call < 2000; ++call) {
    std::atomic<int64_t> next{0}, sum{0};
    std::atomic<int> ran_on_caller{0};
    const int64_t n_items = 1 + call % 50;
    pool.run_on_all([&](int tid, int nt) {
      EXPECT_EQ(nt, 3);
      if (tid == 0) ran_on_caller.fetch_add(1);
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) sum.fetch_add(i);
    });
    ASSERT_EQ(sum.load(), n_items * (n_items - 1) / 2) << "call " << call;
    ASSERT_EQ(ran_on_caller.load(), 1);
  }
}

TEST(ThreadPool, WorksAfterWorkersBlock) {
  // Pauses far longer than the workers' spin: they block, and each call must wake or skip them.
  thread_pool pool(3);
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    check_cover(pool, 1000);
  }
  // Work long enough that blocked workers wake and join: more than one thread takes part.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<std::atomic<int>> used(3);
  pool.parallel_for(64, [&](int64_t, int tid) {
    used[(size_t)tid].store(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  });
  EXPECT_GE(used[0].load() + used[1].load() + used[2].load(), 2);
}

TEST(ThreadPool, ErrorsReachTheCaller) {
  thread_pool pool(4);
  for (int64_t bad : {0, 5, 99}) {  // index 0 runs first on some thread; the others anywhere
    EXPECT_THROW(pool.parallel_for(100, [&](int64_t i, int) {
      if (i == bad) throw std::runtime_error("bad index");
    }),
                 std::runtime_error);
    check_cover(pool, 100);  // the pool still works afterwards
  }
  EXPECT_THROW(pool.run_on_all([](int, int) { throw std::invalid_argument("every thread"); }), std::invalid_argument);
  check_cover(pool, 100);
}

TEST(ThreadPool, DestroyedWhileWorkersBlock) {
  for (int i = 0; i < 20; ++i) {
    thread_pool pool(4);
    check_cover(pool, 100);
    if (i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace
}  // namespace kvq
