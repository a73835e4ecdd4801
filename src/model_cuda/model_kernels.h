// The GPU model path's own kernels (src/model_cuda/model_kernels.cu): everything of a llama block
// but the products (cuBLAS) and the attention (src/cuda). Row-major buffers, outermost first;
// f16 buffers are __half bits as uint16_t so that this header needs no CUDA types. Each launch
// checks its launch error (kvq::error(internal) "[cuda model] <kernel>: ...").
#pragma once
#include <cstdint>

namespace kvq::cuda::mk {

// x[t] = f32(emb[tokens[t]]). tokens: [n] (validated by the caller), emb: [n_vocab][E] f16, x: [n][E].
void embed(const int32_t* tokens, const uint16_t* emb, int n, int E, float* x, void* stream);

// For r < n_rows, row i = rows ? rows[r] : r: x[i] += add[i] when add is set, then
// h[r] = f16(x[i] * rsqrt(mean(x[i]^2) + eps) * w) (RMSNorm, Zhang & Sennrich 2019).
// x, add: [*][E] f32; w: [E] f32; h: [n_rows][E] f16.
void add_rmsnorm(float* x, const float* add, const float* w, const int32_t* rows, int n_rows, int E, float eps,
                 uint16_t* h, void* stream);

// Splits qkv [n][n_head*hd + 2*n_kv_head*hd] f32 (Q, K, V products), adds bias [same width] when
// set, rotates Q and K at positions pos[t] (device [n]) by RoPE (Su et al. 2021, §3.4) over the first n_rot
// dims with theta_i = pos * inv_freq[i] (NORM pairs (2i, 2i+1), NEOX pairs (i, i + n_rot/2)), and
// writes q [n][n_head][hd], k and v [n][n_kv_head][hd] in f16.
void qkv_rope(const float* qkv, const float* bias, const float* inv_freq, int n_rot, bool neox, const int32_t* pos, int n,
              int n_head, int n_kv_head, int hd, uint16_t* q, uint16_t* k, uint16_t* v, void* stream);

// SwiGLU (Shazeer 2020, eq. 6): act[t][i] = f16(silu(gu[t][i]) * gu[t][F + i]). gu: [n][2F] f32.
void swiglu(const float* gu, int n, int F, uint16_t* act, void* stream);

// Greedy sampling on the device: out[r] = the first index of the largest of logits[r][0, V), or -1
// when the row holds a NaN or an infinity. logits: [n][V] f32.
void argmax_rows(const float* logits, int n, int V, int32_t* out, void* stream);

// Random values for benchmarks (a counter-based hash of (seed, index), splitmix64): x[i] =
// f16(uniform in [-a, a]) for i < n.
void fill_uniform_f16(uint16_t* x, int64_t n, float a, uint64_t seed, void* stream);
// The same in f32, uniform in [lo, hi].
void fill_uniform_f32(float* x, int64_t n, float lo, float hi, uint64_t seed, void* stream);

}  // namespace kvq::cuda::mk
