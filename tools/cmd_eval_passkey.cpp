// kvq eval-passkey: passkey retrieval (needle in a haystack of real text) per context length and
// depth, for one KV-cache configuration (include/kvq/passkey.h).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvq/error.h"
#include "kvq/passkey.h"
#include "kvq/perplexity.h"

namespace kvq::cli {
namespace {

const char* kDefaultHaystack = "data/wikitext-2-raw-test/wiki.test.raw";

struct passkey_opts {
  std::string model_path, haystack, lengths = "4k", depths = "0,25,50,75,100", plot;
  passkey_params p;
  kv_flags kv;                 // p.cache, parsed when the command runs
  std::string device = "cpu";  // p.device, parsed when the command runs
  bool json = false, no_progress = false;
};

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

std::vector<double> parse_depths(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, ',')) {
    if (t.empty()) continue;
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != t.size() || used == 0) fail_input("[eval_passkey] --depths: '" + t + "' is not a number");
    out.push_back(d);
  }
  return out;
}

// -f, else $KVQ_DATA_DIR (default ../shared)/data/wikitext-2-raw-test/wiki.test.raw.
std::string haystack_path(const std::string& given) {
  if (!given.empty()) return given;
  const char* e = std::getenv("KVQ_DATA_DIR");
  const std::string dir = e && *e ? e : "../shared";
  const std::string p = dir + "/" + kDefaultHaystack;
  if (!std::filesystem::exists(p))
    fail_input("[eval_passkey] no haystack text: give one with -f FILE (the default '" + p +
               "' does not exist; set KVQ_DATA_DIR to the shared data directory)");
  return p;
}

nlohmann::json to_json(const passkey_opts& o, const passkey_result& r) {
  const passkey_params& p = o.p;
  nlohmann::json j{{"model", o.model_path},
                   {"haystack", r.haystack},
                   {"haystack_tokens", r.haystack_tokens},
                   {"lengths", p.lengths},
                   {"depths", p.depths},
                   {"trials_per_cell", p.trials},
                   {"seed", p.seed},
                   {"n_answer", p.n_answer},
                   {"n_batch", p.n_batch},
                   {"device", compute_device_name(p.device)},
                   {"kv_type_k", kv_cache_type_name(p.cache.type_k)},
                   {"kv_type_v", kv_cache_type_name(p.cache.type_v)},
                   {"kv_cache", r.kv_describe},
                   {"kv_bytes_per_token", r.kv_bytes_per_token},
                   {"kv_bytes_per_token_f16", r.kv_bytes_per_token_f16},
                   {"accuracy", r.accuracy},
                   {"seconds", r.seconds},
                   {"prefill_tokens_per_s", r.prefill_tokens_per_s}};
  j["cells"] = nlohmann::json::array();
  for (const passkey_cell& c : r.cells)
    j["cells"].push_back({{"length", c.length}, {"depth", c.depth}, {"n_trials", c.n_trials},
                          {"n_correct", c.n_correct}, {"accuracy", c.accuracy}});
  j["trials"] = nlohmann::json::array();
  for (const passkey_trial& t : r.trials)
    j["trials"].push_back({{"length", t.length}, {"depth", t.depth}, {"trial", t.trial}, {"key", t.key},
                           {"answer", t.answer}, {"correct", t.correct}, {"needle_pos", t.needle_pos},
                           {"n_prompt", t.n_prompt}, {"seconds", t.seconds}});
  return j;
}

