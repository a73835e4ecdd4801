// The GPU model path's own kernels (src/model_cuda/model_kernels.cu): everything of a llama block
// but the products (cuBLAS) and the attention (src/cuda). Row-major buffers, outermost first;
// f16 buffers are __half bits as uint16_t so that this header needs no CUDA types. Each launch
// checks its launch error (kvq::error(internal) "[cuda model] <kernel>: ...").
#pragma once
#include <cstddef>
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
// writes q [n][n_head][hd], k and v [n][n_kv_head][hd] in f16, and k32 / v32 (same shape) in f32
// when set (the K channel scale's input: a K of 210, Qwen2.5's bias, rounds to 0.125 in f16).
void qkv_rope(const float* qkv, const float* bias, const float* inv_freq, int n_rot, bool neox, const int32_t* pos, int n,
              int n_head, int n_kv_head, int hd, uint16_t* q, uint16_t* k, uint16_t* v, void* stream,
              float* k32 = nullptr, float* v32 = nullptr);

// The channel scale's calibration positions (docs/cuda.md): for each token t with pos[t] < n_stage,
// rows k[t], v[t] ([n][dkv] f32) go to stage_k / stage_v [n_seq][n_stage][dkv] f32 at
// (seq[t], pos[t]); seq, pos: device [n].
void stage_rows(const float* k, const float* v, const int32_t* seq, const int32_t* pos, int n, int n_stage, int dkv,
                float* stage_k, float* stage_v, void* stream);

// Exact attention of the tokens at positions below n_stage over their sequence's staging rows
// [0, pos[t]] (f32 K/V, f32 scores and softmax, as kv_cache_quant's attend of staged queries):
// out[t] [n_head][hd] f16 is written for those tokens only (the others keep the paged kernel's).
// q: [n][n_head][hd] f16 (unrotated, unscaled); stage_k / stage_v as stage_rows; scale = attn_scale.
// n_stage <= (max dynamic shared memory) / 4 - hd - 32 - min(8192, n_stage hd) (check_supported keeps it
// <= 8192: 65 KB at most); hd a multiple of 16, at most 256. The rows pass through shared memory
// in tiles (all loads of a tile in flight); each score and output takes the same operations in
// the same order whatever the tile size.
void staged_attention(const uint16_t* q, const float* stage_k, const float* stage_v, const int32_t* seq,
                      const int32_t* pos, int n, int n_stage, int n_head, int n_kv_head, int hd, float scale,
                      uint16_t* out, void* stream);

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
