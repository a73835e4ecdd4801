// Certified attention, the kernel: attention of one kv head over a compressed tier with a
// rigorous bound on each output's error against exact attention over the original (f16) K/V, and
// an exact fallback ladder when the bound exceeds a tolerance. The tiered cache that stores the
// rows and feeds these views is in certified.h. Derivation and assumptions: docs/certified.md.
//
// Inputs (per kv head): the fast tier's per-token compressed rows in a rotated basis, with per
// token an upper bound ε of the reconstruction error norm of K and of V (f16, rounded up;
// cert_error_bound_f16); the host tier's exact f16 originals of every token.
//
// Per query head and step, with computed scores ŝ_j (f32 rotated q · dequantized k̂_j, f64
// accumulation), p̂ = softmax(ŝ), ô = Σ p̂_j v̂_j, δ_j = scale Σ_g ||q_g|| ε_{kj,g} over the error
// groups g of head_dim (so |s_j - ŝ_j| <= δ_j),
// Z_lo = Σ p̂_i e^{-δ_i}:
//   ||o - ô|| <= 1/Z_lo Σ_j p̂_j [ (e^{δ_j} - 1) ||v̂_j - ô||  +  e^{δ_j} ε_vj ]  (+ rounding terms)
// split into a key term, a value term Σ p̂_j ε_vj, and their interaction. When the bound exceeds
// tol * ||ô||: (1) the tokens with the largest contributions are recomputed from the host tier and
// the output re-bounded; (2) if still over, the head is recomputed exactly from the host tier.
// (kvq issue 6. Rounding model and inner-product error bounds: Higham, "Accuracy and Stability of
// Numerical Algorithms", 2nd ed., §2.2 and §3.1.) Implementation: src/kernels/attn_certified_ref.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvq/attention.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq {

// Kernel views (STYLE.md habit 3).

// Rows [row_begin, next segment's row_begin) of one side of one kv head, all in one format
// (per_token, per_channel or dense): row r has its codes at codes + (r - row_begin) * code_stride
// bytes; per token, its kv_row_scale_count f16 scales at scales + (r - row_begin) * scale_stride;
// per channel (KIVI K, K side only), the [head_dim] scales then [head_dim] zeros of its token group
// at scales + ((r - row_begin) / group) * scale_stride (groups counted from row_begin; the last one
// may be partial). Rows are in the side's rotated basis, or (rotated == false) in the original
// basis (dense and per-channel rows): K rows are then scored with the unrotated query; V rows are
// rotated (f32) when read if any V row is in the rotated basis, else the whole V side is used in
// the original basis (no rotation, no rotation allowance).
struct cert_segment {
  int row_begin = 0;
  kv_format format = kv_format::f16;
  const uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  const uint16_t* scales = nullptr;
  int64_t scale_stride = 0;
  int group = 0;  // per_token: elements per scale along head_dim; per_channel: tokens per group
  bool rotated = true;
  // per_channel, original basis only (rotated == false): the group's [head_dim] scales and zeros
  // are followed by [head_dim] f16 Δ_c >= max over its rows |x_c - x̂_c| (rounded up), and the
  // score error of its rows is also bounded per element, δ_j <= scale (Σ_c |q_c| Δ_c + 1e-12 ||q||
  // ||k̂_j||); the kernel takes the smaller of this and the per-group bound.
  bool chan_err = false;
};

// One side (K or V) of the fast tier of one kv head. Rows are in the basis `rot` (orthonormal).
struct cert_side_view {
  const cert_segment* segs = nullptr;  // ascending row_begin, segs[0].row_begin == 0
  int n_segs = 0;
  // [n_pos, err_groups] f16 ε_{j,g} (docs/certified.md), the error norm of row j over the elements
  // [g * head_dim / err_groups, (g + 1) * head_dim / err_groups) of its basis: rotated rows
  // ε_{j,g} >= ||(R x_j)_g - x̂_{j,g}|| (+ slack); rows in the original basis ε_{j,g} >=
  // ||x_{j,g} - x̂_{j,g}|| (the kernel adds the allowance of rotating a V row on read).
  // The score error of key j is bounded per group, δ_j = scale Σ_g ||q_g|| ε_{j,g} (<= the
  // Cauchy-Schwarz scale ||q|| ||ε_j||). V uses err_groups = 1 (its bound needs the row's norm).
  const uint16_t* err = nullptr;
  const rotation* rot = nullptr;
  int err_groups = 1;  // divides head_dim
};

