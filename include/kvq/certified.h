// Certified attention: a tiered KV cache whose every (layer, head, step) attention output comes
// with a rigorous bound on its error against exact attention over the original (f16) K/V, and an
// exact fallback ladder when the bound exceeds a tolerance. Derivation and assumptions:
// docs/certified.md.
//
// Tiers (per layer, sequence, kv head):
//   fast tier  per-token compressed codes in a rotated basis (default int8 K + int4 V, Hadamard),
//              plus per token an upper bound ε of the reconstruction error norm of K and of V
//              (f16, rounded up), computed when the token is quantized;
//   host tier  the exact f16 originals of every token (in RAM, or in an unlinked file mmap'd in
//              kv_cache_params::host_dir, so it need not fit in RAM).
//
// Per query head and step, with computed scores ŝ_j (f32 rotated q · dequantized k̂_j, f64
// accumulation), p̂ = softmax(ŝ), ô = Σ p̂_j v̂_j, δ_j = scale ||q|| ε_kj (so |s_j - ŝ_j| <= δ_j),
// Z_lo = Σ p̂_i e^{-δ_i}:
//   ||o - ô|| <= 1/Z_lo Σ_j p̂_j [ (e^{δ_j} - 1) ||v̂_j - ô||  +  e^{δ_j} ε_vj ]  (+ rounding terms)
// split into a key term, a value term Σ p̂_j ε_vj, and their interaction. When the bound exceeds
// tol * ||ô||: (1) the tokens with the largest contributions are recomputed from the host tier and
// the output re-bounded; (2) if still over, the head is recomputed exactly from the host tier.
// (kvq issue 6. Rounding model and inner-product error bounds: Higham, "Accuracy and Stability of
// Numerical Algorithms", 2nd ed., §2.2 and §3.1.)
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq {

// ---- kernel views (STYLE.md habit 3) ------------------------------------------------------

// Rows [row_begin, next segment's row_begin) of one side of one kv head, all in one format
// (per_token or dense): row r has its codes at codes + (r - row_begin) * code_stride bytes and (per
// token) its kv_row_scale_count f16 scales at scales + (r - row_begin) * scale_stride. Rows are in
// the side's rotated basis, or (rotated == false) in the original basis: K rows are then scored
// with the unrotated query; V rows are rotated (f32) when read if any V row is in the rotated basis,
// else the whole V side is used in the original basis (no rotation, no rotation allowance).
struct cert_segment {
  int row_begin = 0;
  kv_format format = kv_format::f16;
  const uint8_t* codes = nullptr;
  int64_t code_stride = 0;
  const uint16_t* scales = nullptr;
  int64_t scale_stride = 0;
  int group = 0;  // per_token: elements per scale along head_dim
  bool rotated = true;
};

// One side (K or V) of the fast tier of one kv head. Rows are in the basis `rot` (orthonormal).
struct cert_side_view {
  const cert_segment* segs = nullptr;  // ascending row_begin, segs[0].row_begin == 0
  int n_segs = 0;
  // [n_pos] f16 ε_j (docs/certified.md): rotated rows ε_j >= ||R x_j - x̂_j|| (+ slack); rows in the
  // original basis ε_j >= ||x_j - x̂_j|| (the kernel adds the allowance of rotating a V row on read)
  const uint16_t* err = nullptr;
  const rotation* rot = nullptr;
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

// Bound on the f16 reconstruction error norm stored for a fast-tier row (docs/certified.md):
// x_rot = fl(R x) (f32, before the f16 rounding of the stored input), x_hat = the dequantized row,
// x_norm = ||x|| (original basis). Returns ε >= ||R x - x_hat|| + η (||x|| + ||x_hat||) + 1e-12 ||x_hat||
// as f16 rounded up (+inf when it exceeds 65504).
uint16_t cert_error_bound_f16(const float* x_rot, const float* x_hat, int head_dim, double x_norm, double eta);

// ---- the cache ------------------------------------------------------------------------------

// Bytes of each tier (all layers, sequences, heads).
struct certified_tier_bytes {
  size_t fast = 0, fast_used = 0;  // codes, scales and ε of the compressed tier (allocated / holding positions)
  size_t host = 0, host_used = 0;  // f16 originals (mapped / holding positions)
  size_t fast_used_peak = 0, host_used_peak = 0;  // largest fast_used / host_used after any append
  bool host_file_backed = false;   // host tier lives in a file under kv_cache_params::host_dir
};

// Cumulative statistics of every attend call. "Steps" are (layer, query head, query token).
struct certified_stats {
  uint64_t steps = 0, certified = 0, partial = 0, exact = 0;
  uint64_t tokens_recomputed = 0;  // host-tier rows read by stage 1
  double rel_bound_median = 0, rel_bound_p99 = 0;  // bound_fast / ||ô|| (log-histogram, ~4% bins)
  int heads_upgraded = 0;          // (layer, kv head, side) upgrades of the adaptive precision
  // measure mode only:
  uint64_t measured = 0;           // steps whose compressed output had a nonzero actual error
  double ratio_median = 0, ratio_p99 = 0, ratio_min = 0;  // bound_fast / error_fast
  uint64_t violations = 0;         // steps where a bound (fast or returned) < actual error: must be 0
};

// Everything a tool prints about one certified cache (kvq generate / perplexity / bench): a
// snapshot, copyable, independent of the cache's lifetime. Steps are (layer, query head, query
// token): a forward of T tokens through a model with n_layer layers and n_head query heads adds
// T * n_layer * n_head steps, and steps == certified + partial + exact.
struct certified_report {
  std::string type_k, type_v;  // as given in kv_cache_params ("certified", "q4", ...)
  std::string describe;        // describe() of the cache
  int n_layer = 0, n_kv_head = 0, head_dim = 0;
  double tol = 0;              // kv_cache_params::certify_tol
  bool measure = false;        // stats.ratio_* / measured / violations are meaningful
  certified_stats stats;
  certified_tier_bytes tiers;          // at the time of the report (peaks: over the cache's life)
  double fast_bytes_per_token = 0;     // fast tier, all layers, K + V + ε, at the formats new tokens get now
  double host_bytes_per_token = 0;     // host tier: n_layer * n_kv_head * 2 * head_dim * 2 bytes
  std::vector<std::string> upgrades;   // adaptive precision, in order: "layer 2 kv head 1 V q4->q8"
};

// The report as text lines (no trailing newline on the last), each starting with `prefix`:
// the cache, steps certified / partly / fully recomputed (counts and %), bound / ||output||,
// (measure) bound / actual error median and p99, tier bytes, upgrades.
std::string format_certified_report(const certified_report& r, const std::string& prefix = "");

// Per (layer, kv head): the precision new tokens are stored at and the bound history.
struct certified_head_info {
  int layer = 0, kv_head = 0;
  kv_format k_format = kv_format::q8, v_format = kv_format::q4;  // for new tokens
  uint64_t steps = 0, fallbacks = 0;  // fallbacks: partial + exact
  double mean_rel_bound = 0;          // mean of bound_fast / ||ô||
};

class kv_cache_certified : public kv_cache {
 public:
  virtual certified_tier_bytes tier_bytes() const = 0;
  virtual certified_stats certified_statistics() const = 0;
  virtual std::vector<certified_head_info> heads() const = 0;
  // The steps of the most recent attend or attend_batch call: [tokens of the batch, n_head], the
  // sequences' tokens in batch order (tests and diagnostics).
  virtual const std::vector<cert_step>& last_steps() const = 0;
  // Snapshot of the statistics, tier bytes and upgrades (see certified_report).
  virtual certified_report report() const = 0;
  // Multi-line human summary: format_certified_report(report()) with a final newline.
  virtual std::string summary() const = 0;
};

// True when p asks for a certified cache: type_k or type_v is "certified", or p.certify with at
// least one compressed side (certify on f16/f16 etc. is the plain dense cache).
bool is_certified(const kv_cache_params& p);

// The certified cache. Formats: "certified" on a side means its default (K q8, V q4); otherwise
// any per-token (q8..q2a) or dense (f32/f16/bf16) format. Rotation, group_size and seed as in the
// compressed cache. Errors (invalid_input unless noted): shapes as make_kv_cache; certify_tol
// negative or NaN; unsupported: KIVI formats, sink/recent windows, channel_scale; io: host_dir
// where no file can be created or mapped.
std::unique_ptr<kv_cache_certified> make_kv_cache_certified(const kv_cache_params& p);
// Asymptotic bytes per token of both tiers (all layers, K and V).
double kv_bytes_per_token_certified(const kv_cache_params& p);

// The certified interface of c, or nullptr when c is another cache.
const kv_cache_certified* as_certified(const kv_cache& c);

// Collects the report of every certified cache that make_kv_cache / make_kv_cache_certified
// creates, on any thread, while the collector exists. perplexity(), generate() and bench()
// create and destroy their caches inside the call; a tool wraps the call in a collector and
// prints reports() afterwards:
//   certified_collector col;
//   const perplexity_result r = perplexity(m, ids, bos, p);
//   for (const certified_report& c : col.reports()) ...
// Collectors may nest (each receives every cache). Thread safety: reports() snapshots a cache
// that is still alive through its report(), so call it while no collected cache is in attend /
// append on another thread (e.g. after the library call returned).
class certified_collector {
 public:
  certified_collector();
  ~certified_collector();
  certified_collector(const certified_collector&) = delete;
  certified_collector& operator=(const certified_collector&) = delete;
  // One report per cache, in creation order: a destroyed cache as it was when destroyed, a live
  // one as it is now. Caches that never stored a token (made only to validate params) are left out.
  std::vector<certified_report> reports() const;
  struct state;

 private:
  std::shared_ptr<state> state_;
};

}  // namespace kvq
