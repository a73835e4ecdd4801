// kvq bench: decode and prefill speed and KV memory of KV formats against context depth.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "certified_report.h"
#include "cli.h"
#include "kvq/bench.h"
#include "kvq/bench_cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "kvq/perplexity.h"
#include "kvq/sys_memory.h"
#include "kvq/tokenizer.h"

namespace kvq::cli {

namespace {

struct bench_opts {
  std::string model_path, shape, weights = "q8_0", text_path, types, depths = "0,512,4096", plot;
  int shape_layers = 0;
  double max_kv_gib = 0;  // 0: half of MemAvailable; -1: no limit
  bench_params p;
  kv_flags kv;
  bool json = false, no_progress = false, explicit_kv = false;
  bool weights_given = false, shape_layers_given = false;  // options of --shape only
  // --device cuda: batched decode on the GPU (bench_cuda); --batch and --capacity belong to it
  std::string device = "cpu", batches = "1", capacity = "0";
  bool batches_given = false, capacity_given = false, graphs = false;
  // --device cuda: prefill of prompts of these lengths, tiled kernel beside the per-token path
  std::string prefill, prefill_per_token_max;
  int prefill_chunk = 512;
  bool depths_given = false, prefill_given = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, ','))
    if (!t.empty()) out.push_back(t);
  return out;
}

// One --types entry: FORMAT (K and V), or K/V (e.g. kivi4/q4a), either optionally followed by
// +sinkN and/or +recentN (N exact sink / recent tokens for this entry only, e.g. q4+sink0+recent0 for
// the per-token body alone; without them, --kv-sink / --kv-exact-recent, whose auto is
// kv_auto_windows of the entry's types). The other cache options (--kv-rot, --kv-group, ...) apply to
// every entry.
kv_cache_params types_entry(const std::string& t, const kv_flags& kv, bool gpu = false) {
  kv_cache_params c = kv.p;
  // The GPU bench keeps no exact windows unless asked (a sink is kept, a recent window refused) and, unless asked, no K
  // channel scale (--kv-k-channel-scale on): its decode cost is one multiply per query element, so the rows stay
  // comparable with the earlier tables of docs/perf.md
  if (gpu) {
    c.sink = std::max(c.sink, 0);
    c.exact_recent = std::max(c.exact_recent, 0);
    if (!c.k_channel_scale) c.k_channel_scale = false;
  }
  c.rotation = parse_kv_rotation(kv.rotation);
  std::string spec = t;
  int sink = -1, recent = -1;
  if (const size_t plus = spec.find('+'); plus != std::string::npos) {
    const std::string opts = spec.substr(plus + 1) + "+";  // each option ends with '+'
    spec.resize(plus);
    for (size_t b = 0, e; (e = opts.find('+', b)) != std::string::npos; b = e + 1) {
      const std::string opt = opts.substr(b, e - b);
      const char* name = opt.rfind("sink", 0) == 0 ? "sink" : opt.rfind("recent", 0) == 0 ? "recent" : nullptr;
      const size_t len = name ? std::strlen(name) : 0;
      size_t used = 0;
      long long n = -1;
      if (name && opt.size() > len && std::isdigit((unsigned char)opt[len])) {
        try {
          n = std::stoll(opt.substr(len), &used);
        } catch (const std::exception&) {
          n = -1;
        }
      }
      if (n < 0 || len + used != opt.size() || n > std::numeric_limits<int>::max())
        fail_input("'+" + opt + "' must be +sinkN or +recentN with N >= 0 exact tokens (e.g. kivi4/q4a+sink4, " +
                   "q4+sink0+recent0)");
      (name[0] == 's' ? sink : recent) = (int)n;
    }
  }
  const size_t slash = spec.find('/');
  if (slash == std::string::npos) {
    c.type_k = c.type_v = parse_kv_cache_type(spec);
  } else {
    if (spec.find('/', slash + 1) != std::string::npos)
      fail_input("'" + spec + "' must be FORMAT or K/V (one '/')");
    c.type_k = parse_kv_cache_type(spec.substr(0, slash), "K");
    c.type_v = parse_kv_cache_type(spec.substr(slash + 1), "V");
  }
  if (sink >= 0) c.sink = sink;
  if (recent >= 0) c.exact_recent = recent;
  return resolve_kv_windows(c);
}

