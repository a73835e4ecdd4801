#include "server/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "kvq/certified.h"
#include "kvq/error.h"
#include "server/api.h"
#include "server/prefix_cache.h"
#include "server/step_engine.h"

namespace kvq::server_detail {


struct scheduler::slot {
  std::shared_ptr<seq_job> job;
  seq_request req;
  std::unique_ptr<sampler> smp;
  std::unique_ptr<text_stream> text;
  int n_past = 0;        // positions in the cache
  int32_t next = -1;     // token to feed next (decoding)
  int n_generated = 0;
  uint64_t order = 0;    // admission order (prefill priority)
  int reserved = 0;      // pages its longest run may hold (paged cache)
  int stage_reserved = 0;  // staging pages it may hold until calibrated (0 once it holds none after a step)
  int saved = 0;         // prompt positions up to which its states went to the prefix cache
  bool active() const { return job != nullptr; }
  bool prefilling() const { return n_past < (int)req.prompt.size(); }
};

// ---- seq_job -----------------------------------------------------------------------------------

seq_update seq_job::poll(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return changed_ || pending_.done; });
  seq_update u = pending_;
  pending_.text.clear();
  changed_ = false;
  return u;
}

void seq_job::cancel() {
  cancelled_ = true;
  if (owner_) owner_->wake();
}

// ---- scheduler ---------------------------------------------------------------------------------

