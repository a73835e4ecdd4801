// The model work of one scheduler step and the KV pages behind it (scheduler.h), on the device the
// server was started with: the CPU engine (one model::forward over the whole batch, attention
// through kv_cache::attend_batch) or the model on the GPU (cuda::model_runner, kvq/cuda_model.h:
// the step's decode tokens and its first prompt piece through ONE model_runner::step (decode rows
// alone: model_runner::decode, as CUDA graphs when asked), any further piece through
// model_runner::forward of its sequence). The scheduler decides the batch; the engine runs it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"
#include "kvq/model.h"
#include "kvq/thread_pool.h"

namespace kvq::server_detail {

class step_engine {
 public:
  virtual ~step_engine() = default;

  // Runs batch b: its first n_decode tokens are one token each of distinct sequences (each with
  // its output flag set), then prompt pieces, each one sequence's consecutive positions continuing
  // what it holds. logits: [rows, n_vocab] f32, one row per set output flag in batch order.
  // decode_ids: nullptr, or [n_decode]: the engine may then write the decode rows' greedy ids (the
  // first maximum of each row, as sampler does at temp <= 0) there instead of their logits rows
  // (their rows are left unwritten); only asked when device_argmax(). Throws what model::forward /
  // model_runner throw; the scheduler then ends every request of the batch.
  virtual void step(const model_batch& b, int n_decode, float* logits, int32_t* decode_ids, thread_pool& pool) = 0;
  virtual void clear(int seq) = 0;  // forgets sequence seq (its pages return to the pool)

  // Pages (page_size 0: contiguous slots, no admission by pages).
  virtual kv_page_info page_info() const = 0;
  virtual int pages_for(int n_pos) const = 0;  // pages a sequence of n_pos positions holds
  virtual int seq_pages(int seq) const = 0;    // pages sequence seq holds now
  // Staging pages (kv_cache::stage_pages_for / seq_stage_pages): beside the body's pages, the most a
  // sequence growing to n_pos positions holds and those seq holds now; 0 on the GPU.
  virtual int stage_pages_for(int n_pos) const { (void)n_pos; return 0; }
  virtual int seq_stage_pages(int seq) const { (void)seq; return 0; }
  virtual size_t bytes() const = 0;            // K/V bytes allocated
  virtual size_t bytes_used() const = 0;       // K/V bytes holding stored positions
  virtual std::string describe() const = 0;

  // Results do not depend on how a prompt is cut into pieces (the scheduler may then cut a piece
  // wherever the step's token budget ends; otherwise pieces are whole n_batch chunks at fixed
  // offsets, so a sequence's chunking, and with it its bits, is the same alone and in any batch).
  virtual bool split_free() const = 0;
  // step() can return greedy ids computed on the device (fewer bytes back than the logits rows).
  virtual bool device_argmax() const { return false; }
  // The CPU cache, for prefix reuse (kv_cache::save_prefix / load_prefix); nullptr on the GPU.
  virtual kv_cache* cpu_cache() { return nullptr; }
};

// The CPU engine over make_kv_cache(cp).
std::unique_ptr<step_engine> make_cpu_step_engine(model& m, const kv_cache_params& cp);

// The GPU engine: cuda::model_runner(m, cp, max_batch) (cp.n_pages > 0 sizes its page pool; its
// pages hold 16 positions, cp.page_size is not used), CUDA graphs for decode steps when
// cuda_graphs. Checks first as forward_engine_check (the format by name, then the build / GPU:
// unsupported "[cuda] not supported ..." / "[cuda] no GPU visible ...").
std::unique_ptr<step_engine> make_cuda_step_engine(const model& m, const kv_cache_params& cp, int max_batch,
                                                   bool cuda_graphs);

}  // namespace kvq::server_detail
