// Continuous batching over one KV cache of n_parallel sequence slots (Orca's iteration-level
// scheduling, Yu et al. 2022, OSDI '22, §3): one thread runs steps; each step is ONE
// model::forward over a batch that holds one decode token of every generating sequence and
// prefill pieces of new prompts (on the GPU, scheduler_params::device = cuda, a step_engine runs
// the same batch as one model_runner::decode of the decode tokens and one forward per piece;
// step_engine.h). A step holds at most n_batch_tokens tokens (the per-step token
// budget of vLLM's chunked prefill, max_num_batched_tokens; Agrawal et al. 2024, "Taming
// throughput-latency tradeoff in LLM inference with Sarathi-Serve", OSDI '24, §4.2): the decode
// tokens first, then prompt pieces, oldest request first, up to what the budget leaves (at least
// n_batch_tokens / 4 while any prompt waits, so prompts progress however many sequences decode).
// A step's cost grows with its tokens, so the budget bounds the inter-token gap of the decoding
// sequences while prompts are prefilled beside them. A step without decode tokens has no such gap
// to protect and holds up to max(n_batch_tokens, n_batch) prompt tokens (a lone prompt runs in
// whole n_batch chunks, not in n_batch_tokens pieces). Pieces never cross a multiple of n_batch (the
// prefix cache's blocks and the sliding-window rings' one-append bound). Where the cache's results
// do not depend on how a prompt is split into appends (every cache without sliding-window layers:
// attend_plan.h's canonical merge order, the channel calibration's fixed positions, the weight
// products' per-token bits) a piece is cut wherever the budget ends; with sliding-window layers
// (Gemma 3), whose ring wraps where the appends put it, pieces are the whole n_batch chunks at
// fixed offsets and the oldest one runs even over the budget.
// Requests wait in a FIFO queue for a free slot and join between steps; a slot is cleared when its
// request ends (finished, cancelled or failed).
//
// Batch invariance: a sequence's chunking does not depend on the others, every kv_cache keeps
// sequences apart (attend_batch equals attend alone bit for bit), and the weight products give
// every token the same bits at any batch size (tests/core/test_matmul.cpp, quant tiers vs scalar
// token by token), so a greedy request returns the same tokens alone or among others
// (tests/server/test_scheduler.cpp).
// The compressed caches' channel statistics (the default K channel scale μ_K, λ_K) are kept per
// sequence and reset when a slot is cleared, so a request calibrates on its own first positions
// (kv_cache_params::channel_calib, however the chunks bring them), never on another request's data.
//
// Paged cache (kv_page > 0): the slots share one pool of pages (--kv-budget bytes). A request is
// admitted when a slot is free and the pool can give it the pages of its longest possible run
// (prompt + max_tokens, or n_ctx) and its channel-calibration staging pages (kv_cache::stage_pages_for;
// that part ends once it holds none after a step), counting what the running requests may still take; otherwise it
// waits in the queue (FIFO). So an admitted request never runs out of pages, and nothing is
// preempted. Its pages go back when it ends (finished, cancelled, failed). Prefix reuse
// (prefix_cache.h): whenever a prompt's prefill reaches a chunk boundary (a multiple of n_batch), the
// cache saves the sequence's state there (kv_cache::save_prefix: its pages, pinned, and what it keeps
// outside pages); a new request whose prompt starts with a saved prefix loads it
// (kv_cache::load_prefix) and prefills from that boundary on, with the chunks a cold run computes
// from there (attention's split depends on a chunk's queries), so it returns the cold result for
// every cache type.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/sampling.h"
#include "kvq/thread_pool.h"
#include "kvq/tokenizer.h"