scheduler::scheduler(model& m, const tokenizer& tok, const scheduler_params& p)
    : m_(m), tok_(tok), p_(p), pool_(p.n_threads) {
  if (p_.n_parallel < 1) fail_input("[server] --parallel " + std::to_string(p_.n_parallel) + " must be >= 1");
  if (p_.n_batch < 1) fail_input("[server] --batch-size " + std::to_string(p_.n_batch) + " must be >= 1");
  if (p_.n_batch_tokens < 1) fail_input("[server] --batch-tokens " + std::to_string(p_.n_batch_tokens) + " must be >= 1");
  if (p_.n_queue < 0) fail_input("[server] --queue " + std::to_string(p_.n_queue) + " must be >= 0");
  if (p_.kv_page < 0) fail_input("[server] --kv-page " + std::to_string(p_.kv_page) + " must be >= 0 (0: contiguous slots)");
  const bool gpu = p_.device == compute_device::cuda;
  if (p_.kv_budget_bytes > 0 && p_.kv_page == 0 && !gpu)
    fail_input("[server] --kv-budget needs a paged cache (--kv-page > 0)");
  kv_cache_params cp = m_.cache_params(p_.n_ctx, p_.cache, p_.n_parallel);
  cp.n_ubatch = std::max(cp.n_ubatch, p_.n_batch);  // sliding-window rings hold one prefill chunk
  // the certified cache has no paged layout: contiguous slots unless a budget asks for pages
  cp.page_size = is_certified(cp) && p_.kv_budget_bytes == 0 ? 0 : p_.kv_page;
  auto gib = [](double b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.3g GiB", b / (1024.0 * 1024.0 * 1024.0));
    return std::string(s);
  };
  if (gpu) {
    // the runner's pool: as many pages as the budget buys once the runner's KV state outside the pool
    // (staged rows and channel statistics, exact sink rows, KIVI exact rows: allocated for every slot
    // up front) is paid; at most every slot at n_ctx (the runner clamps to that)
    const int max_batch = p_.gpu_step_rows();
    if (p_.kv_budget_bytes > 0) {
      cp.page_size = 0;
      const size_t page_bytes = cuda::runner_page_bytes(m_.hparams(), cp);  // (refuses a format by name)
      const size_t outside = cuda::runner_fixed_kv_bytes(m_.hparams(), cp, max_batch);
      if (outside >= p_.kv_budget_bytes)
        fail_input("[server] --kv-budget " + gib((double)p_.kv_budget_bytes) + " is below the " + gib((double)outside) +
                   " the " + std::to_string(p_.n_parallel) + " slots keep outside the GPU page pool (staged "
                   "channel-calibration rows, exact sink / KIVI rows): raise --kv-budget or lower --parallel");
      const int64_t full = (int64_t)p_.n_parallel * ((p_.n_ctx + 15) / 16);  // (16-position pages at most)
      cp.n_pages = (int)std::min<int64_t>(full, (int64_t)((p_.kv_budget_bytes - outside) / page_bytes));
      if (cp.n_pages == 0)
        fail_input("[server] --kv-budget " + gib((double)p_.kv_budget_bytes) + " holds no GPU page (" +
                   std::to_string(page_bytes) + " bytes each) beside the " + gib((double)outside) +
                   " kept outside the pool");
    }
    engine_ = make_cuda_step_engine(m_, cp, max_batch, p_.cuda_graphs);
  } else if (p_.kv_page > 0 && p_.kv_budget_bytes > 0) {
    // The budget holds all of the cache: what the slots keep outside the pool (exact sink / recent
    // rows, channel statistics, sliding-window rings: `outside`, allocated for every slot up front),
    // the prefix store's copies of that (a 16th of the rest, when there is any), and the pool, whose
    // pages hold the sequences' body rows and their channel-calibration rows (staging pages).
    const size_t page_bytes = kv_page_bytes(cp);
    kv_cache_params one = cp;
    one.n_pages = 1;
    const size_t outside = page_bytes == 0 ? 0 : kv_bytes_at_ctx(one) - page_bytes;
    if (outside >= p_.kv_budget_bytes)
      fail_input("[server] --kv-budget " + gib((double)p_.kv_budget_bytes) + " is below the " + gib((double)outside) +
                 " the " + std::to_string(p_.n_parallel) + " slots keep outside the page pool (exact rows, channel "
                 "statistics, sliding-window rings): raise --kv-budget or lower --parallel");
    prefix_budget_ = outside > 0 ? (p_.kv_budget_bytes - outside) / 16 : 0;
    const size_t pool_bytes = p_.kv_budget_bytes - outside - prefix_budget_;
    // at most what every slot can hold at n_ctx: the cache's own pool without a budget (n_pages 0),
    // each slot's body pages and its staging pages until it is calibrated (sized without allocating)
    kv_cache_params every = cp;
    every.n_pages = 0;
    const int64_t full = page_bytes == 0 ? 0 : (int64_t)((kv_bytes_at_ctx(every) - outside) / page_bytes);
    cp.n_pages = page_bytes == 0 ? 0 : (int)std::min<int64_t>(full, (int64_t)(pool_bytes / page_bytes));
    if (page_bytes > 0 && cp.n_pages == 0)
      fail_input("[server] --kv-budget " + gib((double)p_.kv_budget_bytes) + " holds no page of " +
                 std::to_string(p_.kv_page) + " tokens (" + std::to_string(page_bytes) + " bytes each)");
  }
  if (!engine_) engine_ = make_cpu_step_engine(m_, cp);
  split_free_ = engine_->split_free();
  cache_describe_ = engine_->describe();
  pages_ = engine_->page_info();
  // one sequence at n_ctx must fit the pool: its body pages and, with channel statistics, its
  // staging pages (plus, in the figure to raise --kv-budget to, what the slots keep outside the pool)
  const int stage_need = engine_->stage_pages_for(p_.n_ctx);
  const int seq_need = pages_.max_pages_per_seq + stage_need;
  if (pages_.page_size > 0 && seq_need > pages_.n_pages) {
    const size_t outside =
        stage_need > 0 && p_.kv_budget_bytes > 0 ? engine_->bytes() - (size_t)pages_.n_pages * pages_.page_bytes : 0;
    fail_input("[server] --kv-budget " + gib((double)p_.kv_budget_bytes) + " holds " + std::to_string(pages_.n_pages) +
               " pages of " + std::to_string(pages_.page_size) + " tokens (" + std::to_string(pages_.page_bytes) +
               " bytes each), fewer than the " + std::to_string(seq_need) + " one sequence at -c " +
               std::to_string(p_.n_ctx) +
               (stage_need > 0 ? " may hold (" + std::to_string(stage_need) + " of them for its channel-calibration rows)"
                               : std::string(" needs")) +
               ": raise --kv-budget to at least " + gib((double)seq_need * pages_.page_bytes + (double)outside) +
               " or lower -c");
  }
  if (p_.prefix_reuse && engine_->cpu_cache() && engine_->cpu_cache()->can_save_prefix()) {
    // saved states outside the pool (exact rows, statistics, rings) up to a quarter of the pool
    // (with --kv-budget: the share of the budget set aside above)
    // (without: a quarter of the pool, at least two slots' state outside pages, so a state fits)
    const size_t pool_bytes = (size_t)pages_.n_pages * pages_.page_bytes;
    const size_t slot_outside = (engine_->bytes() - std::min(engine_->bytes(), pool_bytes)) / (size_t)p_.n_parallel;
    const size_t cap = p_.kv_budget_bytes > 0 ? prefix_budget_ : std::max({pool_bytes / 4, (size_t)1 << 20, 2 * slot_outside});
    prefix_ = std::make_unique<prefix_cache>(p_.n_batch, cap);
  }
  for (int i = 0; i < p_.n_parallel; ++i) slots_.push_back(std::make_unique<slot>());

  kv_bytes_ = engine_->bytes();
  kv_bytes_used_ = engine_->bytes_used();
  thread_ = std::thread([this] { loop(); });
}

