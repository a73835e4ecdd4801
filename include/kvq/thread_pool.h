// A fixed pool of worker threads for data-parallel loops (the calling thread participates).
//
// Built for a machine shared with other work (a server's clients, the OS, other processes):
// - Work is shared out dynamically: parallel_for hands out chunks of indices through an atomic
//   counter, and run_on_all's callers (matmul, attention) do the same with their own counters.
// - A call does not wait for workers that are late: the caller runs its share, then closes the
//   call; a worker that had not joined by then (descheduled by the OS, asleep) skips it, so a
//   loop waits only for chunks already being computed, never for a thread to be scheduled.
// - Idle workers spin briefly (decode issues dozens of loops per token, microseconds apart), then
//   block on a futex (std::atomic::wait), as llama.cpp's threadpool polls and then waits on a
//   condition variable and OpenMP's passive wait policy sleeps; a blocked worker costs no CPU.
//   The caller likewise spins briefly for joined workers to finish, then blocks.
#pragma once
#include <atomic>
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
  // Runs fn(i, thread_index) once for every i in [0, n), in chunks of consecutive indices handed
  // out dynamically (any thread may run any chunk; thread_index < size() is unique among threads
  // running at once, for per-thread scratch); blocks until done. Exceptions thrown by fn are
  // rethrown in the caller (the first one); the other indices may or may not have run.
  void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn);
  // Work (in any consistent unit, e.g. multiply-adds) below which a loop runs on the calling
  // thread alone: waking other threads costs more than such a loop saves.
  static constexpr int64_t min_parallel_work = 1 << 16;
  // parallel_for that runs serially (thread_index 0) when `work` < min_parallel_work.
  void parallel_for(int64_t n, int64_t work, const std::function<void(int64_t, int)>& fn);
  // Runs fn(thread_index, size()) on the calling thread (thread_index 0) and on every worker that
  // joins before the caller's own fn returns; blocks until those calls return. A worker that is
  // late skips the call, so fn must share its work through an atomic counter (a worker may find
  // nothing left), never split it statically by thread_index. Exceptions as parallel_for.
  void run_on_all(const std::function<void(int, int)>& fn);

 private:
  void worker(int tid);
  // Spins, then blocks, until gen_ differs from `seen` or the pool stops; returns gen_.
  uint32_t wait_for_job(uint32_t seen);

  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  // Job generation: bumped once per call; idle workers wait on it.
  std::atomic<uint32_t> gen_{0};
  // Entry of the current call: generation << 32 | closed bit (31) | workers joined (bits 0-30).
  std::atomic<uint64_t> entry_{0};
  // Joined workers whose fn returned; the caller waits on it for entry_'s count.
  std::atomic<uint32_t> done_{0};
  std::atomic<int> sleepers_{0};         // workers blocked on gen_
  std::atomic<bool> caller_waiting_{false};  // caller blocked on done_
  std::atomic<bool> stop_{false};
  std::mutex error_mu_;
  std::exception_ptr first_error_;
};

}  // namespace kvq
