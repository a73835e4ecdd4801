// End-to-end speed of the model on the GPU (cuda::model_runner) beside the CPU engine, same model,
// cache type and tokens: prefill of one batch, then greedy decode steps (each step synchronous:
// logits copied back). Prints one row per (engine, cache type) with the median decode step.
//   bench_cuda_model MODEL.gguf|shape:NAME [--layers N] [--weights f16|q8_0|q4_0] [--prefill 512]
//                    [--decode 128] [--types f16,q8,q4] [--no-cpu]
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [--prefill N] [--decode N] [--types f16,q8,q4] [--no-cpu]\n", argv[0]);
    return 2;
  }
  int n_prefill = 512, n_decode = 128, n_layers = 0;
  std::string weights = "f16";
  std::string types = "f16,q8,q4";
  bool cpu = true;
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--prefill") && i + 1 < argc) n_prefill = std::atoi(argv[++i]);
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
    const int V = m->hparams().n_vocab, n_ctx = n_prefill + n_decode;
    std::vector<int32_t> prompt(n_prefill);
    for (int i = 0; i < n_prefill; ++i) prompt[i] = (int32_t)((i * 7919 + 1) % V);  // deterministic, any ids
    std::printf("model %s (%s, %d layers, n_embd %d), prefill %d tokens, decode %d steps; GPU: %s\n", argv[1],
                m->hparams().arch.c_str(), m->hparams().n_layer, m->hparams().n_embd, n_prefill, n_decode,
                cuda::device_name().c_str());
    std::printf("%-6s %-5s %12s %12s %14s\n", "engine", "cache", "prefill ms", "prefill t/s", "decode ms/tok");
    size_t start = 0;
    while (start <= types.size()) {
      const size_t end = std::min(types.find(',', start), types.size());
      const std::string t = types.substr(start, end - start);
      start = end + 1;
      if (t.empty()) continue;
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
