// kvq info: architecture, shapes and KV bytes/token of every cache type.
#include <algorithm>
#include <cmath>
#include <map>
#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.h"
#include "kvq/attention.h"
#include "kvq/error.h"
#include "kvq/generate.h"
#include "kvq/gguf.h"
#include "kvq/model.h"

namespace kvq::cli {
namespace {

struct info_opts {
  std::string model_path;
  int n_ctx = 0;
  bool json = false;
  kv_cache_params kv;
  std::string rot = "auto";  // --kv-rot, parsed into kv.rotation when the command runs
};

int run_info(info_opts& o) {
  auto m = model::load(o.model_path);
  const model_hparams& hp = m->hparams();
  const int n_ctx = resolve_n_ctx(*m, o.n_ctx, "info");
  o.kv.rotation = parse_kv_rotation(o.rot);
  const kv_cache_params base = m->cache_params(n_ctx, o.kv);
  {  // the user's --kv-* options must be valid for a per-token format wherever the defaults are
    kv_cache_params plain = m->cache_params(n_ctx, kv_cache_params{}), mine = base;
    plain.type_k = plain.type_v = mine.type_k = mine.type_v = kv_cache_type::q8;
    mine = resolve_kv_windows(mine);
    bool plain_ok = true;
    try {
      kv_bytes_per_token(plain);
    } catch (const kvq::error&) {
      plain_ok = false;  // e.g. head_dim not a multiple of 8: every row says why
    }
    if (plain_ok) kv_bytes_per_token(mine);  // throws (exit 2) on a bad --kv-group/--kv-sink/...
  }
  kv_cache_params f16 = base;
  f16.type_k = f16.type_v = kv_cache_type::f16;
  f16 = resolve_kv_windows(f16);
  const double f16_bpt = kv_bytes_per_token(f16);

  kv_layer_kind_bytes kinds;  // layer counts of each kind
  for (int il = 0; il < base.n_layer; ++il) (kv_layer_window(base, il) > 0 ? kinds.n_windowed : kinds.n_global) += 1;
  // each kind's distinct RoPE bases (and the sliding layers' windows), in layer order
  std::vector<double> rope_global, rope_sliding;
  std::vector<int> windows;
  auto add_once = [](auto& v, auto x) {
    if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
  };
  for (int il = 0; il < base.n_layer; ++il) {
    const int w = kv_layer_window(base, il);
    const double rb = il < (int)hp.layers.size() ? hp.layers[il].rope_freq_base : hp.rope_freq_base;
    add_once(w > 0 ? rope_sliding : rope_global, rb);
    if (w > 0) add_once(windows, w);
  }
  // weight tensor types: name -> count, most frequent first
  std::map<std::string, int> type_count;
  for (const gguf_tensor_info& t : m->gguf().tensors()) type_count[ggml_type_name(t.type)] += 1;
  std::vector<std::pair<std::string, int>> types(type_count.begin(), type_count.end());
  std::stable_sort(types.begin(), types.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string& t : kv_type_names()) {
    kv_cache_params p = base;
    p.type_k = p.type_v = parse_kv_cache_type(t);
    p = resolve_kv_windows(p);
    nlohmann::json row{{"type", t}};
    try {
      const double bpt = kv_bytes_per_token(p);
      row["bytes_per_token"] = bpt;
      row["ratio_to_f16"] = f16_bpt / bpt;
      row["bytes_at_n_ctx"] = (int64_t)kv_bytes_at_ctx(p);  // allocated: exact windows included
      const kv_layer_kind_bytes lk = kv_bytes_by_layer_kind(p);  // global vs sliding-window layers
      row["bytes_global_layers"] = (int64_t)lk.global;
      row["bytes_window_layers"] = (int64_t)lk.windowed;
      row["attn_tier"] = kv_attn_tier(p);
    } catch (const kvq::error& e) {
      row["error"] = e.what();
    }
    rows.push_back(row);
  }
  if (o.json) {
    nlohmann::json j{{"model", o.model_path}, {"arch", hp.arch}, {"name", hp.name}, {"n_vocab", hp.n_vocab},
                     {"n_embd", hp.n_embd}, {"n_layer", hp.n_layer}, {"n_head", hp.n_head},
                     {"n_kv_head", hp.n_kv_head}, {"head_dim", hp.head_dim}, {"n_ff", hp.n_ff},
                     {"n_ctx_train", hp.n_ctx_train}, {"n_rot", hp.n_rot}, {"rope_freq_base", hp.rope_freq_base},
                     {"rope", hp.rope == rope_type::neox ? "neox" : "norm"}, {"rms_eps", hp.rms_eps},
                     {"attn_scale", hp.attn_scale}, {"tied_output", hp.tied_output}, {"n_params", hp.n_params},
                     {"n_ctx", n_ctx}, {"n_global_layers", kinds.n_global}, {"n_window_layers", kinds.n_windowed},
                     {"sliding_window", hp.sliding_window}, {"kv_types", rows}};
    j["layer_kinds"] = nlohmann::json::array();
    if (kinds.n_global > 0)
      j["layer_kinds"].push_back({{"kind", "global"}, {"n_layers", kinds.n_global}, {"rope_freq_base", rope_global}});
    if (kinds.n_windowed > 0)
      j["layer_kinds"].push_back({{"kind", "sliding"}, {"n_layers", kinds.n_windowed}, {"window", windows},
                                  {"rope_freq_base", rope_sliding}});
    // bytes_per_token counts the global layers; bytes_window_layers is the sliding layers' fixed ring at n_ctx
    j["bytes_per_token_layers"] = "global";
    j["tensor_types"] = nlohmann::json::object();
    for (const auto& [t, n] : types) j["tensor_types"][t] = n;
    std::printf("%s\n", json_text(j, 2).c_str());
    return 0;
  }
  std::printf("model        %s\n", o.model_path.c_str());
  std::printf("arch         %s%s%s\n", hp.arch.c_str(), hp.name.empty() ? "" : "  name: ", hp.name.c_str());
  std::printf("params       %lld\n", (long long)hp.n_params);
  std::printf("n_vocab %d  n_embd %d  n_layer %d  n_ff %d\n", hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_ff);
  std::printf("n_head %d  n_kv_head %d (GQA %d:1)  head_dim %d\n", hp.n_head, hp.n_kv_head, hp.n_head / hp.n_kv_head, hp.head_dim);
  std::printf("RoPE %s  n_rot %d  freq_base %g  freq_scale %g\n", hp.rope == rope_type::neox ? "neox" : "norm", hp.n_rot,
              hp.rope_freq_base, hp.rope_freq_scale);
  std::printf("rms_eps %g  attn_scale %g  output %s  n_ctx_train %d\n", hp.rms_eps, hp.attn_scale,
              hp.tied_output ? "tied" : "separate", hp.n_ctx_train);
  auto list = [](const auto& v) {
    std::string out;
    for (const auto& x : v) out += (out.empty() ? "" : ", ") + fmt::format("{}", x);
    return out;
  };
  std::printf("layers       %d global (RoPE base %s)", kinds.n_global, list(rope_global).c_str());
  if (kinds.n_windowed > 0)
    std::printf(", %d sliding-window (window %s tokens, RoPE base %s)", kinds.n_windowed, list(windows).c_str(),
                list(rope_sliding).c_str());
  std::printf("\n");
  std::string tl;
  for (const auto& [t, n] : types) tl += (tl.empty() ? "" : "  ") + t + ": " + std::to_string(n);
  std::printf("tensors      %s\n", tl.c_str());
  auto window = [](int n) { return n < 0 ? std::string("auto") : std::to_string(n); };
  std::printf("\nKV cache at n_ctx %d (K and V the same type; options: rot %s, group %d, exact sink %s, exact recent %s)\n",
              n_ctx, kv_rotation_name(base.rotation).c_str(), base.group_size, window(base.sink).c_str(),
              window(base.exact_recent).c_str());
  if (base.sink < 0 || base.exact_recent < 0)
    std::printf("auto windows: sink %d + recent %d exact positions for the per-token formats (q8 .. q2a), none for the others\n",
                kv_auto_sink, kv_auto_exact_recent);
  // bytes/token is asymptotic (compressed rows); bytes at n_ctx is what a cache of n_ctx positions
  // allocates, exact f16 rows of the sink/recent windows and KIVI residual included
  // with sliding-window layers: bytes/token counts the global layers only (the windowed ones hold
  // a fixed ring), and the bytes at n_ctx are split by layer kind
  const bool split = kinds.n_windowed > 0;
  if (split)
    std::printf("bytes/token counts the %d global layers only; the %d sliding-window layers hold a fixed ring of\n"
                "min(n_ctx, window - 1 + n_ubatch) positions each (last column, bytes at this n_ctx)\n",
                kinds.n_global, kinds.n_windowed);
  std::printf("%-10s %14s %10s %16s", "type", split ? "B/token global" : "bytes/token", "vs f16", "bytes at n_ctx");
  if (split) std::printf(" %16s %16s", "global layers", "sliding (fixed)");
  std::printf("  attention tier\n");
  for (const auto& r : rows) {
    if (r.contains("error")) {
      std::printf("%-10s %s\n", r["type"].get<std::string>().c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-10s %14.2f %9.2fx %16lld", r["type"].get<std::string>().c_str(), r["bytes_per_token"].get<double>(),
                r["ratio_to_f16"].get<double>(), (long long)r["bytes_at_n_ctx"].get<int64_t>());
    if (split)
      std::printf(" %16lld %16lld", (long long)r["bytes_global_layers"].get<int64_t>(),
                  (long long)r["bytes_window_layers"].get<int64_t>());
    std::printf("  %s\n", r["attn_tier"].get<std::string>().c_str());
  }
  return 0;
}

const registrar reg{{"info", "print the model's architecture, shapes and KV bytes/token per cache type", [](CLI::App* app) {
  auto o = std::make_shared<info_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file")->required();
  app->add_option("-c,--ctx-size", o->n_ctx, "context size for the totals (0: min(model, 4096))");
  app->add_flag("--json", o->json, "print JSON");
  app->add_option("--kv-rot", o->rot, "rotation (affects nothing in size)");
  app->add_option("--kv-group", o->kv.group_size, "group size along head_dim (0 = default)");
  add_kv_window_flags(app, o->kv.sink, o->kv.exact_recent);  // auto: per type (kv_auto_windows)
  return [o] { return run_info(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
