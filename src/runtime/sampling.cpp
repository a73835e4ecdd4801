#include "kvq/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvq/error.h"

namespace kvq {

sampler::sampler(const sampling_params& p) : p_(p) {
  if (!std::isfinite(p.temp))
    fail_input("[sampling] temperature " + std::to_string(p.temp) + " must be a finite number (<= 0: greedy)");
  if (!std::isfinite(p.top_p) || p.top_p <= 0.0f)
    fail_input("[sampling] top_p " + std::to_string(p.top_p) + " must be in (0, 1] (>= 1 turns it off)");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    fail_input("[sampling] min_p " + std::to_string(p.min_p) + " must be in [0, 1]");
  seed_ = p.seed == 0xFFFFFFFFu ? std::random_device{}() : p.seed;
  if (seed_ >> 32) {  // a 64-bit seed (the server's OpenAI seeds): both halves, so s and s + 2^32 differ
    std::seed_seq q{(uint32_t)seed_, (uint32_t)(seed_ >> 32)};
    rng_.seed(q);
  } else {
    rng_.seed((uint32_t)seed_);
  }
}

int32_t sampler::sample(const float* logits, int32_t n_vocab) {
  // Greedy: first maximum.
  int32_t best = -1;
  float best_v = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n_vocab; ++i)
    if (logits[i] > best_v) { best_v = logits[i]; best = i; }
  if (best < 0) fail_input("[sampling] every logit is NaN or -Inf");
  if (p_.temp <= 0.0f) return best;

  cand_.clear();
  for (int32_t i = 0; i < n_vocab; ++i)
    if (!std::isnan(logits[i]) && logits[i] > -std::numeric_limits<float>::infinity()) cand_.push_back({logits[i], i});
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = cand_.size();
  if (p_.top_k > 0 && (size_t)p_.top_k < keep) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    keep = p_.top_k;
    cand_.resize(keep);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax at temperature 1 for top-p / min-p filtering (as llama.cpp's chain does).
  auto probs = [&](float temp) {
    std::vector<double> pr(cand_.size());
    double sum = 0;
    for (size_t i = 0; i < cand_.size(); ++i) sum += pr[i] = std::exp((double)(cand_[i].first - cand_[0].first) / temp);
    for (auto& x : pr) x /= sum;
    return pr;
  };
  if (p_.top_p < 1.0f) {
    const auto pr = probs(1.0f);
    double cum = 0;
    size_t i = 0;
    for (; i < pr.size(); ++i) {
      cum += pr[i];
      if (cum >= p_.top_p) { ++i; break; }
    }
    cand_.resize(std::max<size_t>(1, std::min(i, pr.size())));
  }
  if (p_.min_p > 0.0f) {
    const float thresh = cand_[0].first + std::log(p_.min_p);  // p_i >= min_p * p_max
    size_t i = 1;
    while (i < cand_.size() && cand_[i].first >= thresh) ++i;
    cand_.resize(i);
  }
  const auto pr = probs(p_.temp);
  std::discrete_distribution<size_t> dist(pr.begin(), pr.end());
  return cand_[dist(rng_)].second;
}

}  // namespace kvq