// Machine facts for the report: CPU model name, CPUs online, load averages (1 min).
struct machine_info {
  std::string cpu;
  int n_cpu = 0;
  double load_start = -1, load_end = -1;
};

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? "" : line.substr(line.find_first_not_of(" \t", c + 1));
    }
  return "";
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  if (!(f >> l)) return -1;
  return l;
}

// Runs f and re-tags a kvq::error from another layer as "[bench] <context><message>", except the
// "[cuda] not supported ..." / "[cuda] no GPU visible ..." of a build or machine without a GPU,
// which every command reports alike (README, CliDevice.CudaWithoutGpuIsNotSupported).
template <typename F>
auto as_bench(const std::string& context, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const error& e) {
    std::string msg = e.what();
    if (msg.rfind("[bench]", 0) == 0 || msg.rfind("[cuda] ", 0) == 0) throw;
    if (!msg.empty() && msg[0] == '[' && msg.find("] ") != std::string::npos) msg = msg.substr(msg.find("] ") + 2);
    throw error(e.code(), "[bench] " + context + msg);
  }
}

nlohmann::json to_json(const bench_opts& o, const bench_result& r, const machine_info& mi) {
  nlohmann::json j;
  j["model"] = o.shape.empty() ? o.model_path : "synthetic:" + o.shape;
  j["model_desc"] = r.model_desc;
  if (!o.shape.empty()) j["weights"] = o.weights;
  j["fill"] = r.fill;
  j["n_threads"] = r.n_threads;
  j["n_ctx"] = r.n_ctx;
  j["n_ctx_train"] = r.n_ctx_train;
  j["n_decode"] = o.p.n_decode;
  j["n_prefill"] = o.p.n_prefill;
  j["prefill_repeats"] = o.p.prefill_repeats;
  j["machine"] = {{"cpu", mi.cpu}, {"n_cpu", mi.n_cpu}, {"load_average_start", mi.load_start},
                  {"load_average_end", mi.load_end}};
  j["rows"] = nlohmann::json::array();
  for (const auto& w : r.rows)
    j["rows"].push_back({{"type_k", w.type_k}, {"type_v", w.type_v}, {"sink", w.sink}, {"exact_recent", w.exact_recent}, {"describe", w.describe},
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

// Checks before the (long) run that the plot can be written: runs the plotter on a one-row
// result into a scratch file next to FILE, then removes it.
void check_plotter(const std::string& png) {
  check_plot_dir("bench", png);
  const std::string probe = png + ".check.png";
  nlohmann::json j{{"model", "check"}, {"model_desc", "check"}, {"fill", "real"}, {"n_threads", 1}, {"n_ctx_train", 0}};
  j["rows"] = nlohmann::json::array({{{"type_k", "f16"}, {"type_v", "f16"}, {"depth", 0}, {"decode_tokens_per_s", 1.0},
                                      {"kv_bytes_used", 0}, {"beyond_train_ctx", false}}});
  as_bench("--plot '" + png + "': cannot plot before the run: ", [&] { run_plot_script("plot_bench.py", json_text(j), probe); });
  std::remove(probe.c_str());
}

// bench_check, naming the flag that sets the memory limit.
void check(const kv_cache_params& shape, const bench_params& p) {
  try {
    bench_check(shape, p);
  } catch (const error& e) {
    const std::string msg = e.what();
    if (msg.find("more than the limit") == std::string::npos) throw;
    throw error(e.code(), msg + " (--max-kv-gib; default: half the available memory)");
  }
}

void print_cuda(const bench_opts& o, const bench_cuda_result& r) {
  if (o.json) {
    nlohmann::json j;
    j["model"] = o.shape.empty() ? o.model_path : "synthetic:" + o.shape;
    j["model_desc"] = r.model_desc;
    j["device"] = r.device;
    j["copy_bandwidth_bytes_per_s"] = r.copy_bandwidth;
    j["mem_total"] = r.mem_total;
    j["n_decode"] = o.p.n_decode;
    j["rows"] = nlohmann::json::array();
    for (const auto& w : r.rows)
      j["rows"].push_back({{"type", w.type}, {"describe", w.describe}, {"batch", w.batch}, {"depth", w.depth},
                           {"capacity", w.capacity}, {"fill_seconds", w.fill_seconds},
                           {"step_ms_median", w.step_ms_median}, {"step_ms_min", w.step_ms_min},
                           {"step_ms_max", w.step_ms_max}, {"tokens_per_s", w.tokens_per_s},
                           {"weight_bytes_read", w.weight_bytes_read}, {"kv_bytes_read", w.kv_bytes_read},
                           {"kv_bytes_allocated", w.kv_bytes_allocated}, {"bound_ms", w.bound_ms},
                           {"x_bound", w.x_bound}, {"speedup_vs_f16", w.speedup_vs_f16},
                           {"graph_ms_median", w.graph_ms_median}, {"graph_x_bound", w.graph_x_bound}});
    j["prefill"] = nlohmann::json::array();
    for (const auto& w : r.prefill)
      j["prefill"].push_back({{"type", w.type}, {"describe", w.describe}, {"prompt", w.prompt}, {"chunk", w.chunk},
                              {"tiled_seconds", w.tiled_seconds}, {"tiled_tokens_per_s", w.tiled_tokens_per_s},
                              {"per_token_seconds", w.per_token_seconds},
                              {"per_token_tokens_per_s", w.per_token_tokens_per_s}, {"speedup", w.speedup},
                              {"logits_rel_rms", w.logits_rel_rms}});
    std::printf("%s\n", json_text(j).c_str());
    return;
  }
  std::printf("model: %s\n", r.model_desc.c_str());
  std::printf("device: %s, %.1f GiB; copy bandwidth %.0f GB/s (read + write)\n", r.device.c_str(),
              r.mem_total / 1073741824.0, r.copy_bandwidth / 1e9);
  std::printf("decode step = one token of every sequence, greedy ids back to the host; median of %d steps; "
              "bound = (weights read + KV attended) / copy bandwidth\n\n",
              o.p.n_decode);
  std::printf("| %-4s | %5s | %6s | %8s | %9s | %10s | %9s | %9s | %8s | %7s | %6s |%s\n", "KV", "batch", "depth",
              "step ms", "tok/s", "x f16 t/s", "weights GB", "KV GB", "bound ms", "x bound", "fill s",
              o.graphs ? " graph ms | x bound |" : "");
  std::printf("|------|-------|--------|----------|-----------|------------|-----------|-----------|----------|---------|--------|%s\n",
              o.graphs ? "----------|---------|" : "");
  for (const auto& w : r.rows) {
    std::printf("| %-4s | %5d%s | %6d | %8.2f | %9.1f | %10.2f | %10.2f | %9.2f | %8.2f | %7.2f | %6.1f |", w.type.c_str(),
                w.batch, w.capacity ? "*" : " ", w.depth, w.step_ms_median, w.tokens_per_s, w.speedup_vs_f16,
                w.weight_bytes_read / 1e9, w.kv_bytes_read / 1e9, w.bound_ms, w.x_bound, w.fill_seconds);
    if (o.graphs) std::printf(" %8.2f | %7.2f |", w.graph_ms_median, w.graph_x_bound);
    std::printf("\n");
  }
  if (!r.prefill.empty()) {
    std::printf("\nprefill = the prompt as forward() calls of CHUNK tokens (last logits copied back), one timing; "
                "tiled = the prefill kernel, per-token = the decode kernel with one sequence per token; "
                "logits rel = last logits, tiled vs per-token\n\n");
    std::printf("| %-4s | %6s | %5s | %9s | %11s | %12s | %14s | %8s | %10s |\n", "KV", "prompt", "chunk", "tiled s",
                "tiled tok/s", "per-token s", "per-token t/s", "speedup", "logits rel");
    std::printf("|------|--------|-------|-----------|-------------|--------------|----------------|----------|------------|\n");
    for (const auto& w : r.prefill) {
      std::printf("| %-4s | %6d | %5d | %9.3f | %11.0f |", w.type.c_str(), w.prompt, w.chunk, w.tiled_seconds,
                  w.tiled_tokens_per_s);
      if (w.per_token_seconds > 0)
        std::printf(" %12.3f | %14.0f | %7.2fx | %10.2e |\n", w.per_token_seconds, w.per_token_tokens_per_s, w.speedup,
                    w.logits_rel_rms);
      else
        std::printf(" %12s | %14s | %8s | %10s |\n", "-", "-", "-", "-");
    }
  }
  bool cap = false;
  for (const auto& w : r.rows) cap = cap || w.capacity;
  if (cap)
    std::printf("\n* capacity: the most sequences of this depth whose pages fit beside the weights (allocated, "
                "filled and decoded as one batch)\n");
}

int run_bench_cuda(bench_opts& o) {
  if (o.model_path.empty() == o.shape.empty())
    fail_input("[bench] give exactly one of -m MODEL or --shape NAME");
  if (!o.text_path.empty()) fail_input("[bench] -f TEXT: --device cuda fills the caches with random K/V");
  if (o.shape.empty() && (o.weights_given || o.shape_layers_given))
    fail_input(std::string("[bench] ") + (o.weights_given ? "--weights" : "--shape-layers") +
               " sets the synthetic model of --shape; a model given with -m has its own weights and layers");
  if (o.weights_given && o.weights != "f16")
    fail_input("[bench] --weights " + o.weights + ": the GPU runs f16 weights (random, generated on the device)");
  bench_cuda_params p;
  std::vector<std::string> types = split(o.types);
  if (o.explicit_kv) {
    kv_cache_params c = o.kv.params(/*gpu=*/true);
    if (o.kv.p.sink < 0) c.sink = 0;  // as types_entry: no windows unless asked
    if (!o.kv.p.k_channel_scale) c.k_channel_scale = false;
    p.formats.push_back(c);
  }
  if (types.empty() && !o.explicit_kv) types = {"f16", "q8", "q4"};
  for (const auto& t : types) {
    try {
      p.formats.push_back(types_entry(t, o.kv, /*gpu=*/true));
    } catch (const error& e) {
      throw error(e.code(), "[bench] KV format '" + t + "': " + e.what());
    }
  }
  p.batches = parse_count_list(o.batches, "bench", "--batch");
  // --prefill alone times prompts only; with --depths or --batch the decode rows too
  if (!o.prefill_given || o.depths_given || o.batches_given) p.depths = parse_count_list(o.depths, "bench", "--depths");
  else p.depths.clear();  // bench_cuda_params defaults to one decode depth
  if (o.prefill_given) p.prefill_depths = parse_count_list(o.prefill, "bench", "--prefill");
  p.prefill_chunk = o.prefill_chunk;
  if (!o.prefill_per_token_max.empty()) {
    const std::vector<int> mx = parse_count_list(o.prefill_per_token_max, "bench", "--prefill-per-token-max");
    if (mx.size() != 1) fail_input("[bench] --prefill-per-token-max takes one length");
    p.prefill_per_token_max = mx[0];
  }
  const std::vector<int> cap = parse_count_list(o.capacity, "bench", "--capacity");
  if (cap.size() != 1) fail_input("[bench] --capacity takes one context length");
  p.capacity_ctx = cap[0];
  p.n_decode = o.p.n_decode;
  p.seed = o.p.seed;
  p.graphs = o.graphs;
  std::unique_ptr<model> m;
  model_hparams hp;
  if (!o.shape.empty()) {
    if (o.shape_layers < 0) fail_input("[bench] --shape-layers " + std::to_string(o.shape_layers) + " must be >= 0");
    hp = shape_hparams(find_model_shape(o.shape), o.shape_layers);
  } else {
    m = as_bench("-m '" + o.model_path + "': ", [&] { return model::load(o.model_path); });
    hp = m->hparams();
  }
  bench_progress prog;
  if (!o.no_progress)
    prog = [tty = ::isatty(2)](const std::string& what) {
      std::fprintf(stderr, tty ? "\r\033[K[kvq] %s" : "[kvq] %s\n", what.c_str());
      std::fflush(stderr);
    };
  const bench_cuda_result r = as_bench("--device cuda: ", [&] { return bench_cuda(hp, m.get(), p, prog); });
  if (!o.no_progress && ::isatty(2)) std::fprintf(stderr, "\r\033[K");
  print_cuda(o, r);
  std::fflush(stdout);
  return 0;
}

int run_bench(bench_opts& o) {
  if (parse_compute_device(o.device) == compute_device::cuda) return run_bench_cuda(o);
  if (o.batches_given || o.capacity_given || o.graphs || o.prefill_given)
    fail_input(std::string("[bench] ") +
               (o.batches_given ? "--batch" : o.capacity_given ? "--capacity" : o.graphs ? "--cuda-graphs" : "--prefill") +
               " is an option of --device cuda (batched decode on the GPU)");
  if (o.model_path.empty() == o.shape.empty())
    fail_input("[bench] give exactly one of -m MODEL or --shape NAME");
  if (!o.shape.empty() && !o.text_path.empty())
    fail_input("[bench] -f TEXT needs a real model (-m): a synthetic model has no tokenizer");
  if (o.shape.empty() && (o.weights_given || o.shape_layers_given))
    fail_input(std::string("[bench] ") + (o.weights_given ? "--weights" : "--shape-layers") +
               " sets the synthetic model of --shape; a model given with -m has its own weights and layers");
  ggml_type wt = ggml_type::q8_0;
  if (o.weights == "f16") wt = ggml_type::f16;
  else if (o.weights == "q8_0") wt = ggml_type::q8_0;
  else if (o.weights == "q4_0") wt = ggml_type::q4_0;
  else fail_input("[bench] --weights '" + o.weights + "' must be f16, q8_0 or q4_0");
  if (!(o.max_kv_gib >= 0 || o.max_kv_gib == -1)) {  // NaN is refused too
    char v[32];
    std::snprintf(v, sizeof v, "%g", o.max_kv_gib);
    fail_input(std::string("[bench] --max-kv-gib ") + v +
               " must be > 0 (GiB), 0 (half the available memory) or -1 (no limit)");
  }

  // Formats, depths and limits first: everything that can be refused is refused before any work.
  std::vector<std::string> types = split(o.types);
  // names are parsed here; a bad one is refused with bench's tag and the format, as the library's errors
  auto parsed = [](const std::string& name, auto&& parse) -> kv_cache_params {
    try {
      return parse();
    } catch (const error& e) {
      throw error(e.code(), "[bench] KV format '" + name + "': " + e.what());
    }
  };
  if (o.explicit_kv)
    o.p.formats.push_back(parsed(o.kv.type_k == o.kv.type_v ? o.kv.type_k : o.kv.type_k + "/" + o.kv.type_v,
                                 [&] { return o.kv.params(); }));
  if (types.empty() && !o.explicit_kv) types = {"f16", "q8", "q4", "kivi2"};
  for (const auto& t : types) o.p.formats.push_back(parsed(t, [&] { return types_entry(t, o.kv); }));
  o.p.depths = parse_count_list(o.depths, "bench", "--depths");
  if (o.max_kv_gib > 0) {
    o.p.max_kv_bytes = (size_t)(o.max_kv_gib * 1024.0 * 1024.0 * 1024.0);
  } else if (o.max_kv_gib == 0) {
    o.p.max_kv_bytes = mem_available_bytes() / 2;  // the caches share the machine with the model and others
  }
  model_shape shape;
  if (!o.shape.empty()) {
    shape = find_model_shape(o.shape);
    if (o.shape_layers < 0) fail_input("[bench] --shape-layers " + std::to_string(o.shape_layers) + " must be >= 0");
    kv_cache_params cs;
    cs.n_layer = o.shape_layers > 0 ? o.shape_layers : shape.n_layer;
    cs.n_kv_head = shape.n_kv_head;
    cs.head_dim = shape.head_dim;
    check(cs, o.p);  // before writing gigabytes of synthetic weights
  }
  if (!o.plot.empty()) check_plotter(o.plot);

  std::unique_ptr<model> m;
  std::vector<int32_t> ids;
  if (!o.shape.empty()) {
    if (!o.no_progress)
      std::fprintf(stderr, "[kvq] writing a synthetic %s (%s weights%s) to a temporary GGUF...\n", shape.name.c_str(),
                   o.weights.c_str(), o.shape_layers > 0 ? (", " + std::to_string(o.shape_layers) + " layers").c_str() : "");
    m = as_bench("", [&] { return make_synthetic_model(shape, wt, o.shape_layers, o.p.seed); });
  } else {
    m = as_bench("-m '" + o.model_path + "': ", [&] { return model::load(o.model_path); });
    check(m->cache_params(1), o.p);
    if (!o.text_path.empty()) {
      const std::string text = as_bench("-f: ", [&] { return read_text_file(o.text_path); });
      ids = as_bench("-f '" + o.text_path + "': ", [&] {
        auto tok = tokenizer::from_gguf(m->gguf());
        return perplexity_tokenize(*tok, text);
      });
    }
  }
  bench_progress prog;
  if (!o.no_progress)
    prog = [tty = ::isatty(2)](const std::string& what) {
      std::fprintf(stderr, tty ? "\r\033[K[kvq] %s" : "[kvq] %s\n", what.c_str());
      std::fflush(stderr);
    };
  machine_info mi;
  mi.cpu = cpu_model_name();
  mi.n_cpu = (int)::sysconf(_SC_NPROCESSORS_ONLN);
  mi.load_start = load_average();
  const bench_result r = bench(*m, ids, o.p, prog);
  mi.load_end = load_average();
  if (!o.no_progress && ::isatty(2)) std::fprintf(stderr, "\r\033[K");
  nlohmann::json j = to_json(o, r, mi);
  add_certified_json(j, r.certified, /*as_array=*/true);

  // Results first, the plot after: a plot failure must not lose a long run.
  if (o.json) {
    std::printf("%s\n", json_text(j).c_str());
  } else {
    std::printf("model: %s%s\n", r.model_desc.c_str(), o.shape.empty() ? "" : (", " + o.weights + " weights").c_str());
    std::printf("machine: %s, %d CPUs, load average %.2f at start, %.2f at end\n", mi.cpu.c_str(), mi.n_cpu,
                mi.load_start, mi.load_end);
    std::printf("threads %d, fill %s, %d decode steps (median), %d prefill tokens (median of %d), formats interleaved, "
                "cache n_ctx %d\n\n",
                r.n_threads, r.fill.c_str(), o.p.n_decode, o.p.n_prefill, o.p.prefill_repeats, r.n_ctx);
    // the KV column is as wide as its widest label ("kivi4/q4a+sink4*"), at least 11
    auto label = [](const bench_row& w) {
      return (w.type_k == w.type_v ? w.type_k : w.type_k + "/" + w.type_v) +
             (w.sink > 0 ? "+sink" + std::to_string(w.sink) : "") +
             (w.exact_recent > 0 ? "+recent" + std::to_string(w.exact_recent) : "") + (w.beyond_train_ctx ? "*" : "");
    };
    int kv_w = 11;
    for (const auto& w : r.rows) kv_w = std::max(kv_w, (int)label(w).size());
    std::printf("| %-*s | %6s | %12s | %6s | %12s | %6s | %10s | %7s |\n", kv_w, "KV", "depth", "decode tok/s", "x f16",
                "prefill t/s", "x f16", "KV MiB", "f16/KV");
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s |\n", std::string(kv_w, '-').c_str(),
                std::string(6, '-').c_str(), std::string(12, '-').c_str(), std::string(6, '-').c_str(),
                std::string(12, '-').c_str(), std::string(6, '-').c_str(), std::string(10, '-').c_str(),
                std::string(7, '-').c_str());
    for (const auto& w : r.rows) {
      std::printf("| %-*s | %6d | %12.2f | %6.2f | %12.1f | %6.2f | %10.2f | %7.2f |\n", kv_w, label(w).c_str(), w.depth,
                  w.decode_tokens_per_s, w.decode_speedup_vs_f16, w.prefill_tokens_per_s, w.prefill_speedup_vs_f16,
                  w.kv_bytes_used / 1048576.0, w.kv_bytes_ratio_vs_f16);
    }
    bool beyond = false;
    for (const auto& w : r.rows) beyond = beyond || w.beyond_train_ctx;
    if (beyond)
      std::printf("\n* timed positions go past the training context (%d): speed only\n", r.n_ctx_train);
    print_certified_reports(r.certified);
  }
  std::fflush(stdout);
  if (!o.plot.empty()) {
    as_bench("--plot '" + o.plot + "': the results above are complete, the plot failed: ",
             [&] { run_plot_script("plot_bench.py", json_text(j), o.plot); });
    std::fprintf(stderr, "[kvq] plot written to %s\n", o.plot.c_str());
  }
  return 0;
}

const registrar reg{{"bench", "decode/prefill speed and KV memory of KV formats against context depth",
                     [](CLI::App* app) {
  auto o = std::make_shared<bench_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file");
  app->add_option("--shape", o->shape,
                  "synthetic random-weight model of a published shape: llama3-8b, llama3.1-8b, llama3.2-1b, "
                  "mistral-7b, qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b");
  app->add_option("--shape-layers", o->shape_layers, "layers of the synthetic model (0: the shape's)")->capture_default_str();
  app->add_option("--weights", o->weights, "weight type of the synthetic model: f16, q8_0, q4_0")->capture_default_str();
  app->add_option("-f,--file", o->text_path, "text whose tokens feed fill/prefill/decode (default: pseudo-random ids)");
  app->add_option("--types", o->types, "comma-separated KV formats: FORMAT (K and V) or K/V, each optionally +sinkN "
                  "and/or +recentN exact tokens (default: --kv-sink / --kv-exact-recent, auto per entry; e.g. "
                  "f16,q4,q4+sink0+recent0,kivi4/q4a+sink4; default f16,q8,q4,kivi2)");
  app->add_option("--depths", o->depths, "comma-separated depths (tokens, 'k' = 1024)")->capture_default_str();
  app->add_option("-n,--n-decode", o->p.n_decode, "timed decode steps per format and depth")->capture_default_str();
  app->add_option("-p,--n-prefill", o->p.n_prefill, "timed prefill tokens per format and depth (0: skip)")->capture_default_str();
  app->add_option("-r,--prefill-repeats", o->p.prefill_repeats, "prefill timings per format and depth (median)")
      ->capture_default_str();
  app->add_option("-b,--batch-size", o->p.n_batch, "fill batch (tokens or synthetic rows per append)")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app->add_option("--fill", o->p.fill, "real (prefill) or synthetic (append K/V with the model's statistics)")->capture_default_str();
  app->add_option("--seed", o->p.seed, "seed of the synthetic weights, K/V and token ids")->capture_default_str();
  app->add_option("-c,--ctx-size", o->p.n_ctx,
                  "cache positions per format (0: deepest depth + timed positions); every depth must fit")
      ->capture_default_str();
  app->add_option("--ctx-train", o->p.n_ctx_train,
                  "training context that marks rows speed-only '*' (0: the model's context_length)")
      ->capture_default_str();
  app->add_option("--max-kv-gib", o->max_kv_gib,
                  "refuse depths whose caches (all formats together) exceed this (0: half the available memory; -1: no limit)")
      ->capture_default_str();
  app->add_option("--plot", o->plot, "write a PNG of decode tok/s and KV memory against depth");
  app->add_option("--device", o->device,
                  "cpu, or cuda: batched decode steps of the model on the GPU (random f16 weights with --shape, "
                  "caches filled with random K/V, default types f16,q8,q4)")
      ->capture_default_str();
  app->add_option("--batch", o->batches, "--device cuda: comma-separated sequences per decode step")->capture_default_str();
  app->add_option("--capacity", o->capacity,
                  "--device cuda: also find the most sequences of this context (tokens, 'k' = 1024) each type fits "
                  "(0: skip)")
      ->capture_default_str();
  app->add_option("--prefill", o->prefill,
                  "--device cuda: comma-separated prompt lengths ('k' = 1024) whose prefill is timed with the tiled "
                  "prefill kernel and with the per-token decode path (alone: no decode rows unless --depths / --batch)");
  app->add_option("--prefill-chunk", o->prefill_chunk, "--device cuda: tokens per forward() of a timed prompt")
      ->capture_default_str();
  app->add_option("--prefill-per-token-max", o->prefill_per_token_max,
                  "--device cuda: time the per-token baseline only for prompts up to this length (default: all)");
  app->add_flag("--cuda-graphs", o->graphs,
                "--device cuda: also time every step as a CUDA graph (captured per step, replayed with one launch)");
  add_report_flags(app, o->json, o->no_progress);
  add_kv_flags(app, o->kv, o->explicit_kv);
  app->get_option("--weights")->each([o](const std::string&) { o->weights_given = true; });
  app->get_option("--shape-layers")->each([o](const std::string&) { o->shape_layers_given = true; });
  app->get_option("--batch")->each([o](const std::string&) { o->batches_given = true; });
  app->get_option("--capacity")->each([o](const std::string&) { o->capacity_given = true; });
  app->get_option("--depths")->each([o](const std::string&) { o->depths_given = true; });
  app->get_option("--prefill")->each([o](const std::string&) { o->prefill_given = true; });
  return [o] { return run_bench(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
