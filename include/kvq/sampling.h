// Token sampling over a logits row, in llama.cpp's default chain order:
// top-k -> top-p -> min-p -> temperature -> draw (temp <= 0: greedy argmax, first max wins).
// Sources: top-p (Holtzman et al. 2020, arXiv:1904.09751, §3.1); min-p (Nguyen et al. 2024,
// arXiv:2407.01082).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace kvq {

struct sampling_params {
  float temp = 0.8f;    // <= 0: greedy
  int top_k = 40;       // <= 0: off
  float top_p = 0.95f;  // >= 1: off
  float min_p = 0.05f;  // <= 0: off
  // 0xFFFFFFFF: random seed (as llama.cpp's LLAMA_DEFAULT_SEED); below 2^32 it seeds mt19937
  // directly, above through std::seed_seq of its two halves (every 64-bit seed its own stream)
  uint64_t seed = 0xFFFFFFFFu;
};

// A seed as a request or a flag gives it, any 64-bit integer (OpenAI's range): -1 (llama-server's,
// llama.cpp's) is the random seed 0xFFFFFFFF; another negative seed is its two's complement.
inline uint64_t sampling_seed(int64_t s) { return s == -1 ? 0xFFFFFFFFu : (uint64_t)s; }

class sampler {
 public:
  // Throws invalid_input for a temperature that is not finite (NaN, +-Inf), top_p NaN, infinite or
  // <= 0, min_p outside [0, 1].
  explicit sampler(const sampling_params& p);
  // logits: [n_vocab] f32. Returns the chosen token id. Throws invalid_input when every logit is
  // NaN or -Inf.
  int32_t sample(const float* logits, int32_t n_vocab);
  uint64_t seed() const { return seed_; }

 private:
  sampling_params p_;
  uint64_t seed_;
  std::mt19937 rng_;
  std::vector<std::pair<float, int32_t>> cand_;  // scratch
};

}  // namespace kvq
