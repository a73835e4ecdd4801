// kvq: LLM inference with a compressed KV cache. Subcommands are registered by tools/cmd_*.cpp.
// Exit codes: 0 success, 2 bad input (flags, files, unsupported model/format), 1 internal error.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>

#include <unistd.h>

#include "cli.h"
#include "kvq/error.h"

namespace kvq::cli {

std::vector<command>& registry() {
  static std::vector<command> r;
  return r;
}

std::function<void(int, int, int64_t, double)> progress_bar(bool enabled, const char* unit) {
  if (!enabled) return {};
  const bool tty = ::isatty(2);
  auto last_decile = std::make_shared<int>(-1);
  return [tty, last_decile, unit](int done, int total, int64_t tokens, double s) {
    const double frac = (double)done / total;
    const int decile = (int)(frac * 10);
    if (!tty && decile == *last_decile && done != total) return;
    *last_decile = decile;
    const double tps = s > 0 ? tokens / s : 0;
    const double eta = done > 0 ? s * (total - done) / done : 0;
    const int width = 30, fill = (int)(frac * width);
    std::string bar(fill, '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "%s[%s] %d/%d %s, %.0f tok/s, ETA %.0fs%s", tty ? "\r" : "", bar.c_str(), done, total, unit,
                 tps, eta, tty ? (done == total ? "\n" : "") : "\n");
    std::fflush(stderr);
  };
}

kv_cache_params kv_flags::params(bool gpu) const {
  kv_cache_params c = p;
  c.type_k = parse_kv_cache_type(type_k, "K");
  c.type_v = parse_kv_cache_type(type_v, "V");
  c.rotation = parse_kv_rotation(rotation);
  // the GPU model runner keeps the exact sink (auto as on the CPU) but no exact recent window yet:
  // its auto is none there (an explicit --kv-exact-recent N > 0 is refused)
  if (gpu) c.exact_recent = std::max(c.exact_recent, 0);
  return resolve_kv_windows(c);
}

kv_cache_params resolve_kv_windows(kv_cache_params p) {
  const kv_windows w = kv_auto_windows(p);
  if (p.sink < 0) p.sink = w.sink;
  if (p.exact_recent < 0) p.exact_recent = w.exact_recent;
  return p;
}

void add_kv_window_flags(CLI::App* app, int& sink, int& recent) {
  sink = recent = -1;
  auto parse = [](const std::string& name, const std::string& v) {
    if (v == "auto") return -1;
    size_t used = 0;
    long long n = -1;
    try {
      n = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size() || n < 0 || n > std::numeric_limits<int>::max())
      throw CLI::ValidationError(name + " '" + v + "' must be auto or a number of positions >= 0");
    return (int)n;
  };
  app->add_option_function<std::string>(
         "--kv-sink", [&sink, parse](const std::string& v) { sink = parse("--kv-sink", v); },
         "first N tokens kept exact (f16); auto: " + std::to_string(kv_auto_sink) +
             " for per-token compressed formats (q8 .. q2a) unless a side is KIVI, else 0")
      ->default_str("auto");
  app->add_option_function<std::string>(
         "--kv-exact-recent", [&recent, parse](const std::string& v) { recent = parse("--kv-exact-recent", v); },
         "last N tokens kept exact (f16) beside the compressed body (storage; not sliding-window attention); auto: " +
             std::to_string(kv_auto_exact_recent) + " for per-token compressed formats unless a side is KIVI, else 0")
      ->default_str("auto");
  app->add_option_function<std::string>(
         "--kv-recent", [&recent, parse](const std::string& v) { recent = parse("--kv-recent", v); },
         "deprecated alias of --kv-exact-recent")
      ->group("");
}

void add_kv_flags(CLI::App* app, kv_flags& f) {
  kv_cache_params& p = f.p;
  const std::string types = [] {
    std::string s;
    for (const auto& t : kv_type_names()) s += (s.empty() ? "" : ", ") + t;
    return s;
  }();
  app->add_option("--cache-type-k", f.type_k, "KV cache type for K, alias -ctk (" + types + ")")->capture_default_str();
  app->add_option("--cache-type-v", f.type_v, "KV cache type for V, alias -ctv (" + types + ")")->capture_default_str();
  app->add_option("--kv-rot", f.rotation, "rotation before quantizing: none|hadamard|srht|srft|auto")->capture_default_str();
  app->add_option("--kv-group", p.group_size, "elements per scale along head_dim (0 = default: 32 or head_dim)")->capture_default_str();
  add_kv_window_flags(app, p.sink, p.exact_recent);
  app->add_option("--kv-kivi-group", p.kivi_group, "KIVI: tokens per per-channel K group")->capture_default_str();
  app->add_option("--kv-residual", p.kivi_residual, "KIVI: exact recent tokens kept before quantizing a group")->capture_default_str();
  app->add_flag("--kv-channel-scale", p.channel_scale, "calibrate a per-channel scale on the prompt before quantizing");
  app->add_option("--kv-channel-calib", p.channel_calib,
                  "positions the channel scale is calibrated on (kept exact until they have all arrived)")
      ->capture_default_str();
  app->add_option_function<std::string>(
         "--kv-k-channel-scale",
         [&p](const std::string& v) {
           try {
             p.k_channel_scale = parse_kv_switch(v, "--kv-k-channel-scale");
           } catch (const kvq::error& e) {  // during parsing: CLI11's error, exit 2
             throw CLI::ValidationError(e.what());
           }
         },
         "K only: centre and scale each channel by its mean and RMS over the first --kv-channel-calib positions: on|off|auto "
         "(auto: on for per-token K)")
      ->default_str("auto");
  app->add_option("--kv-seed", p.seed, "seed of the random signs of srht/srft")->capture_default_str();
  // certified attention (include/kvq/certified.h): -ctk certified -ctv certified, or --kv-certify
  app->add_flag("--kv-certify", p.certify, "certified attention on the chosen compressed formats (same as -ctk certified)");
  app->add_option("--kv-tol", p.certify_tol, "certified: recompute when the error bound > tol * ||output|| (0: exact)")
      ->capture_default_str()
      ->check(finite_double())
      ->check(number_range(0, INFINITY));
  app->add_option("--kv-host-dir", p.host_dir, "certified: keep the exact host tier in a file in this directory");
  app->add_flag("--kv-certify-measure", p.certify_measure, "certified: also compute exact attention (bound / actual error statistics)");
  app->add_flag_callback("--kv-certify-no-adapt", [&p] { p.certify_adapt = false; },
                         "certified: keep every head at its formats (no adaptive precision)");
  app->add_option("--kv-cert-budget", p.certify_budget,
                  "certified: fast-tier bytes/token at most this fraction of f16's (adaptive precision stays "
                  "within it; 0: no limit)")
      ->capture_default_str()
      ->check(finite_double())
      ->check(number_range(0, INFINITY));
}

void add_kv_flags(CLI::App* app, kv_flags& f, bool& explicit_kv) {
  add_kv_flags(app, f);
  for (const char* name : {"--cache-type-k", "--cache-type-v"})
    app->get_option(name)->each([&explicit_kv](const std::string&) { explicit_kv = true; });
}

void add_device_flag(CLI::App* app, std::string& device) {
  app->add_option("--device", device,
                  "where the model runs: cpu, or cuda (every layer on the GPU; f16, q8, q4 and kivi4 / q4a or kivi4 caches; llama / mistral / qwen2)")
      ->capture_default_str();
}

namespace {
template <typename T>
CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        T v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return "'" + s + "' is not a number";
        if (!std::isfinite(v)) {
          std::string lower = s;
          for (char& c : lower) c = (char)std::tolower((unsigned char)c);
          const bool spelled = lower.find("inf") != std::string::npos || lower.find("nan") != std::string::npos;
          return "must be a finite number, got " + s + (spelled ? "" : " (beyond the float range: inf)");
        }
        return {};
      },
      "FINITE");
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
}  // namespace

