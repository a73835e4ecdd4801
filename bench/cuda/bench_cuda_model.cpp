// End-to-end speed of the model on the GPU (cuda::model_runner) beside the CPU engine, same model,
// cache type and tokens: prefill of one batch, then greedy decode steps (each step synchronous:
// logits copied back). Prints one row per (engine, cache type) with the median decode step.
//   bench_cuda_model MODEL.gguf|shape:NAME [--layers N] [--weights f16|q8_0|q4_0] [--prefill 512]
//                    [--decode 128] [--types f16,q8,q4] [--no-cpu]
//   bench_cuda_model ... --server-step [--slots 16] [--prefill 128] [--pieces 128,64] [--depth 0]
// --server-step: the GPU server's steps (issue 16's inter-token gaps), one runner per cache type
// (the K channel scale at its default, as the server runs it): --slots sequences decoding at
// --depth + --prefill positions beside a new sequence's prompt piece. Median host wall time of
// decode() of the slots alone, decode() then forward() of the piece (the server before
// model_runner::step), and step() of both in one pass; all synchronous (logits or ids back). Below
// each row, the phases of decode() (direct and as a CUDA graph), forward() of the piece alone and
// step() (direct and as a CUDA graph; model_runner::step_profile). Decode plans with fixed split-KV
// items, as the server's.
// shape:NAME (a built runtime only): make_synthetic_model's random-weight model of that published
// shape (kvq/bench.h), e.g. shape:qwen2.5-0.5b.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if KVQ_BENCH_RUNTIME
#include "kvq/bench.h"
#endif
#include "kvq/cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "kvq/model.h"

using namespace kvq;
using clk = std::chrono::steady_clock;

