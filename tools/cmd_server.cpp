// kvq server: OpenAI-compatible HTTP serving with continuous batching (include/kvq/server.h).
#include <csignal>
#include <cstdio>
#include <pthread.h>
#include <thread>

#include "cli.h"
#include "kvq/server.h"

namespace kvq::cli {
namespace {

struct server_opts {
  server_params p;
  kv_flags kv;  // p.cache, parsed when the command runs
  std::string device = "cpu";  // p.device, parsed when the command runs
};

int run_server(server_opts& o) {
  o.p.device = parse_compute_device(o.device);
  o.p.cache = o.kv.params(o.p.device == compute_device::cuda);  // the GPU: no exact recent window yet
  // SIGINT / SIGTERM stop the server from a thread of their own (httplib's stop() is not
  // async-signal-safe); a client that hangs up must not kill the process with SIGPIPE.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts: they inherit the mask
  std::signal(SIGPIPE, SIG_IGN);
  auto srv = server::create(o.p);
  std::thread([set, s = srv.get()] {
    int sig = 0;
    sigwait(&set, &sig);
    std::fprintf(stderr, "[server] signal %d: stopping\n", sig);
    s->stop();
  }).detach();
  srv->run();
  return 0;
}

const registrar reg{{"server", "OpenAI-compatible HTTP server with continuous batching", [](CLI::App* app) {
  auto o = std::make_shared<server_opts>();
  server_params& p = o->p;
  app->add_option("-m,--model", p.model_path, "GGUF model file")->required();
  app->add_option("-c,--ctx-size", p.n_ctx, "context size of each sequence slot in tokens (0: min(model, 4096))")->capture_default_str();
  app->add_option("--parallel", p.n_parallel, "sequence slots decoded together (alias -np)")->capture_default_str()->check(CLI::Range(1, 256));
  app->add_option("-b,--batch-size", p.n_batch, "prompt tokens per prefill chunk (the prefix cache's block; most per piece)")->capture_default_str()->check(CLI::Range(1, 65536));
  app->add_option("--batch-tokens", p.n_batch_tokens, "tokens per step: decode tokens first, then prompt pieces up to this (bounds the inter-token gap while prompts prefill; a step with nothing decoding takes up to max(this, -b) prompt tokens)")->capture_default_str()->check(CLI::Range(1, 65536));
  app->add_option("--queue", p.n_queue, "requests waiting for a slot before 503")->capture_default_str()->check(CLI::Range(0, 100000));
  app->add_option("--host", p.host, "address to bind (127.0.0.1: this machine only)")->capture_default_str();
  app->add_option("--port", p.port, "TCP port (0: any free port, printed at start)")->capture_default_str()->check(CLI::Range(0, 65535));
  // An empty key would turn authentication off: refused, so that `--api-key "$KEY"` with KEY unset
  // does not serve without one.
  app->add_option("--api-key", p.api_key, "require 'Authorization: Bearer KEY' (all routes but /health)")
      ->check([](const std::string& key) {
        return key.empty() ? std::string("is empty, which would serve without a key (leave --api-key out for that)")
                           : std::string();
      });
  app->add_option(
         "--cors-origin", p.cors_origin,
         "Access-Control-Allow-Origin of every response, and OPTIONS preflights answered without the key ('': no CORS)")
      ->capture_default_str();
  app->add_option("-a,--alias", p.model_alias, "model id reported by /v1/models (default: the file name)");
  app->add_option("--chat-template-file", p.chat_template_file, "chat template text to use instead of the model's");
  app->add_option("-t,--threads", p.n_threads, "compute threads (0: all)")->capture_default_str()->check(CLI::Range(0, 1024));
  app->add_option("--threads-http", p.n_http_threads, "HTTP threads (0: parallel + queue + 4)")->capture_default_str()->check(CLI::Range(0, 100000));
  app->add_option("--kv-page", p.kv_page, "tokens per KV page (0: contiguous slots, no prefix reuse; --device cuda: 16, its own pages)")->capture_default_str()->check(CLI::Range(0, 65536));
  app->add_option("--kv-budget", p.kv_budget_gib, "GiB of KV pages shared by all slots (0: every slot can hold -c)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app->add_flag("!--no-prefix-reuse", p.prefix_reuse, "do not start requests from saved prompt prefixes (docs/server.md)");
  add_device_flag(app, o->device);
  app->add_flag("--cuda-graphs", p.cuda_graphs, "--device cuda: decode and mixed steps as CUDA graphs (one launch per step)");
  add_kv_flags(app, o->kv);
  return [o] { return run_server(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
