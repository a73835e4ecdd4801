// The --json objects of `kvq generate` and `kvq perplexity`, written once: the CLI prints them and
// the Python module returns them as dicts (kvq.Model.generate(details=True), Model.perplexity()).
// Header-only, like certified_report.h, so the module needs none of the CLI's libraries.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "certified_report.h"
#include "kvq/generate.h"
#include "kvq/perplexity.h"

namespace kvq::cli {

inline nlohmann::json generate_json(const std::string& model_path, const generate_params& p,
                                    const generate_result& r) {
  const double ratio = r.kv_bytes_per_token > 0 ? r.kv_bytes_per_token_f16 / r.kv_bytes_per_token : 0;
  nlohmann::json j{{"model", model_path},
                   {"prompt", p.prompt},
                   {"prompt_ids", r.prompt_ids},
                   {"ids", r.ids},
                   {"text", r.text},
                   {"stop_reason", r.stop_reason},
                   {"seed", r.seed},
                   {"n_ctx", r.n_ctx},
                   {"n_prompt", r.prompt_ids.size()},
                   {"n_generated", r.ids.size()},
                   {"prefill_seconds", r.prefill_seconds},
                   {"decode_seconds", r.decode_seconds},
                   {"prefill_tokens_per_s", r.prefill_tokens_per_s},
                   {"decode_tokens_per_s", r.decode_tokens_per_s},
                   {"kv_cache", r.kv_describe},
                   {"attn_tier", r.attn_tier},
                   {"kv_type_k", kv_cache_type_name(p.cache.type_k)},
                   {"kv_type_v", kv_cache_type_name(p.cache.type_v)},
                   {"kv_bytes_per_token", r.kv_bytes_per_token},
                   {"kv_bytes_per_token_f16", r.kv_bytes_per_token_f16},
                   {"kv_compression_vs_f16", ratio},
                   {"kv_bytes_allocated", r.kv_bytes},
                   {"kv_bytes_used", r.kv_bytes_used}};
  add_certified_json(j, r.certified);
  return j;
}

// Without the text file's name ("text"), which only the CLI has.
inline nlohmann::json perplexity_json(const std::string& model_path, const perplexity_params& p,
                                      const perplexity_result& r) {
  nlohmann::json j{{"model", model_path},
                   {"n_ctx", r.n_ctx},
                   {"n_batch", r.n_batch},
                   {"n_tokens", r.n_tokens},
                   {"n_chunk", r.n_chunk},
                   {"n_scored_per_chunk", r.n_scored_per_chunk},
                   {"n_scored", r.ppl.n_scored},
                   {"kv_type_k", kv_cache_type_name(p.cache.type_k)},
                   {"kv_type_v", kv_cache_type_name(p.cache.type_v)},
                   {"kv_cache", r.kv_describe},
                   {"attn_tier", r.attn_tier},
                   {"kv_bytes_per_token", r.kv_bytes_per_token},
                   {"kv_bytes_per_token_f16", r.kv_bytes_per_token_f16},
                   {"ppl", r.ppl.ppl},
                   {"ppl_err", r.ppl.ppl_err},
                   {"nll_mean", r.ppl.nll_mean},
                   {"ppl_running_per_chunk", r.chunk_ppl},  // as llama.cpp prints [1] .. [n]
                   {"seconds", r.seconds},
                   {"tokens_per_s", r.tokens_per_s}};
  if (!p.kl_base_out.empty())
    j["kl_base_out"] = {{"path", p.kl_base_out},
                        {"records", r.kl_base_records},
                        {"top_k", r.kl_base_top_k},
                        {"bytes", r.kl_base_bytes}};
  if (r.has_kld) {
    const kld_stats& k = r.kld;
    j["kld"] = {{"base", k.base_desc}, {"top_k", k.top_k}, {"n", k.n},
                {"mean", k.mean}, {"mean_err", k.mean_err}, {"median", k.median}, {"p90", k.p90},
                {"p99", k.p99}, {"p99_9", k.p99_9}, {"max", k.max}, {"min", k.min},
                {"same_top1_pct", k.same_top1_pct}, {"same_top1_err", k.same_top1_err},
                {"rms_dp_pct", k.rms_dp_pct}, {"rms_dp_err", k.rms_dp_err},
                {"ppl_base", k.ppl_base}, {"ppl_base_err", k.ppl_base_err},
                {"dppl_pct", k.dppl_pct}, {"dppl_err", k.dppl_err}};
  }
  add_certified_json(j, r.certified);
  return j;
}

}  // namespace kvq::cli