// Exact f16 originals (original basis) of one kv head: row p of K at k + p * row_stride, V likewise.
struct cert_host_view {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  int64_t row_stride = 0;  // elements
};

struct cert_kv_view {
  cert_side_view k, v;
  cert_host_view host;
  int n_pos = 0;  // positions [0, n_pos) stored
  int head_dim = 0;
};

// The queries of the GQA group of one kv head. Query (t, g) is at q + t * stride_t + g * head_dim,
// sits at position pos0 + t and attends to spec.key_range(pos0 + t) (attention.h: scale, sliding
// window, logit soft-cap). q_rot holds the same queries rotated by the K rotation (same indexing);
// out uses the same indexing too. The soft-cap keeps the bound valid as it stands: c tanh(x / c) is
// 1-Lipschitz, so a score error δ stays at most δ after it.
struct cert_query_view {
  const float* q = nullptr;
  const float* q_rot = nullptr;
  int64_t stride_t = 0;
  int n_tokens = 0;
  int n_group = 0;
  int head_dim = 0;
  int pos0 = 0;
  attn_spec spec;
};

struct cert_options {
  double tol = 1e-2;              // certified when bound <= tol * ||output||; inf: always certified
  double stage1_fraction = 0.125; // stage 1 recomputes at most max(stage1_min, fraction * n) tokens
  int stage1_min = 8;
  bool measure = false;           // also compute exact attention: fills cert_step::error_*
};

// What happened to one (query head, step).
enum class cert_stage : uint8_t { certified, partial, exact, count };

struct cert_step {
  double bound_fast = 0;   // bound of the compressed-tier output (the sum of the three terms + rounding)
  double key_term = 0, value_term = 0, cross_term = 0;  // of bound_fast (before rounding slack)
  double norm_fast = 0;    // ||ô|| of the compressed-tier output
  double bound = 0;        // bound of the returned output (stage 2: its f32 rounding bound)
  double norm = 0;         // ||returned output||
  cert_stage stage = cert_stage::certified;
  int n_keys = 0;          // positions attended
  int n_recomputed = 0;    // tokens read from the host tier (stage 1: the chosen tokens; stage 2: all)
  // measure only (else -1): ||output - exact|| for the compressed-tier output and the returned one,
  // where exact = attention in float64 over the host tier with the f32 query.
  double error_fast = -1, error = -1;
};

// Certified attention of one kv head for a tile of queries: writes out (original basis, f32) and
// steps[t * n_group + g]. Scalar reference tier (f64 accumulation); allocation-free after warm-up
// (thread-local scratch). Requirements (checked by the cache): head_dim <= 1024, pos0 + n_tokens
// <= n_pos, per_token or dense segments.
void attn_certified_ref(const cert_kv_view& kv, const cert_query_view& q, const cert_options& opt,
                        float* out, cert_step* steps);

// Relative rounding allowance of one f32 application of `rot` (||fl(Rx) - Rx|| <= η ||x||):
// 0 for none; (16 ceil(log2 head_dim) + 32) * 2^-24 otherwise (docs/certified.md, "Rounding").
double rotation_rounding_bound(const rotation& rot);

// Bounds on the f16 reconstruction error norms stored for a fast-tier row (docs/certified.md,
// "Score error"): x_rot = fl(R x) (f32, before the f16 rounding of the stored input; x itself for
// rows kept in the original basis, with eta 0), x_hat = the dequantized row, x_norm = ||x||
// (original basis). With d = x_rot - x_hat and a = η (||x|| + ||x_hat|| + ||d||) + 1e-12 ||x_hat||,
// writes for each of the n_groups equal element groups g
//   out[g] >= (||d_g|| + a) (1 + 2η + 1e-7)
// as f16 rounded up (+inf when it exceeds 65504). n_groups divides head_dim.
void cert_error_bounds_f16(const float* x_rot, const float* x_hat, int head_dim, int n_groups, double x_norm,
                           double eta, uint16_t* out);
// The same for one group (the whole row): ε >= ||R x - x_hat|| + η (||x|| + ||x_hat||) + 1e-12 ||x_hat||.
uint16_t cert_error_bound_f16(const float* x_rot, const float* x_hat, int head_dim, double x_norm, double eta);
// Elements per error group of a certified K row (cert_side_view::err_groups = head_dim / this):
// 32 when it divides head_dim, else 8 when it does, else head_dim.
int cert_error_group(int head_dim);

}  // namespace kvq
