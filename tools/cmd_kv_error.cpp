// kvq kv-error: attention-output error and attention-probability TV of KV formats on real Q/K/V.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvq/error.h"
#include "kvq/kv_error.h"
#include "kvq/perplexity.h"
#include "kvq/tokenizer.h"

namespace kvq::cli {

// Runs scripts/<script> (python3 + matplotlib) on a JSON document to draw `png`. The script is
// looked up in $KVQ_SCRIPTS_DIR, then in scripts/ of the directories above the kvq binary, then in
// scripts/ of the source tree the binary was built from (a build folder outside the tree); the
// interpreter is $KVQ_PYTHON, else /usr/bin/python3 (Debian's, which has python3-matplotlib),
// else python3 on PATH. The PNG is drawn to a temp name and renamed, so a failure leaves none.
// Shared with cmd_bench.cpp (declared in cli.h).
void run_plot_script(const std::string& script, const std::string& json_text, const std::string& png) {
  namespace fs = std::filesystem;
  std::string dir;
  if (const char* e = std::getenv("KVQ_SCRIPTS_DIR"); e && *e) dir = e;
  if (dir.empty()) {
    std::error_code ec;
    fs::path p = fs::read_symlink("/proc/self/exe", ec).parent_path();
    for (int up = 0; up < 5 && !p.empty(); ++up, p = p.parent_path())
      if (fs::exists(p / "scripts" / script)) { dir = (p / "scripts").string(); break; }
  }
#ifdef KVQ_SOURCE_SCRIPTS_DIR
  if (dir.empty() && fs::exists(fs::path(KVQ_SOURCE_SCRIPTS_DIR) / script)) dir = KVQ_SOURCE_SCRIPTS_DIR;
#endif
  if (dir.empty() || !fs::exists(fs::path(dir) / script))
    fail(errc::io, "[plot] cannot find scripts/" + script + " (set KVQ_SCRIPTS_DIR to the repository's scripts/)");
  std::string py = "python3";
  if (const char* e = std::getenv("KVQ_PYTHON"); e && *e) py = e;
  else if (fs::exists("/usr/bin/python3")) py = "/usr/bin/python3";
  const std::string tmp_json = png + ".tmp.json", tmp_png = png + ".tmp.png";
  write_file_atomic(tmp_json, json_text);
  const std::string cmd = "'" + py + "' '" + (fs::path(dir) / script).string() + "' '" + tmp_json + "' '" + tmp_png + "'";
  const int rc = std::system(cmd.c_str());
  std::remove(tmp_json.c_str());
  if (rc != 0 || !fs::exists(tmp_png)) {
    std::remove(tmp_png.c_str());
    fail(errc::io, "[plot] " + script + " failed (exit " + std::to_string(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1) +
                       "); is python3-matplotlib installed?");
  }
  if (std::rename(tmp_png.c_str(), png.c_str()) != 0) {
    std::remove(tmp_png.c_str());
    fail(errc::io, "[plot] cannot write '" + png + "'");
  }
}

void check_plot_dir(const std::string& op, const std::string& png) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(png).parent_path();
  std::error_code ec;
  if (!dir.empty() && !fs::is_directory(dir, ec))
    fail(errc::io, "[" + op + "] --plot '" + png + "': directory '" + dir.string() + "' does not exist");
}

namespace {

struct kv_error_opts {
  std::string model_path, text_path, types, plot;
  kv_error_params p;
  kv_flags kv;
  bool json = false, no_tv = false, no_progress = false;
  bool explicit_kv = false;
};

std::string fmt_sci(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3e", v);
  return b;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, ','))
    if (!t.empty()) out.push_back(t);
  return out;
}

nlohmann::json to_json(const kv_error_opts& o, const kv_error_result& r) {
  nlohmann::json j{{"model", o.model_path},   {"text", o.text_path},   {"n_layer", r.n_layer},
                   {"n_head", r.n_head},        {"n_kv_head", r.n_kv_head}, {"head_dim", r.head_dim},
                   {"n_ctx", r.n_ctx},          {"n_chunk", r.n_chunk},   {"n_queries", r.n_queries},
                   {"tv", r.has_tv},            {"seconds", r.seconds},   {"formats", nlohmann::json::array()}};
  for (const auto& f : r.formats) {
    nlohmann::json w = nlohmann::json::array();
    for (const auto& h : f.worst) {
      nlohmann::json e = {{"layer", h.il}, {"head", h.head}, {"rel_err", h.rel_err}};
      if (r.has_tv) e["tv"] = h.tv;
      w.push_back(e);
    }
    nlohmann::json e = {{"type_k", f.type_k}, {"type_v", f.type_v}, {"describe", f.describe},
                        {"bytes_per_token", f.bytes_per_token}, {"ratio_vs_f16", f.ratio_vs_f16},
                        {"mean_rel_err", f.mean_rel_err}, {"max_rel_err", f.max_rel_err},
                        {"layer_rel_err", f.layer_rel_err}, {"rel_err", f.rel_err}, {"worst", w}};
    if (r.has_tv) {  // without --no-tv only: absent rather than a misleading 0
      e["mean_tv"] = f.mean_tv;
      e["max_tv"] = f.max_tv;
      e["layer_tv"] = f.layer_tv;
      e["tv_per_head"] = f.tv;
    }
    j["formats"].push_back(e);
  }
  return j;
}