scheduler::~scheduler() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  prefix_.reset();  // unpins its pages (before the cache goes)
  engine_.reset();
}

void scheduler::publish_pages() {
  if (pages_.page_size == 0) return;
  const kv_page_info pi = engine_->page_info();
  pages_in_use_ = pi.n_seq_held;
  pages_cached_ = pi.n_pages - pi.n_free - pi.n_seq_held;
}

bool scheduler::admit(int i, uint64_t order) {
  auto& [job, req] = waiting_.front();
  const int n_prompt = (int)req.prompt.size();
  std::shared_ptr<const kv_prefix> shared;  // the saved prompt prefix this request starts from
  int reserve = 0, stage = 0;
  if (pages_.page_size > 0) {
    const int n_max = req.max_tokens >= 0 ? (int)std::min<int64_t>(p_.n_ctx, (int64_t)n_prompt + req.max_tokens) : p_.n_ctx;
    reserve = engine_->pages_for(n_max);
    stage = engine_->stage_pages_for(n_max);
    // the last prompt token always runs (its logits)
    if (prefix_ && !job->cancelled()) shared = prefix_->match(req.prompt.data(), n_prompt - 1);
    // pages the running requests may still take
    auto outstanding = [&] {
      int o = 0;
      for (int j = 0; j < p_.n_parallel; ++j)
        if (slots_[j]->active())
          o += std::max(0, slots_[j]->reserved - engine_->seq_pages(j)) +
               std::max(0, slots_[j]->stage_reserved - engine_->seq_stage_pages(j));
      return o;
    };
    const int need = reserve + stage - (shared ? shared->n_full_pages() : 0), owed = outstanding();
    kv_page_info pi = engine_->page_info();
    const int cached_only = pi.n_pages - pi.n_free - pi.n_seq_held;
    if (pi.n_free + cached_only - owed < need) return false;  // waits: evicting would not make room
    while (pi.n_free - owed < need) {
      if (!prefix_ || !prefix_->evict_one(shared.get())) return false;
      pi = engine_->page_info();
    }
  }
  slot& s = *slots_[i];
  s.job = job;
  s.req = std::move(req);
  waiting_.pop_front();
  s.n_past = 0;
  s.n_generated = 0;
  s.next = -1;
  s.order = order;
  s.reserved = reserve;
  s.stage_reserved = stage;
  s.saved = 0;
  s.text = std::make_unique<text_stream>(s.req.stop);
  ++n_active_;
  n_prompt_tokens_ += s.req.prompt.size();
  if (shared) {
    try {
      engine_->cpu_cache()->load_prefix(i, *shared);
      s.n_past = s.saved = shared->n_pos();
      ++prefix_hits_;
      prefix_hit_tokens_ += s.n_past;
    } catch (const std::exception& e) {  // (a bug: the request then runs cold)
      std::fprintf(stderr, "[server] prefix reuse failed, running the prompt cold: %s\n", e.what());
      engine_->clear(i);
    }
  }
  return true;
}

void scheduler::wake() {
  { std::lock_guard lk(mu_); }
  cv_.notify_all();
}

std::shared_ptr<seq_job> scheduler::submit(const seq_request& r) {
  if (r.prompt.empty()) fail_request("prompt", "the prompt is empty (tokenized to zero tokens)", "invalid_value");
  if ((int)r.prompt.size() >= p_.n_ctx)
    fail_request("prompt",
                 "the prompt has " + std::to_string(r.prompt.size()) + " tokens; the context of a slot holds " +
                     std::to_string(p_.n_ctx) + " (prompt + at least one generated token; raise -c)",
                 "context_length_exceeded");
  for (int32_t id : r.prompt)
    if (id < 0 || id >= m_.hparams().n_vocab)
      fail_request("prompt", "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                 std::to_string(m_.hparams().n_vocab) + ")", "invalid_value");
  auto job = std::make_shared<seq_job>();
  job->owner_ = this;
  job->pending_.n_prompt = (int)r.prompt.size();
  {
    std::lock_guard lk(mu_);
    if (shutting_down_) throw api_error(503, shutdown_why_, "unavailable_error", "", "shutting_down");
    if (n_active_.load() + (int)waiting_.size() >= p_.n_parallel + p_.n_queue)
      throw api_error(503, "the server is busy: " + std::to_string(waiting_.size()) +
                               " requests are waiting for a slot or KV pages (--queue " + std::to_string(p_.n_queue) + ")",
                      "unavailable_error", "", "queue_full");
    waiting_.emplace_back(job, r);
    ++n_requests_;
  }
  cv_.notify_all();
  return job;
}

