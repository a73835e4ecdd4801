// kvq bench: decode and prefill speed and KV memory of KV formats against context depth.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "certified_report.h"
#include "cli.h"
#include "kvq/bench.h"
#include "kvq/error.h"
#include "kvq/perplexity.h"
#include "kvq/tokenizer.h"

namespace kvq::cli {

void run_plot_script(const std::string& script, const std::string& json_text, const std::string& png);  // cmd_kv_error.cpp

namespace {

struct bench_opts {
  std::string model_path, shape, weights = "q8_0", text_path, types, depths = "0,512,4096", plot;
  int shape_layers = 0;
  bench_params p;
  kv_cache_params kv;
  bool json = false, no_progress = false, explicit_kv = false;
};

template <typename T>
std::vector<T> split(const std::string& s, const char* what) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, ',')) {
    if (t.empty()) continue;
    if constexpr (std::is_same_v<T, int>) {
      try {
        size_t used = 0;
        std::string v = t;
        int mul = 1;
        if (!v.empty() && (v.back() == 'k' || v.back() == 'K')) { mul = 1024; v.pop_back(); }
        const int x = std::stoi(v, &used);
        if (used != v.size()) throw std::invalid_argument(t);
        out.push_back(x * mul);
      } catch (const std::exception&) {
        fail_input(std::string("[bench] ") + what + ": '" + t + "' is not an integer");
      }
    } else {
      out.push_back(t);
    }
  }
  return out;
}

nlohmann::json to_json(const bench_opts& o, const bench_result& r) {
  nlohmann::json j;
  j["model"] = o.shape.empty() ? o.model_path : "synthetic:" + o.shape;
  j["model_desc"] = r.model_desc;
  if (!o.shape.empty()) j["weights"] = o.weights;
  j["fill"] = r.fill;
  j["n_threads"] = r.n_threads;
  j["n_ctx"] = r.n_ctx;
  j["n_decode"] = o.p.n_decode;
  j["n_prefill"] = o.p.n_prefill;
  j["rows"] = nlohmann::json::array();
  for (const auto& w : r.rows)
    j["rows"].push_back({{"type_k", w.type_k}, {"type_v", w.type_v}, {"describe", w.describe},
                         {"baseline_only", w.baseline_only}, {"depth", w.depth},
                         {"beyond_train_ctx", w.beyond_train_ctx}, {"fill_seconds", w.fill_seconds},
                         {"decode_tokens_per_s", w.decode_tokens_per_s},
                         {"decode_tokens_per_s_mean", w.decode_tokens_per_s_mean},
                         {"decode_ms_median", w.decode_ms_median}, {"decode_ms_min", w.decode_ms_min},
                         {"decode_ms_max", w.decode_ms_max}, {"prefill_tokens_per_s", w.prefill_tokens_per_s},
                         {"kv_bytes_used", w.kv_bytes_used}, {"kv_bytes_allocated", w.kv_bytes_allocated},
                         {"kv_bytes_per_token", w.kv_bytes_per_token},
                         {"decode_speedup_vs_f16", w.decode_speedup_vs_f16},
                         {"prefill_speedup_vs_f16", w.prefill_speedup_vs_f16},
                         {"kv_bytes_ratio_vs_f16", w.kv_bytes_ratio_vs_f16}});
  return j;
}

