// A fixed pool of worker threads for data-parallel loops (the calling thread participates).
// Decode steps issue dozens of small parallel loops per token, so workers spin briefly on an atomic
// job counter before sleeping on a condition variable (as ggml's threadpool does); the spin is
// bounded so that an idle pool does not burn a core.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq {

class thread_pool {
 public:
  // n_threads: total threads including the caller; <= 0 means hardware_concurrency().
  explicit thread_pool(int n_threads = 0);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const { return n_threads_; }
  // Runs fn(i, thread_index) for i in [0, n) split into contiguous ranges; blocks until done.
  // Exceptions thrown by fn are rethrown in the caller (the first one).
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn);
  // Work (in any consistent unit, e.g. multiply-adds) below which a loop runs on the calling
  // thread alone: waking other threads costs more than such a loop saves.
  static constexpr int64_t min_parallel_work = 1 << 16;
  // parallel_for that runs serially (thread_index 0) when `work` < min_parallel_work.
  void parallel_for(int64_t n, int64_t work, const std::function<void(int64_t, int)>& fn);
  // Runs fn(thread_index, n_threads) once on every thread.
  void run_on_all(const std::function<void(int, int)>& fn);

 private:
  void worker(int tid);
  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr first_error_;
};

}  // namespace kvq