void scheduler::shut_down(const std::string& why) {
  {
    std::lock_guard lk(mu_);
    shutting_down_ = shutdown_pending_ = true;
    shutdown_why_ = why;
  }
  cv_.notify_all();
}

scheduler_metrics scheduler::metrics() const {
  scheduler_metrics s;
  s.requests = n_requests_;
  s.finished = n_finished_;
  s.cancelled = n_cancelled_;
  s.failed = n_failed_;
  s.prompt_tokens = n_prompt_tokens_;
  s.generated_tokens = n_generated_tokens_;
  s.steps = n_steps_;
  s.batch_tokens = n_batch_tokens_;
  s.batch_tokens_max = batch_tokens_max_;
  s.active = n_active_;
  {
    std::lock_guard lk(mu_);
    s.queued = (int)waiting_.size();
  }
  s.kv_bytes_used = kv_bytes_used_;
  s.kv_bytes = kv_bytes_;
  s.pages_in_use = pages_in_use_;
  s.pages_cached = pages_cached_;
  s.pages_total = pages_.n_pages;
  s.page_size = pages_.page_size;
  s.kv_budget_bytes = (size_t)pages_.n_pages * pages_.page_bytes;
  s.prefix_hits = prefix_hits_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  s.prefix_reuse = prefix_ != nullptr;
  s.prefix_bytes = prefix_bytes_;
  return s;
}

