#include "kvq/thread_pool.h"

#include <algorithm>

namespace kvq {

thread_pool::thread_pool(int n_threads) {
  if (n_threads <= 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
  n_threads_ = n_threads;
  for (int t = 1; t < n_threads_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void thread_pool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int, int)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    try {
      (*job)(tid, n_threads_);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!first_error_) first_error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
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
    pending_ = n_threads_ - 1;
    first_error_ = nullptr;
    ++generation_;
  }
  cv_start_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0, n_threads_);
  } catch (...) {
    mine = std::current_exception();
  }
  std::exception_ptr theirs;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return pending_ == 0; });
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

}  // namespace kvq
