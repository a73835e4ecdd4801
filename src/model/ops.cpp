#include "model/ops.h"

#include <cmath>

namespace kvq::ops {

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += (double)x[i] * x[i];
  const float r = (float)(1.0 / std::sqrt(ss / (double)n + (double)eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void geglu_tanh(const float* gate, const float* up, int64_t n, float* out) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(c * g * (1.0f + 0.044715f * g * g))) * up[i];
  }
}

void rope_angles(int n_rot, const float* inv_freq, int pos, float* cs) {
  for (int i = 0; i < n_rot / 2; ++i) {
    const float theta = (float)pos * inv_freq[i];
    cs[2 * i] = std::cos(theta);
    cs[2 * i + 1] = std::sin(theta);
  }
}

void rope_apply(float* x, int n_rot, const float* cs, bool neox) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

bool all_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

}  // namespace kvq::ops