int run_bench(bench_opts& o) {
  if (o.model_path.empty() == o.shape.empty())
    fail_input("[bench] give exactly one of -m MODEL or --shape NAME");
  std::unique_ptr<model> m;
  std::vector<int32_t> ids;
  if (!o.shape.empty()) {
    ggml_type wt;
    if (o.weights == "f16") wt = ggml_type::f16;
    else if (o.weights == "q8_0") wt = ggml_type::q8_0;
    else if (o.weights == "q4_0") wt = ggml_type::q4_0;
    else fail_input("[bench] --weights '" + o.weights + "' must be f16, q8_0 or q4_0");
    const model_shape s = find_model_shape(o.shape);
    if (!o.no_progress)
      std::fprintf(stderr, "[kvq] writing a synthetic %s (%s weights%s) to a temporary GGUF...\n", s.name.c_str(),
                   o.weights.c_str(), o.shape_layers > 0 ? (", " + std::to_string(o.shape_layers) + " layers").c_str() : "");
    m = make_synthetic_model(s, wt, o.shape_layers, o.p.seed);
    if (!o.text_path.empty()) fail_input("[bench] -f TEXT needs a real model (-m): a synthetic model has no tokenizer");
  } else {
    m = model::load(o.model_path);
    if (!o.text_path.empty()) {
      auto tok = tokenizer::from_gguf(m->gguf());
      ids = perplexity_tokenize(*tok, read_text_file(o.text_path));
    }
  }
  std::vector<std::string> types = split<std::string>(o.types, "--types");
  if (o.explicit_kv) o.p.formats.push_back(o.kv);
  if (types.empty() && !o.explicit_kv) types = {"f16", "q8", "q4", "kivi2"};
  for (const auto& t : types) {
    kv_cache_params c = o.kv;
    c.type_k = c.type_v = t;
    o.p.formats.push_back(c);
  }
  o.p.depths = split<int>(o.depths, "--depths");
  bench_progress prog;
  if (!o.no_progress)
    prog = [tty = ::isatty(2)](const std::string& what) {
      std::fprintf(stderr, tty ? "\r\033[K[kvq] %s" : "[kvq] %s\n", what.c_str());
      std::fflush(stderr);
    };
  certified_collector certified;  // certified cache statistics (tools/certified_report.h)
  const bench_result r = bench(*m, ids, o.p, prog);
  if (!o.no_progress && ::isatty(2)) std::fprintf(stderr, "\r\033[K");
  nlohmann::json j = to_json(o, r);
  add_certified_json(j, certified.reports(), /*as_array=*/true);
  if (!o.plot.empty()) run_plot_script("plot_bench.py", j.dump(), o.plot);
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("model: %s%s\n", r.model_desc.c_str(), o.shape.empty() ? "" : (", " + o.weights + " weights").c_str());
  std::printf("threads %d, fill %s, %d decode steps (median), %d prefill tokens, cache n_ctx %d\n\n", r.n_threads,
              r.fill.c_str(), o.p.n_decode, o.p.n_prefill, r.n_ctx);
  std::printf("| %-11s | %6s | %12s | %6s | %12s | %6s | %10s | %7s |\n", "KV", "depth", "decode tok/s", "x f16",
              "prefill t/s", "x f16", "KV MiB", "f16/KV");
  std::printf("| %s | %s | %s | %s | %s | %s | %s | %s |\n", std::string(11, '-').c_str(), std::string(6, '-').c_str(),
              std::string(12, '-').c_str(), std::string(6, '-').c_str(), std::string(12, '-').c_str(),
              std::string(6, '-').c_str(), std::string(10, '-').c_str(), std::string(7, '-').c_str());
  for (const auto& w : r.rows) {
    const std::string name = (w.type_k == w.type_v ? w.type_k : w.type_k + "/" + w.type_v) +
                             (w.beyond_train_ctx ? "*" : "");
    std::printf("| %-11s | %6d | %12.2f | %6.2f | %12.1f | %6.2f | %10.2f | %7.2f |\n", name.c_str(), w.depth,
                w.decode_tokens_per_s, w.decode_speedup_vs_f16, w.prefill_tokens_per_s, w.prefill_speedup_vs_f16,
                w.kv_bytes_used / 1048576.0, w.kv_bytes_ratio_vs_f16);
  }
  bool beyond = false;
  for (const auto& w : r.rows) beyond = beyond || w.beyond_train_ctx;
  if (beyond) std::printf("\n* beyond the model's training context: speed only\n");
  if (!o.plot.empty()) std::printf("\nplot written to %s\n", o.plot.c_str());
  print_certified_reports(certified.reports());
  return 0;
}

const registrar reg{{"bench", "decode/prefill speed and KV memory of KV formats against context depth",
                     [](CLI::App* app) {
  auto o = std::make_shared<bench_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file");
  app->add_option("--shape", o->shape,
                  "synthetic random-weight model of a published shape: llama3-8b, llama3.2-1b, mistral-7b, "
                  "qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b");
  app->add_option("--shape-layers", o->shape_layers, "layers of the synthetic model (0: the shape's)")->capture_default_str();
  app->add_option("--weights", o->weights, "weight type of the synthetic model: f16, q8_0, q4_0")->capture_default_str();
  app->add_option("-f,--file", o->text_path, "text whose tokens feed fill/prefill/decode (default: pseudo-random ids)");
  app->add_option("--types", o->types, "comma-separated KV formats, each for K and V (default f16,q8,q4,kivi2)");
  app->add_option("--depths", o->depths, "comma-separated depths (tokens, 'k' = 1024)")->capture_default_str();
  app->add_option("-n,--n-decode", o->p.n_decode, "timed decode steps per format and depth")->capture_default_str();
  app->add_option("-p,--n-prefill", o->p.n_prefill, "timed prefill tokens per format and depth (0: skip)")->capture_default_str();
  app->add_option("-b,--batch-size", o->p.n_batch, "fill batch (tokens or synthetic rows per append)")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")->capture_default_str();
  app->add_option("--fill", o->p.fill, "real (prefill) or synthetic (append K/V with the model's statistics)")->capture_default_str();
  app->add_option("--seed", o->p.seed, "seed of the synthetic weights, K/V and token ids")->capture_default_str();
  app->add_option("--plot", o->plot, "write a PNG of decode tok/s and KV memory against depth");
  app->add_flag("--json", o->json, "print one JSON object");
  app->add_flag("--no-progress", o->no_progress, "no progress on stderr");
  add_kv_flags(app, o->kv);
  for (const char* name : {"--cache-type-k", "--cache-type-v"})
    app->get_option(name)->each([o](const std::string&) { o->explicit_kv = true; });
  return [o] { return run_bench(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
