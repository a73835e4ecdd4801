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
// set, rotates Q and K at positions pos0 + t by RoPE (Su et al. 2021, §3.4) over the first n_rot
// dims with theta_i = pos * inv_freq[i] (NORM pairs (2i, 2i+1), NEOX pairs (i, i + n_rot/2)), and
// writes q [n][n_head][hd], k and v [n][n_kv_head][hd] in f16.
void qkv_rope(const float* qkv, const float* bias, const float* inv_freq, int n_rot, bool neox, int pos0, int n,
              int n_head, int n_kv_head, int hd, uint16_t* q, uint16_t* k, uint16_t* v, void* stream);

// SwiGLU (Shazeer 2020, eq. 6): act[t][i] = f16(silu(gu[t][i]) * gu[t][F + i]). gu: [n][2F] f32.
void swiglu(const float* gu, int n, int F, uint16_t* act, void* stream);

}  // namespace kvq::cuda::mk