int run_kv_error(kv_error_opts& o) {
  if (!o.plot.empty()) check_plot_dir("kv_error", o.plot);  // before the run, not after it
  auto m = model::load(o.model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  std::vector<std::string> types = split_list(o.types);
  if (o.types == "all" || (types.empty() && !o.explicit_kv)) {
    types.clear();
    for (const auto& t : kv_type_names())
      if (t != "f32") types.push_back(t);
  }
  if (types.empty()) {
    o.p.formats.push_back(o.kv.params());
  } else {
    for (const auto& t : types) {
      kv_cache_params c = o.kv.p;
      c.rotation = parse_kv_rotation(o.kv.rotation);
      c.type_k = c.type_v = parse_kv_cache_type(t);
      o.p.formats.push_back(resolve_kv_windows(c));  // auto windows per type
    }
  }
  o.p.tv = !o.no_tv;
  if (o.p.n_ctx == 0) o.p.n_ctx = std::min(512, m->hparams().n_ctx_train);
  kv_error_check(*m, o.p);  // refuse bad flags before reading and tokenizing the text
  const auto ids = perplexity_tokenize(*tok, read_text_file(o.text_path, "kv_error"), "kv_error");
  kv_error_progress prog;
  if (!o.no_progress)
    prog = [tty = ::isatty(2)](int done, int total) {
      if (tty) std::fprintf(stderr, "\r[kvq] kv-error replay %d/%d%s", done, total, done == total ? "\n" : "");
      else if (done == total) std::fprintf(stderr, "[kvq] kv-error replay %d/%d\n", done, total);
    };
  const kv_error_result r = kv_error(*m, ids, perplexity_bos(*tok), o.p, prog);
  const nlohmann::json j = to_json(o, r);
  if (!o.plot.empty()) run_plot_script("plot_kv_error.py", json_text(j), o.plot);
  if (o.json) {
    std::printf("%s\n", json_text(j).c_str());
    return 0;
  }
  std::printf("model %s: %d layers x %d heads (%d kv heads, head_dim %d); %d chunk(s) of %d tokens, %lld queries/head\n",
              o.model_path.c_str(), r.n_layer, r.n_head, r.n_kv_head, r.head_dim, r.n_chunk, r.n_ctx,
              (long long)r.n_queries);
  std::printf("attention-output relative error%s vs an f32 cache\n\n",
              r.has_tv ? " and attention-probability TV distance" : " (TV distance not computed: --no-tv)");
  // Column widths from the longest names: nothing is cut.
  auto short_name = [](const kv_error_format& f) { return f.type_k == f.type_v ? f.type_k : f.type_k + "/" + f.type_v; };
  int wd = 6, ws = 10;
  for (const auto& f : r.formats) {
    wd = std::max(wd, (int)f.describe.size());
    ws = std::max(ws, (int)short_name(f).size());
  }
  auto tv_cell = [&](double v) { return r.has_tv ? fmt_sci(v) : std::string("-"); };
  std::printf("%-*s %9s %6s %11s %11s %10s %10s\n", wd, "format", "B/token", "x f16", "mean relerr", "max relerr",
              "mean TV", "max TV");
  for (const auto& f : r.formats)
    std::printf("%-*s %9.1f %6.2f %11.3e %11.3e %10s %10s\n", wd, f.describe.c_str(), f.bytes_per_token,
                f.ratio_vs_f16, f.mean_rel_err, f.max_rel_err, tv_cell(f.mean_tv).c_str(), tv_cell(f.max_tv).c_str());
  std::printf("\nper layer, mean relative error over heads\n%-6s", "layer");
  for (const auto& f : r.formats) std::printf(" %*s", ws, short_name(f).c_str());
  std::printf("\n");
  for (int il = 0; il < r.n_layer; ++il) {
    std::printf("%-6d", il);
    for (const auto& f : r.formats) std::printf(" %*.3e", ws, f.layer_rel_err[il]);
    std::printf("\n");
  }
  std::printf("\nworst heads (layer:head relerr%s)\n", r.has_tv ? "/TV" : "");
  for (const auto& f : r.formats) {
    std::printf("%-*s", ws, short_name(f).c_str());
    for (const auto& h : f.worst) {
      if (r.has_tv) std::printf("  %d:%d %.2e/%.2e", h.il, h.head, h.rel_err, h.tv);
      else std::printf("  %d:%d %.2e", h.il, h.head, h.rel_err);
    }
    std::printf("\n");
  }
  if (!o.plot.empty()) std::printf("\nheat map written to %s\n", o.plot.c_str());
  return 0;
}

const registrar reg{{"kv-error", "attention error of KV formats replayed on real Q/K/V, per layer and head",
                     [](CLI::App* app) {
  auto o = std::make_shared<kv_error_opts>();
  o->p.n_ctx = 0;
  app->add_option("-m,--model", o->model_path, "GGUF model file")->required();
  app->add_option("-f,--file", o->text_path, "text the model reads while Q/K/V are captured")->required();
  app->add_option("-c,--ctx-size", o->p.n_ctx, "tokens per chunk (0: min(512, model context))")->capture_default_str();
  app->add_option("--chunks", o->p.n_chunks, "chunks of the text to capture")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app->add_option("--types", o->types,
                  "comma-separated formats, each used for K and V (default: every type but f32; 'all' the same)");
  app->add_option("--plot", o->plot, "write a PNG heat map (layer x head) of the relative error");
  app->add_flag("--no-tv", o->no_tv, "skip the attention-probability TV distance (ceil(n_ctx/head_dim) extra passes)");
  add_report_flags(app, o->json, o->no_progress);
  add_kv_flags(app, o->kv, o->explicit_kv);  // an explicit -ctk/-ctv (without --types) replays just that pair
  return [o] { return run_kv_error(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
