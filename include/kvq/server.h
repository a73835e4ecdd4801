// kvq server: an OpenAI-compatible HTTP server (POST /v1/completions, /v1/chat/completions with
// server-sent-event streaming, GET /v1/models, /health, /metrics, POST /tokenize, /detokenize,
// /apply-template) over one model, one KV cache of n_parallel sequence slots and one scheduler
// thread doing continuous batching: each step is one model::forward over the tokens of every
// active sequence (one decode token each, plus fixed-size prefill chunks of new prompts), and new
// requests join between steps (Yu et al. 2022, "Orca", OSDI '22, §3: iteration-level scheduling);
// with device = cuda the steps run on the GPU (cuda::model_runner; docs/server.md, "On the GPU").
// HTTP through cpp-httplib, JSON through nlohmann-json. The API follows OpenAI's
// (https://platform.openai.com/docs/api-reference/completions) and llama.cpp's llama-server
// (tools/server/README.md: top_k, min_p, /tokenize, /detokenize, /apply-template, /props).
#pragma once
#include <memory>
#include <string>

#include "kvq/cuda_model.h"
#include "kvq/kv_cache.h"

namespace kvq {

struct server_params {
  std::string model_path;
  std::string model_alias;          // id reported by /v1/models ("" = the file name)
  std::string host = "127.0.0.1";   // bind address (loopback by default)
  int port = 8080;                  // 0: any free port (server::port() tells which)
  std::string api_key;              // "" = no authentication; else "Authorization: Bearer KEY"
  // CORS (browser UIs on another origin): every response carries Access-Control-Allow-Origin:
  // cors_origin, and an OPTIONS preflight to any route answers 204 with the allowed methods and
  // headers (Authorization, Content-Type) without the API key (browsers send preflights without
  // credentials). "" = no CORS headers and no preflight answer (a browser on another origin is refused).
  std::string cors_origin = "*";
  int n_ctx = 0;                    // positions per sequence slot; 0: min(training context, 4096)
  int n_parallel = 4;               // sequence slots decoded together
  int n_batch = 128;                // prompt tokens per prefill chunk (the prefix cache's block; the most one piece holds)
  int n_batch_tokens = 32;          // tokens per step: decode tokens first, then prompt pieces (docs/server.md)
  int n_queue = 64;                 // requests waiting for a slot before 503 + Retry-After
  int n_threads = 0;                // compute threads (0: all)
  int n_http_threads = 0;           // HTTP worker threads (0: n_parallel + n_queue + 4)
  std::string chat_template_file;   // "" = the model's tokenizer.chat_template
  kv_cache_params cache;            // types and options; shapes, n_ctx and n_seq come from the model
  // Paged KV cache (docs/server.md, "KV pages and prefix reuse"): tokens per page (0: contiguous
  // slots, no prefix reuse), and the page pool's size in GiB (0: every slot can hold n_ctx), so the
  // same budget holds more tokens in a smaller format. Requests wait in the queue for pages.
  int kv_page = 64;
  double kv_budget_gib = 0;
  bool prefix_reuse = true;         // start requests from saved prompt prefixes (paged caches; docs/server.md)
  // Where the model runs (docs/server.md, "On the GPU"): cuda runs every step on the GPU
  // (cuda::model_runner: f16 / q8 / q4 caches, llama / qwen2 models; its own 16-token pages sized
  // by kv_budget_gib, kv_page unused; no prefix reuse). create() refuses a format the GPU does not
  // run by name (unsupported) and a build or machine without a GPU ("[cuda] not supported ...").
  compute_device device = compute_device::cpu;
  bool cuda_graphs = false;         // cuda: decode steps captured and replayed as CUDA graphs
};

// A running server. create() loads the model, checks the chat template (an unknown template is an
// unsupported error naming its source, first line and the formats kvq renders; a model without one
// serves completions and answers chat requests with HTTP 400 no_chat_template saying so), allocates
// the cache and binds the socket (SO_REUSEADDR, not SO_REUSEPORT: a port in use is an error);
// errors are kvq::error (io: cannot bind, "address already in use" naming host:port;
// invalid_input / unsupported: model, cache or template).
class server {
 public:
  static std::unique_ptr<server> create(const server_params& p);
  virtual ~server() = default;
  virtual int port() const = 0;        // the bound port
  virtual void run() = 0;              // serves until stop(); returns after the threads have ended
  virtual void stop() = 0;             // thread-safe; not async-signal-safe
};

}  // namespace kvq