void print_table(const passkey_opts& o, const passkey_result& r) {
  std::printf("model %s, KV cache %s (%.1f bytes/token, f16 %.1f)\n", o.model_path.c_str(), r.kv_describe.c_str(),
              r.kv_bytes_per_token, r.kv_bytes_per_token_f16);
  std::printf("haystack %s (%lld tokens), %d trial%s per cell, seed %llu\n", r.haystack.c_str(),
              (long long)r.haystack_tokens, o.p.trials, o.p.trials == 1 ? "" : "s", (unsigned long long)o.p.seed);
  std::printf("\npasskey accuracy %% (rows: context length in tokens, columns: depth %%)\n");
  std::printf("%8s", "length");
  for (double d : o.p.depths) std::printf(" %7s", num(d).c_str());
  std::printf(" %7s\n", "mean");
  for (int L : o.p.lengths) {
    std::printf("%8d", L);
    int n = 0, ok = 0;
    for (const passkey_cell& c : r.cells)
      if (c.length == L) {
        std::printf(" %7.1f", 100 * c.accuracy);
        n += c.n_trials;
        ok += c.n_correct;
      }
    std::printf(" %7.1f\n", n > 0 ? 100.0 * ok / n : 0.0);
  }
  std::printf("\noverall %.1f %% of %zu prompts, %.1f s (prefill %.0f tok/s)\n", 100 * r.accuracy, r.trials.size(),
              r.seconds, r.prefill_tokens_per_s);
  for (const passkey_trial& t : r.trials)
    if (!t.correct)
      std::printf("  miss: length %d depth %s trial %d: key %s, answer '%s'\n", t.length, num(t.depth).c_str(), t.trial,
                  t.key.c_str(), t.answer.c_str());
}

int run_passkey(passkey_opts& o) {
  o.p.device = parse_compute_device(o.device);
  o.p.cache = o.kv.params(o.p.device == compute_device::cuda);  // the GPU: no exact recent window yet
  o.p.lengths = parse_count_list(o.lengths, "eval_passkey", "--lengths");
  o.p.depths = parse_depths(o.depths);
  if (!o.plot.empty()) check_plot_dir("eval_passkey", o.plot);
  auto m = model::load(o.model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  passkey_check(*m, o.p);  // refuse bad flags before reading and tokenizing the haystack
  const std::string path = haystack_path(o.haystack);
  const passkey_text text = passkey_prepare(*tok, read_text_file(path, "eval_passkey"), path);
  if (!o.no_progress)
    std::fprintf(stderr, "[kvq] haystack %s: %zu tokens; %zu lengths x %zu depths x %d trials\n", path.c_str(),
                 text.haystack.size(), o.p.lengths.size(), o.p.depths.size(), o.p.trials);
  const passkey_result r = eval_passkey(*m, *tok, text, o.p, progress_bar(!o.no_progress, "prompts"));
  const nlohmann::json j = to_json(o, r);
  if (o.json) std::printf("%s\n", json_text(j).c_str());
  else print_table(o, r);
  if (!o.plot.empty()) run_plot_script("plot_passkey.py", json_text(j), o.plot);
  return 0;
}

const registrar reg{{"eval-passkey", "passkey retrieval (needle in a haystack of real text) per length and depth",
                     [](CLI::App* app) {
  auto o = std::make_shared<passkey_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file")->required();
  app->add_option("-f,--haystack", o->haystack,
                  std::string("haystack text file (default: $KVQ_DATA_DIR/") + kDefaultHaystack + ")");
  app->add_option("--lengths", o->lengths, "context lengths in tokens, prompt + answer (4k = 4096)")
      ->capture_default_str();
  app->add_option("--depths", o->depths, "needle depths, % of the haystack")->capture_default_str();
  app->add_option("--trials", o->p.trials, "prompts per (length, depth)")->capture_default_str();
  app->add_option("-s,--seed", o->p.seed, "seed of the keys and haystack excerpts")->capture_default_str();
  app->add_option("--answer-tokens", o->p.n_answer, "greedy answer tokens at most")->capture_default_str();
  app->add_option("-c,--ctx-size", o->p.n_ctx, "context limit (0: the model's training context)")
      ->capture_default_str();
  app->add_option("-b,--batch-size", o->p.n_batch, "prompt tokens per prefill pass")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")->capture_default_str()->check(CLI::Range(0, 1024));
  app->add_option("--plot", o->plot, "draw the accuracy heat map to this PNG (scripts/plot_passkey.py)");
  add_device_flag(app, o->device);
  add_report_flags(app, o->json, o->no_progress);
  add_kv_flags(app, o->kv);
  return [o] { return run_passkey(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
