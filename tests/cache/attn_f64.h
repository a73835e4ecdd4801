// Test helper: causal GQA attention in float64 over f32 K/V laid out [n_pos, n_kv_head, head_dim].
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

namespace kvq::test {

// out[t, h, :] = softmax_j(softcap(scale q·k_j)) v_j over j <= pos0 + t, and with a sliding window
// W > 0 over j > pos0 + t - W only; softcap c > 0: x -> c tanh(x / c).
inline std::vector<double> attend_f64(const std::vector<float>& k, const std::vector<float>& v, const float* q,
                                      int n_kv_head, int hd, int pos0, int n_tokens, int n_head, float scale,
                                      int window = 0, float softcap = 0.0f) {
  std::vector<double> out((size_t)n_tokens * n_head * hd, 0.0);
  const int grp = n_head / n_kv_head;
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < n_head; ++h) {
      const int hk = h / grp, n = pos0 + t + 1, j0 = window > 0 ? std::max(0, n - window) : 0;
      std::vector<double> s(n);
      double mx = -1e300;
      for (int j = j0; j < n; ++j) {
        double a = 0;
        for (int i = 0; i < hd; ++i)
          a += (double)q[((size_t)t * n_head + h) * hd + i] * k[((size_t)j * n_kv_head + hk) * hd + i];
        s[j] = a * scale;
        if (softcap > 0) s[j] = softcap * std::tanh(s[j] / softcap);
        mx = std::max(mx, s[j]);
      }
      double den = 0;
      for (int j = j0; j < n; ++j) den += (s[j] = std::exp(s[j] - mx));
      for (int j = j0; j < n; ++j)
        for (int i = 0; i < hd; ++i)
          out[((size_t)t * n_head + h) * hd + i] += s[j] / den * v[((size_t)j * n_kv_head + hk) * hd + i];
    }
  return out;
}

// max |a - b| / max(max |b|, floor): the relative error used by every attention test.
template <class A, class B>
double rel_err(const A& a, const B& b, double floor = 1e-30) {
  double e = 0, m = floor;
  for (size_t i = 0; i < a.size(); ++i) {
    e = std::max(e, std::abs((double)a[i] - (double)b[i]));
    m = std::max(m, std::abs((double)b[i]));
  }
  return e / m;
}

}  // namespace kvq::test
