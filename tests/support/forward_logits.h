// Test helper: a model's logits for every token of a sequence, fed in chunks, and the largest
// difference from a float64 reference.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/model.h"

namespace kvq::test {

// Feeds toks to m as sequence 0 of cache in chunks of the given sizes (summing to toks.size()),
// keeping every token's logits: returns [toks.size(), n_vocab].
inline std::vector<float> forward_logits(model& m, kv_cache& cache, thread_pool& pool,
                                         const std::vector<int32_t>& toks, const std::vector<int>& chunks) {
  const int n_vocab = m.hparams().n_vocab;
  std::vector<float> logits(toks.size() * (size_t)n_vocab);
  size_t t = 0;
  for (int n : chunks) {
    m.forward(std::span<const int32_t>(toks.data() + t, (size_t)n), (int)t, 0, cache, pool, &logits[t * n_vocab], true);
    t += (size_t)n;
  }
  return logits;
}

struct max_diff {
  double err = 0;  // max |ref - got|
  double ref = 0;  // max |ref|
};
inline max_diff max_abs_diff(const std::vector<double>& ref, const std::vector<float>& got) {
  max_diff d;
  for (size_t i = 0; i < ref.size(); ++i) {
    d.err = std::max(d.err, std::fabs(ref[i] - got[i]));
    d.ref = std::max(d.ref, std::fabs(ref[i]));
  }
  return d;
}

}  // namespace kvq::test
