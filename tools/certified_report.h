// Printing the certified-cache reports (include/kvq/certified.h) of kvq generate / perplexity /
// bench: stderr lines in text mode, a "certified" JSON object. The statistics come from the
// library (perplexity_result::certified, generate_result::certified, bench_result::certified);
// this header only formats them.
#pragma once
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvq/certified.h"

namespace kvq::cli {

// The report as text lines (no trailing newline on the last), each starting with `prefix`:
// the cache, steps certified / partly / fully recomputed (counts and %), bound / ||output||,
// (measure) bound / actual error median and p99, tier bytes, upgrades (the first 16).
inline std::string format_certified_report(const certified_report& r, const std::string& prefix = "") {
  const certified_stats& s = r.stats;
  const certified_tier_bytes& t = r.tiers;
  const double n = s.steps ? (double)s.steps : 1.0;
  char buf[1024];
  std::string out = prefix + r.describe + "\n";
  std::snprintf(buf, sizeof buf,
                "steps %llu (layer x query head x token): certified %llu (%.3f%%), partly recomputed %llu (%.3f%%, "
                "%.1f tokens each), fully recomputed %llu (%.3f%%)\n",
                (unsigned long long)s.steps, (unsigned long long)s.certified, 100.0 * s.certified / n,
                (unsigned long long)s.partial, 100.0 * s.partial / n,
                s.partial ? (double)s.tokens_recomputed / s.partial : 0.0, (unsigned long long)s.exact,
                100.0 * s.exact / n);
  out += prefix + buf;
  std::snprintf(buf, sizeof buf, "bound / ||output||: median %.3g, p99 %.3g; value term %.1f%% of the bound (mean)\n",
                s.rel_bound_median, s.rel_bound_p99, 100.0 * s.value_share_mean);
  out += prefix + buf;
  if (r.measure) {
    std::snprintf(buf, sizeof buf,
                  "bound / actual error: median %.3g, p99 %.3g, min %.3g (%llu steps with an error), violations %llu\n",
                  s.ratio_median, s.ratio_p99, s.ratio_min, (unsigned long long)s.measured,
                  (unsigned long long)s.violations);
    out += prefix + buf;
  }
  char share[160] = "";
  if (r.f16_bytes_per_token > 0) {
    const int k = std::snprintf(share, sizeof share, ", %.1f%% of f16's %.0f", 100.0 * r.fast_bytes_per_token / r.f16_bytes_per_token,
                                r.f16_bytes_per_token);
    if (r.budget > 0)
      std::snprintf(share + k, sizeof share - k, ", budget %.1f%%, %d upgrade(s) refused", 100.0 * r.budget,
                    s.upgrades_refused);
  }
  std::snprintf(buf, sizeof buf,
                "tiers: fast %.1f KiB used (peak %.1f, %.0f bytes/token%s), host %.1f KiB used (peak %.1f, %.0f "
                "bytes/token, %s)\n",
                t.fast_used / 1024.0, t.fast_used_peak / 1024.0, r.fast_bytes_per_token, share, t.host_used / 1024.0,
                t.host_used_peak / 1024.0, r.host_bytes_per_token, t.host_file_backed ? "file-backed" : "in RAM");
  out += prefix + buf;
  out += prefix + "adaptive precision: " + std::to_string(s.heads_upgraded) + " upgrade(s)";
  for (size_t i = 0; i < r.upgrades.size() && i < 16; ++i) out += (i ? ", " : ": ") + r.upgrades[i];
  if (r.upgrades.size() > 16) out += ", ...";
  return out;
}

inline nlohmann::json certified_json(const certified_report& r) {
  const certified_stats& s = r.stats;
  const double n = s.steps ? (double)s.steps : 1.0;
  nlohmann::json j{{"type_k", r.type_k}, {"type_v", r.type_v}, {"describe", r.describe}, {"tol", r.tol},
                   {"steps", s.steps}, {"certified", s.certified}, {"partial", s.partial}, {"exact", s.exact},
                   {"certified_pct", 100.0 * s.certified / n}, {"partial_pct", 100.0 * s.partial / n},
                   {"exact_pct", 100.0 * s.exact / n}, {"tokens_recomputed", s.tokens_recomputed},
                   {"rel_bound_median", s.rel_bound_median}, {"rel_bound_p99", s.rel_bound_p99},
                   {"value_share_mean", s.value_share_mean},
                   {"heads_upgraded", s.heads_upgraded}, {"upgrades", r.upgrades}, {"measure", r.measure}};
  if (r.measure) {
    j["measured"] = s.measured;
    j["ratio_median"] = s.ratio_median;
    j["ratio_p99"] = s.ratio_p99;
    j["ratio_min"] = s.ratio_min;
    j["violations"] = s.violations;
  }
  const certified_tier_bytes& t = r.tiers;
  j["tiers"] = {{"fast_bytes", t.fast}, {"fast_bytes_used", t.fast_used}, {"fast_bytes_used_peak", t.fast_used_peak},
                {"fast_bytes_per_token", r.fast_bytes_per_token}, {"host_bytes", t.host},
                {"host_bytes_used", t.host_used}, {"host_bytes_used_peak", t.host_used_peak},
                {"host_bytes_per_token", r.host_bytes_per_token}, {"host_file_backed", t.host_file_backed},
                {"f16_bytes_per_token", r.f16_bytes_per_token}, {"budget", r.budget},
                {"upgrades_refused", s.upgrades_refused}};
  return j;
}

// Adds the reports to a tool's JSON: "certified" is the object of the first certified cache
// created (perplexity/generate: the cache under test; perplexity --compare certified adds the
// second to "certified_others"); with as_array (bench: one cache per format) "certified" is the
// array of all of them. Nothing is added when there is none.
inline void add_certified_json(nlohmann::json& j, const std::vector<certified_report>& rs, bool as_array = false) {
  if (rs.empty()) return;
  if (as_array) {
    j["certified"] = nlohmann::json::array();
    for (const auto& r : rs) j["certified"].push_back(certified_json(r));
    return;
  }
  j["certified"] = certified_json(rs[0]);
  for (size_t i = 1; i < rs.size(); ++i) j["certified_others"].push_back(certified_json(rs[i]));
}

// "[kvq] certified ..." lines on stderr, one block per cache.
inline void print_certified_reports(const std::vector<certified_report>& rs) {
  for (const auto& r : rs) std::fprintf(stderr, "%s\n", format_certified_report(r, "[kvq] ").c_str());
}

}  // namespace kvq::cli
