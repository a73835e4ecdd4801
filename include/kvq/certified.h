// Certified attention, the cache: a tiered KV cache whose every (layer, head, step) attention
// output comes with a rigorous bound on its error against exact attention over the original (f16)
// K/V, and an exact fallback ladder when the bound exceeds a tolerance. The bound, the ladder and
// the kernel views are in attn_certified.h; derivation and assumptions: docs/certified.md.
//
// Tiers (per layer, sequence, kv head):
//   fast tier  compressed codes: per-token in a rotated basis (default int8 K + int4 V, Hadamard),
//              or for K per-channel as KIVI (kivi4 / kivi2 / kivi8: unrotated, groups of
//              kivi_group tokens, the rows of the unfinished group kept as f16 copies); plus per
//              token upper bounds ε of the reconstruction error norm of K per group of 32 elements
//              and of V (f16, rounded up), computed when the token (or its K group) is quantized;
//   host tier  the exact f16 originals of every token (in RAM, or in an unlinked file mmap'd in
//              kv_cache_params::host_dir, so it need not fit in RAM).
// (kvq issue 6.) Implementation: src/cache/kv_cache_certified.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/attn_certified.h"
#include "kvq/kv_cache.h"
#include "kvq/quant.h"

namespace kvq {

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
  int upgrades_refused = 0;        // upgrades the byte budget refused (kv_cache_params::certify_budget)
  // the value term's share of the fast tier's bound, value / (key + cross + value) (docs/certified.md
  // "Output error"), averaged over the steps with a nonzero bound: what a tighter value term could gain
  double value_share_mean = 0;
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
  double f16_bytes_per_token = 0;      // the f16 cache's, same shape (the budget's unit)
  double budget = 0;                   // kv_cache_params::certify_budget (0: no limit)
  double host_bytes_per_token = 0;     // host tier: n_layer * n_kv_head * 2 * head_dim * 2 bytes
  std::vector<std::string> upgrades;   // adaptive precision, in order: "layer 2 kv head 1 V q4->q8"
};

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
};

// True when p asks for a certified cache: type_k or type_v is "certified", or p.certify with at
// least one compressed side (certify on f16/f16 etc. is the plain dense cache).
bool is_certified(const kv_cache_params& p);

// The certified cache. Formats: "certified" on a side means its default (K q8, V q4); otherwise
// any per-token (q8..q2a) or dense (f32/f16/bf16) format, and on K a per-channel KIVI format
// (kivi8/4/2; on V a KIVI type means its per-token kivi_v, q8a/q4a/q2a). Rotation, group_size,
// kivi_group and seed as in the compressed cache (auto rotation: Hadamard on per-token sides, none
// on per-channel K). Errors (invalid_input unless noted): shapes as make_kv_cache; certify_tol
// negative or NaN; certify_budget negative, or below the base formats' fast-tier bytes; unsupported:
// sink/recent windows, channel_scale, k_channel_scale on; io: host_dir where no file can be created
// or mapped.
std::unique_ptr<kv_cache_certified> make_kv_cache_certified(const kv_cache_params& p);
// Asymptotic bytes per token of both tiers (all layers, K and V; per-channel K with its share of
// the group scales; the up to kivi_group - 1 f16 rows of an unfinished K group are not included).
double kv_bytes_per_token_certified(const kv_cache_params& p);

// The certified interface of c, or nullptr when c is another cache.
const kv_cache_certified* as_certified(const kv_cache& c);

// Appends c's report() to out when c is a certified cache that has stored a token; a cache that
// never stored one (made only to validate params) adds nothing. perplexity(), generate() and
// bench() call it for each cache they create, in creation order, just before the cache is
// destroyed, and return the reports in their results (perplexity_result::certified, ...), which
// the tools print (tools/certified_report.h).
void append_certified_report(const kv_cache& c, std::vector<certified_report>& out);

}  // namespace kvq