namespace {

double ms_since(clk::time_point t) { return std::chrono::duration<double, std::milli>(clk::now() - t).count(); }

struct row {
  double prefill_ms = 0, decode_ms = 0;  // one prefill batch; median decode step
};

template <class Step>
row run(Step&& step, const std::vector<int32_t>& prompt, int n_decode, int V) {
  std::vector<float> lg(V);
  row r;
  auto t0 = clk::now();
  step(std::span<const int32_t>(prompt), 0, lg.data());
  r.prefill_ms = ms_since(t0);
  std::vector<double> steps;
  for (int i = 0; i < n_decode; ++i) {
    const int32_t id = (int32_t)(std::max_element(lg.begin(), lg.end()) - lg.begin());
    t0 = clk::now();
    step(std::span<const int32_t>(&id, 1), (int)prompt.size() + i, lg.data());
    steps.push_back(ms_since(t0));
  }
  std::sort(steps.begin(), steps.end());
  r.decode_ms = steps[steps.size() / 2];
  return r;
}

// "f16,q8,q4" -> {"f16", "q8", "q4"} (empty entries skipped)
std::vector<std::string> split_types(const std::string& types) {
  std::vector<std::string> out;
  for (size_t start = 0; start <= types.size();) {
    const size_t end = std::min(types.find(',', start), types.size());
    if (end > start) out.push_back(types.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// --server-step (see the head of the file)
void server_steps(const model& m, const std::string& types, int slots, int prompt, int depth,
                  const std::vector<int>& pieces, int reps) {
  const int V = m.hparams().n_vocab, piece_max = *std::max_element(pieces.begin(), pieces.end());
  std::printf("server steps: %d slots decoding at %d + %d positions (+1 a rep), greedy ids on the device; "
              "a new sequence's piece; median of %d reps, host wall ms; then each call's phases "
              "(model_runner::step_profile: prep = tables and plans, launch = issuing the kernels, finish = "
              "wait and copies back; gpu = its span on the stream)\n",
              slots, depth, prompt, reps);
  std::printf("%-5s %6s %12s %16s %12s %10s\n", "cache", "piece", "decode ms", "decode+forward", "step ms",
              "step/dec");
  for (const std::string& t : split_types(types)) {
    kv_cache_params o;
    o.type_k = o.type_v = parse_kv_cache_type(t);
    // each rep of each piece: five decode steps of the slots (alone, as a graph, before the forward, in
    // step(), in step() as a graph)
    const int n_ctx = depth + prompt + 5 * (reps + 1) * (int)pieces.size() + piece_max + 16;
    const kv_cache_params cp = m.cache_params(n_ctx, o, slots + 1);
    cuda::model_runner r(m, cp, slots + piece_max);
    r.set_batch_invariant(true);  // as the server runs it
    r.set_step_profile(true);
    std::vector<float> lg((size_t)(slots + piece_max) * V);
    std::vector<int32_t> toks(prompt), seqs(slots), dec(slots), ids(slots);
    for (int i = 0; i < prompt; ++i) toks[i] = (int32_t)((i * 7919 + 1) % V);
    for (int s = 0; s < slots; ++s) {
      if (depth > 0) r.fill_synthetic(s, depth, 100 + s);
      r.forward(toks, depth, {}, lg.data(), s);
      seqs[s] = s;
      dec[s] = (int32_t)((s * 31 + 7) % V);
    }
    std::vector<int32_t> piece_toks(piece_max);
    for (int i = 0; i < piece_max; ++i) piece_toks[i] = (int32_t)((i * 104729 + 3) % V);
    // one call's wall time and phases
    struct sample {
      std::vector<double> wall, prep, launch, finish, gpu;
      void add(double w, const cuda::model_runner::step_profile& p) {
        wall.push_back(w), prep.push_back(p.prep_ms), launch.push_back(p.launch_ms), finish.push_back(p.finish_ms),
            gpu.push_back(p.gpu_ms);
      }
    };
    // times f with CUDA graphs on or off and, past the warm-up, keeps its wall time and phases in *x
    auto call = [&](sample* x, bool graphs, bool keep, auto&& f) {
      r.set_cuda_graphs(graphs);
      const auto t0 = clk::now();
      f();
      const double wall = ms_since(t0);
      r.set_cuda_graphs(false);
      if (keep) x->add(wall, r.last_step_profile());
    };
    for (int np : pieces) {
      sample d, dg, fw, a, st, sg;  // (a: decode() then forward(); its wall time only)
      const std::span<const int32_t> pt(piece_toks.data(), np);
      std::vector<int32_t> all_seq(seqs), all_tok(dec);
      all_seq.insert(all_seq.end(), np, slots);
      all_tok.insert(all_tok.end(), pt.begin(), pt.end());
      const auto decode = [&] { r.decode(seqs, dec, nullptr, ids.data()); };
      const auto forward = [&] { r.forward(pt, 0, {}, lg.data(), slots); };
      const auto step = [&] { r.step(all_seq, all_tok, slots, {}, lg.data(), ids.data()); };
      for (int rep = 0; rep < reps + 1; ++rep) {  // rep 0: warm-up
        const bool keep = rep > 0;
        call(&d, false, keep, decode);
        call(&dg, true, keep, decode);
        call(&fw, false, keep, forward);
        r.clear_seq(slots);
        call(&a, false, keep, [&] {
          decode();
          forward();
        });
        r.clear_seq(slots);
        call(&st, false, keep, step);
        r.clear_seq(slots);
        call(&sg, true, keep, step);
        r.clear_seq(slots);
      }
      const double md = median(d.wall), ma = median(a.wall), ms = median(st.wall);
      std::printf("%-5s %6d %12.3f %16.3f %12.3f %10.2f\n", t.c_str(), np, md, ma, ms, ms / md);
      const std::pair<const char*, sample*> rows[] = {
          {"decode", &d}, {"decode (graph)", &dg}, {"forward (piece)", &fw}, {"step", &st}, {"step (graph)", &sg}};
      for (const auto& [name, x] : rows)
        std::printf("      %-16s wall %7.3f  prep %7.3f  launch %7.3f  finish %7.3f  gpu %7.3f\n", name,
                    median(x->wall), median(x->prep), median(x->launch), median(x->finish), median(x->gpu));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [--prefill N] [--decode N] [--types f16,q8,q4] [--no-cpu]\n", argv[0]);
    return 2;
  }
  int n_prefill = 512, n_decode = 128, n_layers = 0;
  std::string weights = "f16";
  std::string types = "f16,q8,q4";
  bool cpu = true, server_step = false;
  int slots = 16, depth = 0, reps = 20;
  std::vector<int> pieces{128, 64};
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--server-step")) server_step = true;
    else if (!std::strcmp(argv[i], "--slots") && i + 1 < argc) slots = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--depth") && i + 1 < argc) depth = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--pieces") && i + 1 < argc) {
      pieces.clear();
      for (const char* c = argv[++i]; *c;) {
        pieces.push_back(std::atoi(c));
        while (*c && *c != ',') ++c;
        if (*c == ',') ++c;
      }
    } else if (!std::strcmp(argv[i], "--prefill") && i + 1 < argc) n_prefill = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--decode") && i + 1 < argc) n_decode = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--types") && i + 1 < argc) types = argv[++i];
    else if (!std::strcmp(argv[i], "--no-cpu")) cpu = false;
    else if (!std::strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--weights") && i + 1 < argc) weights = argv[++i];
  }
  try {
    const std::string src = argv[1];
    std::unique_ptr<model> m;
    if (src.rfind("shape:", 0) == 0) {
#if KVQ_BENCH_RUNTIME
      const ggml_type wt = weights == "q8_0" ? ggml_type::q8_0 : weights == "q4_0" ? ggml_type::q4_0 : ggml_type::f16;
      m = make_synthetic_model(find_model_shape(src.substr(6)), wt, n_layers);
#else
      fail_unsupported("[bench_cuda_model] shape: models need the runtime (built with KVQ_BUILD_RUNTIME=ON)");
#endif
    } else {
      m = model::load(src);
    }
    if (server_step) {
      std::printf("model %s (%s, %d layers, n_embd %d); GPU: %s\n", argv[1], m->hparams().arch.c_str(),
                  m->hparams().n_layer, m->hparams().n_embd, cuda::device_name().c_str());
      server_steps(*m, types, slots, n_prefill, depth, pieces, reps);
      return 0;
    }
    const int V = m->hparams().n_vocab, n_ctx = n_prefill + n_decode;
    std::vector<int32_t> prompt(n_prefill);
    for (int i = 0; i < n_prefill; ++i) prompt[i] = (int32_t)((i * 7919 + 1) % V);  // deterministic, any ids
    std::printf("model %s (%s, %d layers, n_embd %d), prefill %d tokens, decode %d steps; GPU: %s\n", argv[1],
                m->hparams().arch.c_str(), m->hparams().n_layer, m->hparams().n_embd, n_prefill, n_decode,
                cuda::device_name().c_str());
    std::printf("%-6s %-5s %12s %12s %14s\n", "engine", "cache", "prefill ms", "prefill t/s", "decode ms/tok");
    for (const std::string& t : split_types(types)) {
      kv_cache_params o;
      o.type_k = o.type_v = parse_kv_cache_type(t);
      o.k_channel_scale = false;
      const kv_cache_params cp = m->cache_params(n_ctx, o);
      {
        cuda::model_runner r(*m, cp, n_prefill);
        run([&](std::span<const int32_t> x, int pos, float* lg) { r.forward(x, pos, {}, lg); }, prompt, 4,
            V);  // warm-up
        r.clear();
        const row g = run([&](std::span<const int32_t> x, int pos, float* lg) { r.forward(x, pos, {}, lg); }, prompt,
                          n_decode, V);
        std::printf("%-6s %-5s %12.3f %12.0f %14.4f\n", "cuda", t.c_str(), g.prefill_ms, n_prefill / g.prefill_ms * 1e3,
                    g.decode_ms);
      }
      if (cpu) {
        thread_pool pool(0);
        auto cache = make_kv_cache(cp);
        const row c =
            run([&](std::span<const int32_t> x, int pos, float* lg) { m->forward(x, pos, 0, *cache, pool, lg, false); },
                prompt, n_decode, V);
        std::printf("%-6s %-5s %12.3f %12.0f %14.4f\n", "cpu", t.c_str(), c.prefill_ms, n_prefill / c.prefill_ms * 1e3,
                    c.decode_ms);
      }
    }
  } catch (const error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