CLI::Validator finite_float() { return finite_number<float>(); }
CLI::Validator finite_double() { return finite_number<double>(); }

CLI::Validator number_range(double lo, double hi, bool lo_open) {
  // "[0, 1]" or ">= 0": the help's type column ("FLOAT:FINITE:[0, 1]") and the error's range
  const bool bounded = !std::isinf(hi);
  const std::string range = bounded ? std::string(lo_open ? "(" : "[") + number_text(lo) + ", " + number_text(hi) + "]"
                                    : std::string(lo_open ? "> " : ">= ") + number_text(lo);
  const std::string want = (bounded ? "in " : "") + range;
  return CLI::Validator(
      [lo, hi, lo_open, want](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return "'" + s + "' is not a number";
        if (lo_open ? !(v > lo) : !(v >= lo)) return "must be " + want + ", got " + s;
        if (!(v <= hi)) return "must be " + want + ", got " + s;
        return {};
      },
      range);
}

CLI::Validator int64_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (ec != std::errc() || end != s.data() + s.size())
          return "must be a 64-bit integer, in [-9223372036854775808, 9223372036854775807], got " + s;
        return {};
      },
      "INT64");
}

void add_report_flags(CLI::App* app, bool& json, bool& no_progress) {
  app->add_flag("--json", json, "print one JSON object");
  app->add_flag("--no-progress", no_progress, "no progress on stderr");
}

