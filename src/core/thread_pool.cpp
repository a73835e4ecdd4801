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
using clock = std::chrono::steady_clock;
// How long an idle worker spins for the next call before blocking. Decode issues a call every few
// microseconds inside a step (weight products, attention), so a worker stays awake through a step
// and blocks between steps or when the machine has other work; waking a blocked worker costs a
// futex wake (several microseconds).
constexpr auto kWorkerSpin = std::chrono::microseconds(50);
// How long the caller spins for joined workers to finish before blocking (a worker that the OS
// took off the CPU while holding a chunk then gets the caller's core).
constexpr auto kCallerSpin = std::chrono::microseconds(20);
constexpr uint64_t kClosed = uint64_t{1} << 31;
constexpr uint64_t kJoinedMask = kClosed - 1;

// Spins (checking the clock every 64 pauses) while pred() holds, for at most `limit`; returns
// whether pred() stopped holding.
template <class Pred>
bool spin_while(Pred pred, clock::duration limit) {
  const auto t0 = clock::now();
  for (int iter = 1;; ++iter) {
    if (!pred()) return true;
    KVQ_CPU_RELAX();
    if ((iter & 63) == 0 && clock::now() - t0 > limit) return !pred();
  }
}
}  // namespace

thread_pool::thread_pool(int n_threads) {
  if (n_threads <= 0) n_threads = (int)std::max(1u, std::thread::hardware_concurrency());
  n_threads_ = n_threads;
  for (int t = 1; t < n_threads_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

thread_pool::~thread_pool() {
  stop_.store(true, std::memory_order_seq_cst);
  gen_.fetch_add(1, std::memory_order_seq_cst);
  gen_.notify_all();
  for (auto& t : threads_) t.join();
}

uint32_t thread_pool::wait_for_job(uint32_t seen) {
  auto idle = [&] { return gen_.load(std::memory_order_acquire) == seen; };
  if (spin_while(idle, kWorkerSpin)) return gen_.load(std::memory_order_acquire);
  for (;;) {
    // Dekker with run_on_all: it bumps gen_ then reads sleepers_; here sleepers_ goes up before
    // gen_ is read, so either it sees a sleeper and notifies or this thread sees the new gen_
    // (and atomic::wait re-checks the value in the kernel).
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    gen_.wait(seen, std::memory_order_seq_cst);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_acquire);
    if (g != seen) return g;
  }
}

void thread_pool::worker(int tid) {
  uint32_t seen = 0;
  for (;;) {
    const uint32_t g = wait_for_job(seen);
    if (stop_.load(std::memory_order_acquire)) return;
    seen = g;
    // Join call g unless the caller has closed it (or moved on to a later one).
    uint64_t s = entry_.load(std::memory_order_acquire);
    bool joined = false;
    while ((uint32_t)(s >> 32) == g && !(s & kClosed))
      if (entry_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        joined = true;
        break;
      }
    if (!joined) continue;
    try {
      (*job_)(tid, n_threads_);
    } catch (...) {
      std::lock_guard<std::mutex> lk(error_mu_);
      if (!first_error_) first_error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_seq_cst);
    if (caller_waiting_.load(std::memory_order_seq_cst)) done_.notify_one();
  }
}

void thread_pool::run_on_all(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  // Every worker that joined the previous call has finished it, and none can join it any more:
  // the job, the done count and the error slot are the caller's until the new entry is published.
  job_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  first_error_ = nullptr;
  const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
  entry_.store((uint64_t)g << 32, std::memory_order_release);
  gen_.store(g, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) gen_.notify_all();

  std::exception_ptr mine;
  try {
    fn(0, n_threads_);
  } catch (...) {
    mine = std::current_exception();
  }
  const uint32_t joined = (uint32_t)(entry_.fetch_or(kClosed, std::memory_order_acq_rel) & kJoinedMask);
  auto running = [&] { return done_.load(std::memory_order_acquire) != joined; };
  if (!spin_while(running, kCallerSpin)) {
    caller_waiting_.store(true, std::memory_order_seq_cst);
    for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != joined;) done_.wait(d, std::memory_order_seq_cst);
    caller_waiting_.store(false, std::memory_order_relaxed);
  }
  std::exception_ptr theirs;
  {
    std::lock_guard<std::mutex> lk(error_mu_);
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
  // About four chunks per thread: a thread that is slow or late leaves its chunks to the others.
  const int64_t chunk = std::max<int64_t>(1, n / (4 * (int64_t)n_threads_));
  std::atomic<int64_t> next{0};
  run_on_all([&](int tid, int) {
    for (int64_t b = next.fetch_add(chunk, std::memory_order_relaxed); b < n;
         b = next.fetch_add(chunk, std::memory_order_relaxed)) {
      const int64_t e = std::min(n, b + chunk);
      for (int64_t i = b; i < e; ++i) fn(i, tid);
    }
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