namespace kvq::server_detail {

class prefix_cache;
class step_engine;

struct scheduler_params {
  int n_ctx = 0;          // positions per slot (resolved, > 0)
  int n_parallel = 4;     // slots
  int n_batch = 128;      // prefill chunk grid (tokens): the prefix cache's block, the most one piece holds
  int n_batch_tokens = 32;  // tokens per step beside decode tokens (decode first, then prompt pieces; see above)
  int n_queue = 64;       // waiting requests before submit() refuses
  int n_threads = 0;      // compute threads (0: all)
  bool record_logits = false;  // tests: seq_update::logits_hash of every sampled row
  kv_cache_params cache;  // types and options (shapes come from the model)
  int kv_page = 64;       // tokens per page; 0: contiguous slots (no pool, no prefix reuse)
  // Bytes of the page pool (all layers, K and V); 0: every slot can hold n_ctx. Pages =
  // kv_budget_bytes / kv_page_bytes (at most n_parallel slots at n_ctx).
  size_t kv_budget_bytes = 0;
  bool prefix_reuse = true;  // start requests from saved prompt prefixes (paged caches)
  // Where steps run (step_engine.h). cuda: cuda::model_runner, its own pool of 16-position pages
  // (kv_page is not used; kv_budget_bytes sizes the pool, 0: every slot can hold n_ctx), pieces
  // in whole n_batch chunks, no prefix reuse (CPU caches only).
  compute_device device = compute_device::cpu;
  bool cuda_graphs = false;  // cuda: decode and mixed steps as CUDA graphs (model_runner::set_cuda_graphs)
  // cuda: the runner's max_batch: a step's decode rows (one per slot) and its first prompt piece (at
  // most one n_batch chunk), which model_runner::step runs in one pass.
  int gpu_step_rows() const { return n_batch + n_parallel; }
};

struct seq_request {
  std::vector<int32_t> prompt;  // token ids, 1 <= size < n_ctx
  int max_tokens = -1;          // < 0: until end of generation or a full context
  sampling_params sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};

// What a request has produced so far; the scheduler writes, the HTTP thread reads (poll).
struct seq_update {
  std::string text;               // new text since the last poll (stop strings cut, whole UTF-8 characters)
  bool done = false;
  std::string finish_reason;      // "stop" (end of generation or a stop string), "length", "cancelled", "error"
  std::string error;              // finish_reason "error": the message
  int n_prompt = 0, n_generated = 0;
  std::vector<int32_t> ids;       // every generated id so far (not cut at a stop string)
  std::vector<uint64_t> logits_hash;  // record_logits: FNV-1a of each sampled logits row's bytes
};

class seq_job {
 public:
  // Waits up to `timeout` for new text or the end; returns the accumulated update (text since the
  // last poll). 
  seq_update poll(std::chrono::milliseconds timeout);
  // Asks the scheduler to end this request (client gone); its slot is freed before the next step.
  void cancel();
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class scheduler;
  std::mutex mu_;
  std::condition_variable cv_;
  seq_update pending_;  // text accumulates until polled; the rest is the current state
  bool changed_ = false;
  std::atomic<bool> cancelled_{false};
  class scheduler* owner_ = nullptr;
};

struct scheduler_metrics {
  uint64_t requests = 0, finished = 0, cancelled = 0, failed = 0;
  uint64_t prompt_tokens = 0, generated_tokens = 0;
  uint64_t steps = 0, batch_tokens = 0;
  int batch_tokens_max = 0;  // most tokens in one step
  int active = 0, queued = 0;
  size_t kv_bytes_used = 0, kv_bytes = 0;
  // page pool (paged caches; zeros otherwise): pages held by a sequence, pinned only by the prefix
  // cache, all; the pool's bytes (the budget); requests served from a cached prefix and its tokens
  int pages_in_use = 0, pages_cached = 0, pages_total = 0, page_size = 0;
  size_t kv_budget_bytes = 0;
  uint64_t prefix_hits = 0, prefix_hit_tokens = 0;
  bool prefix_reuse = false;  // prompt prefixes are reused (a paged cache, not --no-prefix-reuse)
  size_t prefix_bytes = 0;    // the prefix cache's saved state outside the page pool
};

class scheduler {
 public:
  // Creates the cache (n_seq = n_parallel) and starts the thread. Throws invalid_input for
  // n_parallel < 1, n_batch < 1, n_batch_tokens < 1, n_queue < 0, kv_page < 0, a budget without pages or smaller than
  // one sequence at n_ctx, and what make_kv_cache throws; on cuda what make_cuda_step_engine
  // throws (a format the GPU does not run, by name; no CUDA build or no GPU).
  scheduler(model& m, const tokenizer& tok, const scheduler_params& p);
  ~scheduler();  // stops the thread; unfinished requests end with finish_reason "cancelled"

  // Queues a request. Throws api_error 503 (with retry) when n_queue requests already wait, and
  // 400 when the prompt is empty or does not leave room for one generated token (>= n_ctx).
  std::shared_ptr<seq_job> submit(const seq_request& r);
  // Graceful stop (SIGINT / SIGTERM): ends every queued and running request with finish_reason
  // "error" and `why` (a streamed reply gets its error event and [DONE], a non-streamed one its
  // error body), and refuses new requests with 503 from then on. The thread keeps running until the
  // destructor; returns at once (the requests end on the scheduler's next turn).
  void shut_down(const std::string& why);
  scheduler_metrics metrics() const;
  const scheduler_params& params() const { return p_; }
  std::string cache_describe() const { return cache_describe_; }


 private:
  struct slot;
  void loop();
  void wake();
  // Admits the queue's first request into slot i when the pool can hold its longest run (mu_ held);
  // false when it must wait.
  bool admit(int i, uint64_t order);
  void publish_pages();  // the page gauges (scheduler thread)
  // Ends a request that never got a slot (cancelled while queued, shut down): done with `reason`.
  static void end_queued(seq_job& job, const std::string& reason, const std::string& err = {});
  friend class seq_job;

  model& m_;
  const tokenizer& tok_;
  scheduler_params p_;
  std::unique_ptr<step_engine> engine_;
  std::unique_ptr<prefix_cache> prefix_;  // null: no prefix reuse
  std::string cache_describe_;
  thread_pool pool_;
  std::vector<std::unique_ptr<slot>> slots_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<seq_job>, seq_request>> waiting_;
  bool stop_ = false;
  bool shutting_down_ = false;   // shut_down was called: submit refuses
  bool shutdown_pending_ = false;  // the loop has yet to end the requests (mu_)
  std::string shutdown_why_;
  std::thread thread_;

  std::atomic<uint64_t> n_requests_{0}, n_finished_{0}, n_cancelled_{0}, n_failed_{0};
  std::atomic<uint64_t> n_prompt_tokens_{0}, n_generated_tokens_{0}, n_steps_{0}, n_batch_tokens_{0};
  std::atomic<int> n_active_{0}, batch_tokens_max_{0};
  std::atomic<size_t> kv_bytes_used_{0}, kv_bytes_{0};
  std::atomic<int> pages_in_use_{0}, pages_cached_{0};
  std::atomic<uint64_t> prefix_hits_{0}, prefix_hit_tokens_{0};
  std::atomic<size_t> prefix_bytes_{0};
  kv_page_info pages_;  // the pool's shape (constant)
  bool split_free_ = true;  // prefill results do not depend on the pieces (step_engine::split_free)
  size_t prefix_budget_ = 0;  // --kv-budget's share for the prefix store's copies outside the pool
};

}  // namespace kvq::server_detail
