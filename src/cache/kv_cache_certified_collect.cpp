// certified_collector: the reports of the certified caches created while a collector lives
// (include/kvq/certified.h). A global list of live collectors (weak references) under one mutex;
// each collector's slots under its own. Lock order: the global mutex, then a collector's.
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "cache/kv_cache_certified_collect.h"

namespace kvq {

struct certified_collector::state {
  struct slot {
    const kv_cache_certified* live = nullptr;  // nullptr once the cache is destroyed
    certified_report final;
  };
  std::mutex mu;
  std::vector<slot> slots;  // creation order
};

namespace {

std::mutex& global_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::weak_ptr<certified_collector::state>>& active() {
  static std::vector<std::weak_ptr<certified_collector::state>> a;
  return a;
}

}  // namespace

namespace cert_collect {

void attach(const kv_cache_certified* c) {
  std::lock_guard<std::mutex> g(global_mutex());
  for (const auto& w : active())
    if (auto s = w.lock()) {
      std::lock_guard<std::mutex> l(s->mu);
      s->slots.push_back({c, {}});
    }
}

void detach(const kv_cache_certified* c) {
  std::lock_guard<std::mutex> g(global_mutex());
  bool held = false;
  certified_report r;
  for (const auto& w : active())
    if (auto s = w.lock()) {
      std::lock_guard<std::mutex> l(s->mu);
      for (auto& sl : s->slots)
        if (sl.live == c) {
          if (!held) r = c->report();
          held = true;
          sl.final = r;
          sl.live = nullptr;
        }
    }
}

}  // namespace cert_collect

certified_collector::certified_collector() : state_(std::make_shared<state>()) {
  std::lock_guard<std::mutex> g(global_mutex());
  active().push_back(state_);
}

certified_collector::~certified_collector() {
  std::lock_guard<std::mutex> g(global_mutex());
  auto& a = active();
  a.erase(std::remove_if(a.begin(), a.end(),
                         [&](const std::weak_ptr<state>& w) {
                           auto s = w.lock();
                           return !s || s == state_;
                         }),
          a.end());
}

std::vector<certified_report> certified_collector::reports() const {
  std::lock_guard<std::mutex> l(state_->mu);
  std::vector<certified_report> r;
  for (const auto& sl : state_->slots) {
    certified_report x = sl.live ? sl.live->report() : sl.final;
    // a cache that never stored a token was made to validate params (e.g. perplexity()'s check)
    if (x.stats.steps == 0 && x.tiers.host_used_peak == 0) continue;
    r.push_back(std::move(x));
  }
  return r;
}

}  // namespace kvq
