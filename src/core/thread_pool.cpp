#include "kvq/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVQ_CPU_RELAX() _mm_pause()
#else
#define KVQ_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvq {

namespace {
// How long a worker spins for the next job before sleeping. Decode issues a job every few
// microseconds; an idle pool sleeps after this.
constexpr auto kSpin = std::chrono::microseconds(200);
}  // namespace

thread_pool::thread_pool(int n_threads) {
  if (n_threads <= 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
  n_threads_ = n_threads;
  for (int t = 1; t < n_threads_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void thread_pool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    // Spin, then sleep, until a new generation (job) or stop.
    auto t0 = std::chrono::steady_clock::now();
    int iter = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
      KVQ_CPU_RELAX();
      if ((++iter & 1023) == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_start_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
        sleepers_.fetch_sub(1);
        break;
      }
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    const std::function<void(int, int)>* job = job_;
    try {
      (*job)(tid, n_threads_);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!first_error_) first_error_ = std::current_exception();
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void thread_pool::run_on_all(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    first_error_ = nullptr;
    pending_.store(n_threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  if (sleepers_.load() > 0) cv_start_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0, n_threads_);
  } catch (...) {
    mine = std::current_exception();
  }
  int iter = 0;
  while (pending_.load(std::memory_order_acquire) != 0) {
    KVQ_CPU_RELAX();
    if ((++iter & 255) == 0) std::this_thread::yield();
  }
  std::exception_ptr theirs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    theirs = first_error_;
    first_error_ = nullptr;
  }
  if (mine) std::rethrow_exception(mine);
  if (theirs) std::rethrow_exception(theirs);
}

void thread_pool::parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (n_threads_ == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  run_on_all([&](int tid, int nt) {
    const int64_t per = (n + nt - 1) / nt;
    const int64_t b = std::min<int64_t>(n, per * tid), e = std::min<int64_t>(n, b + per);
    for (int64_t i = b; i < e; ++i) fn(i, tid);
  });
}

void thread_pool::parallel_for(int64_t n, int64_t work, const std::function<void(int64_t, int)>& fn) {
  if (work < min_parallel_work) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  parallel_for(n, fn);
}

}  // namespace kvq
