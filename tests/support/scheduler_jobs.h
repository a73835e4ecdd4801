// Test helpers for the continuous-batching scheduler (src/server/scheduler.h), shared by
// tests/server/test_scheduler.cpp (CPU engine) and test_scheduler_cuda.cpp (GPU engine).
#pragma once
#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "server/scheduler.h"

namespace kvq::server_detail::test {

// Polls job j until it is done; returns its text accumulated over the updates and the last
// update's ids, logits hash, count, finish reason and error.
inline seq_update wait_done(seq_job& j) {
  seq_update all;
  for (;;) {
    seq_update u = j.poll(std::chrono::milliseconds(1000));
    all.text += u.text;
    all.ids = u.ids;
    all.logits_hash = u.logits_hash;
    all.n_generated = u.n_generated;
    all.finish_reason = u.finish_reason;
    all.error = u.error;
    if (u.done) return all;
  }
}

// Runs every request of reqs alone (one after the other), then submits them all at once and
// samples the scheduler's metrics every poll interval until all 2 x reqs.size() have finished.
struct alone_together {
  std::vector<seq_update> alone, together;  // [reqs.size()] each, in request order
  int max_active = 0;                       // most sequences active at once while together
  int max_pages = 0;                        // most pages in use at once while together
};
inline alone_together run_alone_then_together(scheduler& s, const std::vector<seq_request>& reqs,
                                              std::chrono::milliseconds poll) {
  alone_together r;
  for (const auto& q : reqs) r.alone.push_back(wait_done(*s.submit(q)));
  std::vector<std::shared_ptr<seq_job>> jobs;
  for (const auto& q : reqs) jobs.push_back(s.submit(q));
  for (;;) {
    const scheduler_metrics mt = s.metrics();
    r.max_active = std::max(r.max_active, mt.active);
    r.max_pages = std::max(r.max_pages, mt.pages_in_use);
    if (mt.finished == 2 * reqs.size()) break;
    std::this_thread::sleep_for(poll);
  }
  for (auto& j : jobs) r.together.push_back(wait_done(*j));
  return r;
}

}  // namespace kvq::server_detail::test
