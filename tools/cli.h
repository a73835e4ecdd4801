// Shared pieces of the kvq command-line tool: subcommand registry and the KV-cache flags.
// Tools are thin: they parse flags, call the library, print.
#pragma once
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"

namespace kvq::cli {

// A subcommand: `setup` adds its options to `app` and returns the function that runs it
// (returning the process exit code).
struct command {
  std::string name;
  std::string help;
  std::function<std::function<int()>(CLI::App* app)> setup;
};

std::vector<command>& registry();
struct registrar {
  explicit registrar(command c) { registry().push_back(std::move(c)); }
};

// The KV-cache flags of a tool: the names as given and the other options bound to `p`. params()
// parses the names into kv_cache_params' enums (parse_kv_cache_type, parse_kv_rotation): the one
// place the CLI turns names into types; a tool calls it when it runs, so an unknown name is an
// "error: [kv_cache] unknown K cache type 'q5' ..." exit 2 like any other bad input.
struct kv_flags {
  kv_cache_params p;  // p.sink / p.exact_recent: -1 = auto (kv_auto_windows of the parsed types)
  std::string type_k = "f16", type_v = "f16", rotation = "auto";
  // The parsed params; auto windows resolved by kv_auto_windows, except the recent window when `gpu`
  // (the CUDA model runner keeps the exact sink but no exact recent window yet: auto is none there,
  // an explicit --kv-exact-recent N > 0 is refused).
  kv_cache_params params(bool gpu = false) const;
};

// --kv-sink / --kv-exact-recent (and its deprecated alias --kv-recent) into `sink` / `recent`: "auto"
// (the default, stored as -1) or N >= 0 positions. Errors during parsing (exit 2) name the option
// and value.
void add_kv_window_flags(CLI::App* app, int& sink, int& recent);
// p with its auto (-1) sink / exact_recent replaced by kv_auto_windows(p) (its types must be set).
kv_cache_params resolve_kv_windows(kv_cache_params p);

// --cache-type-k (-ctk), --cache-type-v (-ctv), --kv-rot, --kv-group, --kv-sink, --kv-exact-recent,
// --kv-kivi-group, --kv-residual, --kv-channel-scale, --kv-seed; certified attention: --kv-certify,
// --kv-tol, --kv-host-dir, --kv-certify-measure, --kv-certify-no-adapt, --kv-cert-budget.
void add_kv_flags(CLI::App* app, kv_flags& f);
// add_kv_flags for a command that compares several formats: `explicit_kv` becomes true when the
// user gives -ctk or -ctv (the command then runs just that pair instead of its format list).
void add_kv_flags(CLI::App* app, kv_flags& f, bool& explicit_kv);
// --device NAME of a command that runs a model (generate, perplexity, eval-passkey, server): the name as
// given, parsed by parse_compute_device when the command runs ("[device] unknown device ..." exit
// 2); the command then asks kv_flags::params(device == cuda) and the library refuses what the GPU
// does not run (cuda::check_supported) and a build or machine without a GPU (exit 2).
void add_device_flag(CLI::App* app, std::string& device);
// Validator of a float option: the value must be a finite float, so --temp inf, nan or 1e40 (beyond
// float's range: inf once parsed) exit 2 with "--temp: must be a finite number, got inf".
CLI::Validator finite_float();
// The same for a double option (--kv-tol, --kv-cert-budget): "--kv-tol: must be a finite number, got nan".
CLI::Validator finite_double();
// Validator of a number option's range, checked after finite_float / finite_double: the value must be
// >= lo (> lo when lo_open) and <= hi; "--min-p: must be in [0, 1], got 2", "--top-p: must be > 0, got 0"
// (hi = +inf: no upper bound). Exit 2 before the model loads, naming the flag the user typed.
CLI::Validator number_range(double lo, double hi, bool lo_open = false);
// Validator of a 64-bit integer option: "--seed: must be a 64-bit integer, in [-9223372036854775808,
// 9223372036854775807], got X" (CLI11's own message for a value beyond it says only "could not convert").
CLI::Validator int64_value();
// --json (one JSON object on stdout) and --no-progress, as the measuring commands take them.
void add_report_flags(CLI::App* app, bool& json, bool& no_progress);

// The progress callback of a long command (perplexity, eval-passkey): a bar on stderr, redrawn in
// place on a terminal, one line per ~10 % otherwise; `unit` names what is counted ("chunks").
// Empty (no output) when `enabled` is false.
std::function<void(int done, int total, int64_t tokens, double seconds)> progress_bar(bool enabled, const char* unit);

// A comma-separated list of token counts, "4k" meaning 4096 ("0,512,4k,32K"); empty items are
// skipped. Errors (invalid_input): "[op] what: 'x' is not an integer", a value above INT_MAX.
std::vector<int> parse_count_list(const std::string& s, const std::string& op, const char* what);

// Writes `text` to `path` atomically (temp file + rename), so a failure never leaves a
// half-written file. Throws kvq::error(io).
void write_file_atomic(const std::string& path, const std::string& text);

// JSON text of j for stdout and plot scripts; bytes that are not valid UTF-8 in its strings (a
// generated token that splits a character, a prompt or GGUF name in another encoding) become
// U+FFFD, as the Hugging Face and llama.cpp servers do, instead of failing the whole output.
inline std::string json_text(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Runs scripts/<script> (python3 + matplotlib) on a JSON document to draw `png` (tmp + rename:
// a failure leaves no PNG). Throws kvq::error(io). Defined in cmd_kv_error.cpp.
void run_plot_script(const std::string& script, const std::string& json_text, const std::string& png);
// Refuses, before a long run, a --plot path whose directory does not exist:
// "[op] --plot 'PNG': directory 'D' does not exist" (kvq::error(io)).
void check_plot_dir(const std::string& op, const std::string& png);

}  // namespace kvq::cli
