// Small dense ops of the transformer block (f32, row-wise). Private to the model layer.
#pragma once
#include <cstdint>

namespace kvq::ops {

// out[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], for one row of n elements (out may alias x).
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out);

// SwiGLU (Shazeer 2020, arXiv:2002.05202, eq. 6): out[i] = silu(gate[i]) * up[i].
void swiglu(const float* gate, const float* up, int64_t n, float* out);

// GeGLU (Shazeer 2020, eq. 5) with the tanh approximation of GELU (Hendrycks & Gimpel 2016,
// arXiv:1606.08415, §2): out[i] = gelu_tanh(gate[i]) * up[i],
// gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
void geglu_tanh(const float* gate, const float* up, int64_t n, float* out);

// RoPE (Su et al. 2021, arXiv:2104.09864, §3.4) in two steps, so that a token's angles are computed
// once for all of its heads. rope_angles writes cs[2i] = cos(pos * inv_freq[i]) and
// cs[2i + 1] = sin(pos * inv_freq[i]) for i < n_rot/2; inv_freq[i] = freq_scale *
// base^(-2i/n_rot) (optionally / rope_freqs[i]). rope_apply rotates the first n_rot dims of one head
// vector x[head_dim] by them: neox pairs (i, i + n_rot/2), otherwise pairs (2i, 2i+1).
void rope_angles(int n_rot, const float* inv_freq, int pos, float* cs);
void rope_apply(float* x, int n_rot, const float* cs, bool neox);

// true when every x[i] is finite.
bool all_finite(const float* x, int64_t n);

}  // namespace kvq::ops
