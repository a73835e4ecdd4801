// Helpers of the certified-cache tests: f16-representable data, a float64 reference over the
// originals, and the check "bound >= actual error" for every (token, head) of one attend call.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cache/attn_f64.h"
#include "cache/cache_params.h"
#include "kvq/certified.h"
#include "kvq/f16.h"

namespace kvq::cert_test {

inline float f16r(float x) { return f16_to_f32(f32_to_f16(x)); }

// Gaussian data (mean `off[c]` per channel when given), rounded to f16 so that the originals the
// host tier keeps equal the inputs and the float64 reference is exact attention over them.
inline std::vector<float> gauss(std::mt19937& rng, size_t n, float sd, int hd = 1, const std::vector<float>& off = {}) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = f16r(nd(rng) + (off.empty() ? 0.f : off[i % hd]));
  return x;
}

inline kv_cache_params cert_params(int n_kv_head, int hd, int n_ctx, double tol, const std::string& tk = "certified",
                                   const std::string& tv = "certified") {
  kv_cache_params p = test::one_layer_params(tk, tv, hd, n_kv_head, n_ctx);
  p.certify = true;
  p.certify_tol = tol;
  p.certify_adapt = false;
  return p;
}

// One attend call's outcome against the float64 reference.
struct checked {
  std::vector<float> out;
  std::vector<double> ref;
  std::vector<double> err;  // per (t, h)
  std::vector<cert_step> steps;
  int violations = 0;
  double worst_ratio = 1e300;  // min bound / error over steps with error > 0
};

inline double l2(const float* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
  return std::sqrt(s);
}

// Appends nothing; attends queries q [n_tokens, n_head, hd] at pos0 over the cache holding k, v
// ([n_pos, n_kv_head, hd], layer 0) and checks bound >= ||out - ref|| for every step.
inline checked attend_and_check(kv_cache_certified& c, const std::vector<float>& k, const std::vector<float>& v,
                                const std::vector<float>& q, int pos0, int n_tokens, int n_head, float scale,
                                thread_pool& pool) {
  const auto& p = c.params();
  const int hd = p.head_dim;
  checked r;
  r.out.assign((size_t)n_tokens * n_head * hd, 0.f);
  c.attend(0, 0, pos0, n_tokens, n_head, q.data(), scale, r.out.data(), pool);
  r.steps = c.last_steps();
  r.ref = test::attend_f64(k, v, q.data(), p.n_kv_head, hd, pos0, n_tokens, n_head, scale);
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < n_head; ++h) {
      const size_t i = (size_t)t * n_head + h;
      const double e = l2(&r.out[i * hd], &r.ref[i * hd], hd);
      r.err.push_back(e);
      if (!(r.steps[i].bound >= e)) ++r.violations;
      if (e > 0) r.worst_ratio = std::min(r.worst_ratio, r.steps[i].bound / e);
    }
  return r;
}

inline double norm_of(const double* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += x[i] * x[i];
  return std::sqrt(s);
}

}  // namespace kvq::cert_test
