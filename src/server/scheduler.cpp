#include "server/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "kvq/error.h"
#include "server/api.h"

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
  if (p_.n_queue < 0) fail_input("[server] --queue " + std::to_string(p_.n_queue) + " must be >= 0");
  kv_cache_params cp = m_.cache_params(p_.n_ctx, p_.cache, p_.n_parallel);
  cp.n_ubatch = std::max(cp.n_ubatch, p_.n_batch);  // sliding-window rings hold one prefill chunk
  cache_ = make_kv_cache(cp);
  cache_describe_ = cache_->describe();
  for (int i = 0; i < p_.n_parallel; ++i) slots_.push_back(std::make_unique<slot>());

  kv_bytes_ = cache_->bytes();
  kv_bytes_used_ = cache_->bytes_used();
  thread_ = std::thread([this] { loop(); });
}

scheduler::~scheduler() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
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
    if (n_active_.load() + (int)waiting_.size() >= p_.n_parallel + p_.n_queue)
      throw api_error(503, "the server is busy: " + std::to_string(waiting_.size()) +
                               " requests are waiting for a slot (--queue " + std::to_string(p_.n_queue) + ")",
                      "unavailable_error", "", "queue_full");
    waiting_.emplace_back(job, r);
    ++n_requests_;
  }
  cv_.notify_all();
  return job;
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
  s.active = n_active_;
  {
    std::lock_guard lk(mu_);
    s.queued = (int)waiting_.size();
  }
  s.kv_bytes_used = kv_bytes_used_;
  s.kv_bytes = kv_bytes_;
  return s;
}

void scheduler::loop() {
  const int n_vocab = m_.hparams().n_vocab;
  std::vector<int32_t> tokens, pos, seq;
  std::vector<uint8_t> out;
  std::vector<int> out_slot;  // slot of each logits row
  std::vector<float> logits;
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
    cache_->clear(i);
    kv_bytes_used_ = cache_->bytes_used();
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
      cv_.wait(lk, [&] { return stop_ || !waiting_.empty() || n_active_.load() > 0; });
      if (stop_) break;
      for (int i = 0; i < p_.n_parallel && !waiting_.empty(); ++i) {
        slot& s = *slots_[i];
        if (s.active()) continue;
        auto [job, req] = std::move(waiting_.front());
        waiting_.pop_front();
        s.job = job;
        s.req = std::move(req);
        s.n_past = 0;
        s.n_generated = 0;
        s.next = -1;
        s.order = n_admitted++;
        s.text = std::make_unique<text_stream>(s.req.stop);
        ++n_active_;
        n_prompt_tokens_ += s.req.prompt.size();
        try {
          s.smp = std::make_unique<sampler>(s.req.sampling);
        } catch (const std::exception& e) {
          finish(i, "error", e.what());
        }
      }
    }
    for (int i = 0; i < p_.n_parallel; ++i)
      if (slots_[i]->active() && slots_[i]->job->cancelled()) finish(i, "cancelled");

    // The batch: every decoding slot's next token, then whole prefill chunks, oldest first.
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
    int budget = p_.n_batch;
    for (int i : pre) {
      slot& s = *slots_[i];
      const int n_prompt = (int)s.req.prompt.size();
      const int end = std::min(n_prompt, (s.n_past / p_.n_batch + 1) * p_.n_batch);
      const int n = end - s.n_past;
      if (n > budget) break;  // whole chunks only, in order (a chunk never shrinks for the others)
      budget -= n;
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
    try {
      m_.forward(b, *cache_, pool_, logits.data());
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
    for (int i = 0; i < p_.n_parallel; ++i) slots_[i]->n_past += chunk_len[i];

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
      int32_t id;
      try {
        id = s.smp->sample(row, n_vocab);
      } catch (const std::exception& e) {
        finish(i, "error", e.what());
        continue;
      }
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
      else if (s.n_past >= p_.n_ctx) finish(i, "length");  // no position left for this token
      else {
        s.next = id;
        publish(s, false, "");
      }
    }
    kv_bytes_used_ = cache_->bytes_used();
    kv_bytes_ = cache_->bytes();
  }
  // Shutting down: end what is left.
  for (int i = 0; i < p_.n_parallel; ++i)
    if (slots_[i]->active()) finish(i, "cancelled");
  std::lock_guard lk(mu_);
  for (auto& [job, req] : waiting_) {
    std::lock_guard jl(job->mu_);
    job->pending_.done = true;
    job->pending_.finish_reason = "cancelled";
    job->cv_.notify_all();
  }
  waiting_.clear();
}

}  // namespace kvq::server_detail
