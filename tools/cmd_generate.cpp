// kvq generate: text generation with a (compressed) KV cache, llama.cpp-style flags.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "certified_report.h"
#include "cli.h"
#include "kvq/certified.h"
#include "kvq/error.h"
#include "kvq/generate.h"
#include "kvq/sampling.h"
#include "result_json.h"

namespace kvq::cli {
namespace {

struct generate_opts {
  std::string model_path;
  generate_params p;
  kv_flags kv;  // p.cache, parsed when the command runs
  std::string device = "cpu";  // p.device, parsed when the command runs
  bool json = false;
};

int run_generate(generate_opts& o) {
  o.p.device = parse_compute_device(o.device);
  o.p.cache = o.kv.params(o.p.device == compute_device::cuda);  // the GPU: no exact recent window yet
  auto m = model::load(o.model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  generate_result r;
  if (o.json) {
    r = generate(*m, *tok, o.p);
  } else {
    // The prompt is echoed with the first generated piece, so that an error found while
    // validating or prefilling leaves nothing on stdout.
    bool echoed = false;
    auto echo_prompt = [&] {
      if (!echoed) std::fputs(o.p.prompt.c_str(), stdout);
      echoed = true;
    };
    r = generate(*m, *tok, o.p, [&](const std::string& piece) {
      echo_prompt();
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    });
    echo_prompt();
    std::fputs("\n", stdout);
  }
  const double ratio = r.kv_bytes_per_token > 0 ? r.kv_bytes_per_token_f16 / r.kv_bytes_per_token : 0;
  if (o.json) {
    const nlohmann::json j = generate_json(o.model_path, o.p, r);
    std::printf("%s\n", json_text(j).c_str());
  } else {
    std::fprintf(stderr,
                 "\n[kvq] prompt %zu tokens, generated %zu tokens (stop: %s, seed %llu)\n"
                 "[kvq] prefill %.1f tok/s, decode %.1f tok/s\n"
                 "[kvq] KV cache %s: %.1f bytes/token (f16 %.1f: %.2fx compression), %zu bytes used, %zu allocated (n_ctx %d)\n"
                 "[kvq] attention tier %s\n",
                 r.prompt_ids.size(), r.ids.size(), r.stop_reason.c_str(), (unsigned long long)r.seed,
                 r.prefill_tokens_per_s, r.decode_tokens_per_s, r.kv_describe.c_str(), r.kv_bytes_per_token,
                 r.kv_bytes_per_token_f16, ratio, r.kv_bytes_used, r.kv_bytes, r.n_ctx, r.attn_tier.c_str());
    print_certified_reports(r.certified);
  }
  return 0;
}

const registrar reg{{"generate", "generate text from a prompt", [](CLI::App* app) {
  auto o = std::make_shared<generate_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file")->required();
  app->add_option("-p,--prompt", o->p.prompt, "prompt text")->required();
  app->add_option("-n,--n-predict", o->p.n_predict,
                  "tokens to generate (-1: until end of generation); generation also ends when the prompt and the "
                  "generated tokens fill -c")
      ->capture_default_str();
  app->add_option("-c,--ctx-size", o->p.n_ctx, "context size in tokens (0: min(model, 4096))")->capture_default_str();
  app->add_option("-b,--batch-size", o->p.n_batch, "prompt tokens per prefill pass")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")->capture_default_str()->check(CLI::Range(0, 1024));
  app->add_option("--temp", o->p.sampling.temp, "temperature (<= 0: greedy)")
      ->capture_default_str()
      ->check(finite_float());
  app->add_option("--top-k", o->p.sampling.top_k, "top-k (<= 0: off)")->capture_default_str();
  // the sampler's ranges (kvq/sampling.h), refused here naming the flag rather than as "min_p" when it runs
  app->add_option("--top-p", o->p.sampling.top_p, "top-p (1 or more: off)")
      ->capture_default_str()
      ->check(finite_float())
      ->check(number_range(0, INFINITY, /*lo_open=*/true));
  app->add_option("--min-p", o->p.sampling.min_p, "min-p (0: off)")
      ->capture_default_str()
      ->check(finite_float())
      ->check(number_range(0, 1));
  // the server's range (docs/server.md, "Request fields"), so a request's seed reproduces here
  app->add_option_function<int64_t>(
         "-s,--seed", [o](int64_t s) { o->p.sampling.seed = sampling_seed(s); },
         "RNG seed, any 64-bit integer as the server takes it (-1 or 4294967295: random, the default; a negative "
         "seed is its two's complement)")
      ->check(int64_value());
  app->add_flag("--ignore-eos", o->p.ignore_eos, "keep generating after end-of-generation tokens");
  app->add_flag("--json", o->json, "print one JSON object instead of streaming text");
  add_device_flag(app, o->device);
  add_kv_flags(app, o->kv);
  app->parse_complete_callback([o] {
    kv_cache_params c;
    try {
      c = o->kv.params();
    } catch (const error&) {
      return;  // a bad name is reported when the command runs
    }
    if (c.certify && !is_certified(c))  // --kv-certify on dense K and V: a plain dense cache
      throw CLI::ValidationError("--kv-certify", "needs a compressed -ctk or -ctv (e.g. -ctk q8 -ctv q4), got -ctk " +
                                                      std::string(kv_cache_type_name(c.type_k)) + " -ctv " +
                                                      kv_cache_type_name(c.type_v) + "; or use -ctk certified");
  });
  return [o] { return run_generate(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
