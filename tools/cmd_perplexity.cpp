// kvq perplexity: PPL and KL divergence of a KV-cache configuration (llama.cpp's protocol).
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "certified_report.h"
#include "cli.h"
#include "result_json.h"
#include "kvq/perplexity.h"

namespace kvq::cli {
namespace {

struct perplexity_opts {
  std::string model_path, text_path;
  perplexity_params p;
  kv_flags kv;          // p.cache, parsed when the command runs
  std::string compare;  // p.compare_type
  std::string device = "cpu";  // p.device, parsed when the command runs
  bool json = false, no_progress = false;
};

int run_perplexity(perplexity_opts& o) {
  o.p.device = parse_compute_device(o.device);
  o.p.cache = o.kv.params(o.p.device == compute_device::cuda);  // the GPU: no exact recent window yet
  if (!o.compare.empty()) o.p.compare_type = parse_kv_cache_type(o.compare);
  auto m = model::load(o.model_path);
  auto tok = tokenizer::from_gguf(m->gguf());
  perplexity_check(*m, o.p);  // refuse bad flags before reading and tokenizing a large text
  const std::string text = read_text_file(o.text_path);
  const auto ids = perplexity_tokenize(*tok, text);
  if (!o.no_progress)
    std::fprintf(stderr, "[kvq] %s: %zu tokens; chunks of %d tokens, last %d positions scored\n",
                 o.text_path.c_str(), ids.size(), o.p.n_ctx, o.p.n_ctx - 1 - o.p.n_ctx / 2);
  const perplexity_result r = perplexity(*m, ids, perplexity_bos(*tok), o.p, progress_bar(!o.no_progress, "chunks"));
  if (o.json) {
    nlohmann::json j = perplexity_json(o.model_path, o.p, r);
    j["text"] = o.text_path;
    std::printf("%s\n", json_text(j).c_str());
    return 0;
  }
  print_certified_reports(r.certified);
  std::printf("model %s, KV cache %s (%.1f bytes/token, f16 %.1f), attention tier %s\n", o.model_path.c_str(),
              r.kv_describe.c_str(), r.kv_bytes_per_token, r.kv_bytes_per_token_f16, r.attn_tier.c_str());
  std::printf("%d chunks of %d tokens, %lld scored tokens, %.1f s (%.0f tok/s)\n", r.n_chunk, r.n_ctx,
              (long long)r.ppl.n_scored, r.seconds, r.tokens_per_s);
  std::printf("Final estimate: PPL = %.4f +/- %.5f\n", r.ppl.ppl, r.ppl.ppl_err);
  if (!o.p.kl_base_out.empty()) {
    const std::string records =
        r.kl_base_top_k > 0 ? "top-" + std::to_string(r.kl_base_top_k) + " + rest" : "full vocabulary";
    std::printf("KL base written to %s: %lld records (%d chunks x %d scored tokens, %s), %llu bytes\n",
                o.p.kl_base_out.c_str(), (long long)r.kl_base_records, r.n_chunk, r.n_scored_per_chunk, records.c_str(),
                (unsigned long long)r.kl_base_bytes);
  }
  if (r.has_kld) {
    const kld_stats& k = r.kld;
    std::printf("\nKL divergence vs %s%s, %lld tokens\n", k.base_desc.c_str(),
                k.top_k > 0 ? (" (top-" + std::to_string(k.top_k) + " + rest)").c_str() : "", (long long)k.n);
    std::printf("PPL(base)        %10.4f +/- %.5f\n", k.ppl_base, k.ppl_base_err);
    std::printf("dPPL             %+10.4f %% +/- %.4f %%\n", k.dppl_pct, k.dppl_err);
    std::printf("Mean KLD         %10.6f +/- %.6f\n", k.mean, k.mean_err);
    std::printf("Median KLD       %10.6f\n", k.median);
    std::printf("90.0%%   KLD      %10.6f\n", k.p90);
    std::printf("99.0%%   KLD      %10.6f\n", k.p99);
    std::printf("99.9%%   KLD      %10.6f\n", k.p99_9);
    std::printf("Maximum KLD      %10.6f\n", k.max);
    std::printf("Same top-1       %10.3f %% +/- %.3f %%\n", k.same_top1_pct, k.same_top1_err);
    std::printf("RMS dp           %10.3f %% +/- %.3f %%\n", k.rms_dp_pct, k.rms_dp_err);
  }
  return 0;
}

const registrar reg{{"perplexity", "perplexity and KL divergence of a KV cache type (llama.cpp protocol)",
                     [](CLI::App* app) {
  auto o = std::make_shared<perplexity_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model file")->required();
  app->add_option("-f,--file", o->text_path, "text file to evaluate")->required();
  app->add_option("-c,--ctx-size", o->p.n_ctx, "tokens per chunk")->capture_default_str();
  app->add_option("-b,--batch-size", o->p.n_batch, "tokens per forward pass (0: min(chunk, 2048), as llama.cpp)")->capture_default_str();
  app->add_option("--chunks", o->p.n_chunks, "evaluate at most N chunks (-1: all)")->capture_default_str();
  app->add_option("-t,--threads", o->p.n_threads, "threads (0: all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app->add_option("--kl-base", o->p.kl_base_out, "write this run's log-probs as a KL base file");
  app->add_option("--kl-compare", o->p.kl_base_in, "report KL divergence against a KL base file");
  app->add_option("--compare", o->compare,
                  "report KL divergence against a second cache of this type (K and V), run side by side");
  app->add_option("--kl-top-k", o->p.kl_top_k,
                  "records of the KL base file: -1 auto (full vocab up to 1024, else 128), 0 full, K top-K")
      ->capture_default_str();
  app->add_flag("--json", o->json, "print one JSON object with every figure");
  app->add_flag("--no-progress", o->no_progress, "no progress bar on stderr");
  add_device_flag(app, o->device);
  add_kv_flags(app, o->kv);
  return [o] { return run_perplexity(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