void scheduler::loop() {
  const int n_vocab = m_.hparams().n_vocab;
  std::vector<int32_t> tokens, pos, seq;
  std::vector<uint8_t> out;
  std::vector<int> out_slot;  // slot of each logits row
  std::vector<float> logits;
  std::vector<int32_t> decode_ids;  // [n_decode] greedy ids from the device (step_engine::device_argmax)
  std::vector<int32_t> sampled;     // [n_out] the sampled id of each output row
  std::vector<std::string> sample_error;  // [n_out] why a row's sampling failed ("": it did not)
  uint64_t n_admitted = 0;

  // Publishes new text (and the end) to the job's reader.
  auto publish = [&](slot& s, bool done, const std::string& reason, const std::string& err = {}) {
    std::string t = s.text->take(done);
    {
      std::lock_guard lk(s.job->mu_);
      seq_update& u = s.job->pending_;
      u.text += t;
      u.n_generated = s.n_generated;
      if (done) {
        u.done = true;
        u.finish_reason = reason;
        u.error = err;
      }
      s.job->changed_ = true;
    }
    s.job->cv_.notify_all();
  };
  auto finish = [&](int i, const std::string& reason, const std::string& err = {}) {
    slot& s = *slots_[i];
    // Slot and counters first, so a reader that sees the end also sees them.
    engine_->clear(i);
    kv_bytes_used_ = engine_->bytes_used();
    publish_pages();
    s.reserved = 0;
    s.stage_reserved = 0;
    if (reason == "cancelled") ++n_cancelled_;
    else if (reason == "error") ++n_failed_;
    else ++n_finished_;
    --n_active_;
    publish(s, true, reason, err);
    s.job.reset();
    s.smp.reset();
    s.text.reset();
  };

  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || shutdown_pending_ || !waiting_.empty() || n_active_.load() > 0; });
      if (stop_) break;
      if (shutdown_pending_) {  // shut_down: every request ends with its error
        shutdown_pending_ = false;
        for (auto& [job, req] : waiting_) end_queued(*job, "error", shutdown_why_);
        n_failed_ += waiting_.size();
        waiting_.clear();
        for (int i = 0; i < p_.n_parallel; ++i)
          if (slots_[i]->active()) finish(i, "error", shutdown_why_);
        continue;
      }
      // requests cancelled while queued (client gone) end here, without a slot
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (!it->first->cancelled()) {
          ++it;
          continue;
        }
        end_queued(*it->first, "cancelled");
        ++n_cancelled_;
        it = waiting_.erase(it);
      }
      // FIFO: the first request waits (and the rest behind it) until a slot and its pages are free
      for (int i = 0; i < p_.n_parallel && !waiting_.empty(); ++i) {
        slot& s = *slots_[i];
        if (s.active()) continue;
        if (!admit(i, n_admitted)) break;
        ++n_admitted;
        try {
          s.smp = std::make_unique<sampler>(s.req.sampling);
        } catch (const std::exception& e) {
          finish(i, "error", e.what());
        }
      }
      publish_pages();
      // nothing runs and the first request cannot get pages: wait for a change (a new request or stop)
      if (n_active_.load() == 0 && !waiting_.empty()) {
        cv_.wait_for(lk, std::chrono::milliseconds(100));
        continue;
      }
    }
    for (int i = 0; i < p_.n_parallel; ++i)
      if (slots_[i]->active() && slots_[i]->job->cancelled()) finish(i, "cancelled");

    // The batch: every decoding slot's next token, then prompt pieces, oldest first, up to the
    // step's token budget (scheduler.h).
    tokens.clear(), pos.clear(), seq.clear(), out.clear(), out_slot.clear();
    std::vector<int> chunk_len(p_.n_parallel, 0);
    for (int i = 0; i < p_.n_parallel; ++i) {
      slot& s = *slots_[i];
      if (!s.active() || s.prefilling()) continue;
      tokens.push_back(s.next), pos.push_back(s.n_past), seq.push_back(i), out.push_back(1), out_slot.push_back(i);
      chunk_len[i] = 1;
    }
    std::vector<int> pre;
    for (int i = 0; i < p_.n_parallel; ++i)
      if (slots_[i]->active() && slots_[i]->prefilling()) pre.push_back(i);
    std::sort(pre.begin(), pre.end(), [&](int a, int b) { return slots_[a]->order < slots_[b]->order; });
    // With no sequence decoding there is no inter-token gap to protect: prompts take up to one whole
    // -b chunk in the step (a lone 128-token prompt runs in one step, not four).
    const int n_decode = (int)tokens.size();
    int budget = n_decode == 0 ? std::max(p_.n_batch_tokens, p_.n_batch)
                               : std::max(p_.n_batch_tokens - n_decode, (p_.n_batch_tokens + 3) / 4);
    bool any_piece = false;
    for (int i : pre) {
      if (budget <= 0) break;
      slot& s = *slots_[i];
      const int n_prompt = (int)s.req.prompt.size();
      int end = std::min(n_prompt, (s.n_past / p_.n_batch + 1) * p_.n_batch);  // the chunk's end
      if (split_free_) end = std::min(end, s.n_past + budget);  // a piece: results do not depend on it
      else if (end - s.n_past > budget && any_piece) break;  // whole chunks, in order; the oldest always
      const int n = end - s.n_past;
      budget -= n;
      any_piece = true;
      for (int t = s.n_past; t < end; ++t) {
        tokens.push_back(s.req.prompt[t]), pos.push_back(t), seq.push_back(i);
        out.push_back(t == n_prompt - 1);
        if (t == n_prompt - 1) out_slot.push_back(i);
      }
      chunk_len[i] = n;
    }
    if (tokens.empty()) continue;
    const int n_out = (int)out_slot.size();
    logits.resize((size_t)std::max(n_out, 1) * n_vocab);
    model_batch b{tokens, pos, seq, out};
    // greedy ids of the decode rows from the device when every decoding sequence is greedy (only
    // n_decode ids cross instead of n_decode logits rows; the same first maximum as sampler's)
    bool use_ids = engine_->device_argmax() && n_decode > 0 && !p_.record_logits;
    for (int r = 0; use_ids && r < n_decode; ++r) use_ids = slots_[out_slot[r]]->req.sampling.temp <= 0.0f;
    decode_ids.resize(n_decode);
    try {
      engine_->step(b, n_decode, logits.data(), use_ids ? decode_ids.data() : nullptr, pool_);
    } catch (const std::exception& e) {
      // A failed step appends nothing (model::forward validates first) or leaves a sequence half
      // appended: end every request of the batch with the error and clear its slot.
      std::fprintf(stderr, "[server] step failed: %s\n", e.what());
      for (int i = 0; i < p_.n_parallel; ++i)
        if (chunk_len[i] > 0) finish(i, "error", e.what());
      continue;
    }
    ++n_steps_;
    n_batch_tokens_ += tokens.size();
    batch_tokens_max_ = std::max(batch_tokens_max_.load(), (int)tokens.size());
    for (int i = 0; i < p_.n_parallel; ++i) {
      slot& s = *slots_[i];
      s.n_past += chunk_len[i];
      // calibrated (or started from a calibrated prefix): its staging pages are back in the pool
      if (s.active() && s.stage_reserved > 0 && s.n_past > 0 && engine_->seq_stage_pages(i) == 0) s.stage_reserved = 0;
    }
    // a prompt prefilled to a chunk boundary: its state goes to the prefix cache
    if (prefix_) {
      for (int i = 0; i < p_.n_parallel; ++i) {
        slot& s = *slots_[i];
        if (chunk_len[i] == 0 || s.n_past > (int)s.req.prompt.size() || s.n_past % p_.n_batch != 0 || s.n_past <= s.saved)
          continue;
        try {
          prefix_->insert(s.req.prompt.data(), s.n_past, [&] { return engine_->cpu_cache()->save_prefix(i); });
        } catch (const std::exception& e) {  // (a bug: the request goes on, its prefix is not cached)
          std::fprintf(stderr, "[server] saving a prompt prefix failed: %s\n", e.what());
        }
        s.saved = s.n_past;
      }
      prefix_bytes_ = prefix_->bytes();
    }

    // Sample every row on the pool: rows are independent (each slot has its own sampler and RNG), and
    // a greedy scan of the vocabulary (or a top-p sort of it) costs a serial millisecond a row.
    sampled.assign(n_out, -1);
    sample_error.assign(n_out, std::string());
    pool_.parallel_for(n_out, (int64_t)n_out * n_vocab, [&](int64_t r, int) {
      if (use_ids && r < n_decode) {
        sampled[r] = decode_ids[r];
        return;
      }
      try {
        sampled[r] = slots_[out_slot[r]]->smp->sample(logits.data() + (size_t)r * n_vocab, n_vocab);
      } catch (const std::exception& e) {
        sample_error[r] = e.what();
      }
    });
    for (int r = 0; r < n_out; ++r) {
      const int i = out_slot[r];
      slot& s = *slots_[i];
      const float* row = logits.data() + (size_t)r * n_vocab;
      if (p_.record_logits) {
        uint64_t h = 1469598103934665603ull;  // FNV-1a over the row's bytes
        const auto* b = reinterpret_cast<const unsigned char*>(row);
        for (size_t k = 0; k < (size_t)n_vocab * sizeof(float); ++k) h = (h ^ b[k]) * 1099511628211ull;
        std::lock_guard lk(s.job->mu_);
        s.job->pending_.logits_hash.push_back(h);
      }
      if (!sample_error[r].empty()) {
        finish(i, "error", sample_error[r]);
        continue;
      }
      const int32_t id = sampled[r];
      if (!s.req.ignore_eos && tok_.is_eog(id)) {
        finish(i, "stop");
        continue;
      }
      ++s.n_generated;
      ++n_generated_tokens_;
      {
        std::lock_guard lk(s.job->mu_);
        s.job->pending_.ids.push_back(id);
      }
      const bool stopped = s.text->append(tok_.token_to_piece(id));
      if (stopped) finish(i, "stop");
      else if (s.req.max_tokens >= 0 && s.n_generated >= s.req.max_tokens) finish(i, "length");
      // the prompt and the generated tokens fill the context: this token takes its last position
      // and a next one would have none (usage's prompt + completion tokens never exceed n_ctx)
      else if (s.n_past + 1 >= p_.n_ctx) finish(i, "length");
      else {
        s.next = id;
        publish(s, false, "");
      }
    }
    kv_bytes_used_ = engine_->bytes_used();
    kv_bytes_ = engine_->bytes();
    publish_pages();
  }
  // Shutting down: end what is left.
  for (int i = 0; i < p_.n_parallel; ++i)
    if (slots_[i]->active()) finish(i, "cancelled");
  std::lock_guard lk(mu_);
  for (auto& [job, req] : waiting_) end_queued(*job, "cancelled");
  waiting_.clear();
}

void scheduler::end_queued(seq_job& job, const std::string& reason, const std::string& err) {
  {
    std::lock_guard jl(job.mu_);
    job.pending_.done = true;
    job.pending_.finish_reason = reason;
    job.pending_.error = err;
    job.changed_ = true;
  }
  job.cv_.notify_all();
}

}  // namespace kvq::server_detail