std::vector<int> parse_count_list(const std::string& s, const std::string& op, const char* what) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, ',')) {
    if (t.empty()) continue;
    try {
      size_t used = 0;
      std::string v = t;
      int mul = 1;
      if (!v.empty() && (v.back() == 'k' || v.back() == 'K')) { mul = 1024; v.pop_back(); }
      const long long x = std::stoll(v, &used);
      if (used != v.size() || v.empty()) throw std::invalid_argument(t);
      if (x * mul > std::numeric_limits<int>::max() || x * mul < std::numeric_limits<int>::min())
        fail_input("[" + op + "] " + what + " " + t + ": too large (at most " +
                   std::to_string(std::numeric_limits<int>::max()) + ")");
      out.push_back((int)(x * mul));
    } catch (const error&) {
      throw;
    } catch (const std::exception&) {
      fail_input("[" + op + "] " + what + ": '" + t + "' is not an integer");
    }
  }
  return out;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail(errc::io, "[io] cannot open '" + tmp + "' for writing");
    f.write(text.data(), (std::streamsize)text.size());
    if (!f) {
      std::remove(tmp.c_str());
      fail(errc::io, "[io] write to '" + tmp + "' failed");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail(errc::io, "[io] cannot rename '" + tmp + "' to '" + path + "'");
  }
}

}  // namespace kvq::cli

// llama.cpp spells some flags with one dash and several letters (-ctk); CLI11 reads "-ctk" as
// "-c tk", so these are rewritten to their long names before parsing.
static std::vector<std::string> rewrite_llama_style_flags(int argc, char** argv) {
  static const std::map<std::string, std::string> alias = {
      {"-ctk", "--cache-type-k"}, {"-ctv", "--cache-type-v"}, {"-np", "--parallel"}};
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const size_t eq = a.find('=');
    const auto it = alias.find(a.substr(0, eq));
    if (it != alias.end()) a = it->second + (eq == std::string::npos ? "" : a.substr(eq));
    args.push_back(a);
  }
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments reversed
  return args;
}

int main(int argc, char** argv) {
  using namespace kvq;
  CLI::App app{"kvq: LLM inference with a compressed KV cache", "kvq"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvq 0.1.0");
  std::map<std::string, std::function<int()>> runners;
  for (auto& c : cli::registry()) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    runners[c.name] = c.setup(sub);
  }
  if (argc > 1 && argv[1][0] != '-' && !runners.count(argv[1])) {
    std::string names;
    for (const auto& [name, run] : runners) names += (names.empty() ? "" : ", ") + name;
    std::fprintf(stderr, "error: unknown command '%s' (commands: %s)\n", argv[1], names.c_str());
    return 2;
  }
  try {
    auto args = rewrite_llama_style_flags(argc, argv);
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    for (auto* sub : app.get_subcommands()) return runners.at(sub->get_name())();
  } catch (const kvq::error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.code() == errc::internal ? 1 : 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: internal: %s\n", e.what());
    return 1;
  }
  return 0;
}
