// kvq server's HTTP side (cpp-httplib): routes, authentication, OpenAI response shapes, SSE
// streaming, Prometheus metrics. The scheduler (scheduler.h) does the model work.
#include <httplib.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "core/gguf_prefault.h"
#include "kvq/error.h"
#include "kvq/generate.h"
#include "kvq/server.h"
#include "server/api.h"
#include "server/chat_template.h"
#include "server/scheduler.h"

namespace kvq {
namespace server_detail {
namespace {

using nlohmann::json;
using clock_type = std::chrono::system_clock;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(clock_type::now().time_since_epoch()).count();
}

// body[key], which must be there (else 400 missing_field) and pass `ok` (else 400 invalid_type: "'key'
// must be <what>"); a body that is not an object is a wrong type too.
const json& required_field(const json& body, const char* key, bool (json::*ok)() const noexcept, const char* what) {
  if (body.is_object() && !body.contains(key))
    fail_request(key, std::string("'") + key + "' is required", "missing_field");
  if (!body.is_object() || !(body[key].*ok)())
    fail_request(key, std::string("'") + key + "' must be " + what, "invalid_type");
  return body[key];
}

class http_server final : public server {
 public:
  explicit http_server(const server_params& p);
  int port() const override { return port_; }
  void run() override;
  void stop() override;

 private:
  void routes();
  void send_error(httplib::Response& res, const api_error& e) const;
  // the API key check (--api-key): every route but /health and CORS preflights
  bool authorized(const httplib::Request& req) const;
  api_error unauthorized(const httplib::Request& req) const;
  void completion(const httplib::Request& req, httplib::Response& res, bool chat);
  json usage(int n_prompt, int n_generated) const {
    return {{"prompt_tokens", n_prompt}, {"completion_tokens", n_generated}, {"total_tokens", n_prompt + n_generated}};
  }
  std::string metrics_text() const;

  server_params p_;
  std::unique_ptr<model> model_;
  std::unique_ptr<tokenizer> tok_;
  std::optional<chat_template> template_;
  std::string template_text_, template_note_;  // the template's text; why chat is unavailable
  std::string model_id_;
  std::unique_ptr<scheduler> sched_;
  httplib::Server http_;
  int port_ = 0;
  int listen_sock_ = -1;  // the socket cpp-httplib binds (the last one it creates)
  std::atomic<uint64_t> next_id_{1};
  std::string id_prefix_;  // random per server start, so that reply ids differ across restarts
  std::atomic<uint64_t> http_requests_{0}, http_errors_{0};
};

http_server::http_server(const server_params& p) : p_(p) {
  {
    char hex[20];
    std::snprintf(hex, sizeof hex, "%08x-", (unsigned)std::random_device{}());
    id_prefix_ = hex;
  }
  model_ = model::load(p_.model_path);
  // The weights are mapped from the file; the first forward would page in most of them and the
  // token embedding's rows would follow with new tokens: resident from the start instead (issue 16).
  const size_t weight_bytes = gguf_prefault(model_->gguf());
  tok_ = tokenizer::from_gguf(model_->gguf());
  model_id_ = p_.model_alias.empty() ? std::filesystem::path(p_.model_path).filename().string() : p_.model_alias;

  if (!p_.chat_template_file.empty()) {
    errno = 0;
    std::ifstream f(p_.chat_template_file, std::ios::binary);
    if (!f)
      fail(errc::io, "[server] cannot open --chat-template-file '" + p_.chat_template_file +
                         "': " + (errno != 0 ? std::strerror(errno) : "unknown reason"));
    std::stringstream ss;
    ss << f.rdbuf();
    template_text_ = ss.str();
  } else if (auto t = model_->gguf().try_string("tokenizer.chat_template")) {
    template_text_ = *t;
  }
  const std::string bos_text = tok_->bos() >= 0 ? tok_->token_text(tok_->bos()) : "";
  if (!template_text_.empty()) {
    try {
      template_ = chat_template::from_text(template_text_, bos_text);
    } catch (const error& e) {  // an unknown template stops the server, saying where it came from
      if (!p_.chat_template_file.empty())
        throw error(e.code(), "[server] --chat-template-file '" + p_.chat_template_file + "': " + e.what());
      throw error(e.code(), "[server] the model's tokenizer.chat_template: " + std::string(e.what()) +
                                "; give a template in one of these formats with --chat-template-file FILE");
    }
  }
  else
    template_note_ = "the model " + model_id_ + " has no chat template (no tokenizer.chat_template): use "
                     "/v1/completions with a prompt, or start the server with --chat-template-file FILE "
                     "(ChatML or Gemma turn format)";

  scheduler_params sp;
  sp.n_ctx = resolve_n_ctx(*model_, p_.n_ctx, "server");
  sp.n_parallel = p_.n_parallel;
  sp.n_batch = p_.n_batch;
  sp.n_batch_tokens = p_.n_batch_tokens;
  sp.n_queue = p_.n_queue;
  sp.n_threads = p_.n_threads;
  sp.cache = p_.cache;
  sp.kv_page = p_.kv_page;
  if (!(p_.kv_budget_gib >= 0) || !std::isfinite(p_.kv_budget_gib))
    fail_input("[server] --kv-budget must be a finite number of GiB >= 0, got " + std::to_string(p_.kv_budget_gib));
  sp.kv_budget_bytes = (size_t)(p_.kv_budget_gib * 1024.0 * 1024.0 * 1024.0);
  sp.prefix_reuse = p_.prefix_reuse;
  sp.device = p_.device;
  sp.cuda_graphs = p_.cuda_graphs;
  if (p_.cuda_graphs && p_.device != compute_device::cuda)
    fail_input("[server] --cuda-graphs is an option of --device cuda");
  sched_ = std::make_unique<scheduler>(*model_, *tok_, sp);

  const int n_http = p_.n_http_threads > 0 ? p_.n_http_threads : p_.n_parallel + p_.n_queue + 4;
  http_.new_task_queue = [n_http] { return new httplib::ThreadPool((size_t)n_http); };
  if (p_.cors_origin.find_first_of("\r\n") != std::string::npos)
    fail_input("[server] --cors-origin must be one header value, without line breaks");
  // CORS as llama-server does it (browser UIs): every response, errors included (a page reads a 401
  // or 400 body only with the header), carries the allowed origin; preflights below.
  if (!p_.cors_origin.empty()) http_.set_default_headers({{"Access-Control-Allow-Origin", p_.cors_origin}});
  http_.set_payload_max_length(16u << 20);
  http_.set_read_timeout(30);
  http_.set_write_timeout(30);
  // SO_REUSEADDR (a restarted server rebinds past TIME_WAIT) but not SO_REUSEPORT, which
  // cpp-httplib 0.11 sets by default on Linux and which lets a second server bind the same port and
  // take half of its connections: here the second one fails with "address already in use".
  http_.set_socket_options([this](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_sock_ = sock;
  });
  routes();
  errno = 0;
  const bool bound = p_.port == 0 ? (port_ = http_.bind_to_any_port(p_.host)) >= 0 : http_.bind_to_port(p_.host, p_.port);
  if (!bound) {
    const int err = errno;
    const std::string where = p_.host + ":" + (p_.port == 0 ? std::string("0 (any port)") : std::to_string(p_.port));
    if (err == EADDRINUSE)
      fail(errc::io, "[server] cannot listen on " + where + ": address already in use (another server on that port? "
                     "choose another with --port)");
    fail(errc::io, "[server] cannot listen on " + where + ": " +
                       (err != 0 ? std::string(std::strerror(err)) : std::string("bind failed")) +
                       " (is --host a local address?)");
  }
  if (p_.port != 0) port_ = p_.port;
  // Debian's cpp-httplib 0.11 is a compiled library that listens with a backlog of 5
  // (CPPHTTPLIB_LISTEN_BACKLOG): a burst of connections (32 streaming clients starting at once on a
  // busy host) overflowed it and clients were reset or waited for SYN retries. Calling listen()
  // again on a listening socket sets its backlog (Linux); SOMAXCONN is capped by net.core.somaxconn.
  if (listen_sock_ >= 0) ::listen(listen_sock_, SOMAXCONN);
  std::fprintf(stderr, "[server] model %s (%s) on %s, n_ctx %d per slot, %d slots, prefill chunk %d, %d tokens per step, KV cache %s\n",
               model_id_.c_str(), model_->hparams().arch.c_str(), compute_device_name(sp.device), sp.n_ctx,
               sp.n_parallel, sp.n_batch, sp.n_batch_tokens, sched_->cache_describe().c_str());
  const scheduler_metrics m0 = sched_->metrics();
  const bool gpu = sp.device == compute_device::cuda;
  if (m0.page_size > 0)
    std::fprintf(stderr, "[server] KV pages: %d of %d tokens (%.1f MiB), prefix reuse %s\n", m0.pages_total,
                 m0.page_size, (double)m0.kv_budget_bytes / (1024.0 * 1024.0),
                 m0.prefix_reuse ? "on"
                 : gpu           ? "off (not on the GPU: prompts are prefilled in full, docs/server.md)"
                                 : "off (--no-prefix-reuse)");
  std::fprintf(stderr, "[server] weights: %.1f MiB mapped from %s, paged in at start\n",
               (double)weight_bytes / (1024.0 * 1024.0), p_.model_path.c_str());
  std::fprintf(stderr, "[server] chat template: %s\n",
               template_ ? chat_format_name(template_->format()) : template_note_.c_str());
}

void http_server::run() {
  std::fprintf(stderr, "[server] listening on http://%s:%d\n", p_.host.c_str(), port_);
  std::fflush(stderr);
  http_.listen_after_bind();
}

// The last error message sent on this thread, for the logger: the body it logs from is gzip
// compressed when the client accepts it (the openai clients do).
thread_local std::string t_last_error;

bool http_server::authorized(const httplib::Request& req) const {
  const bool preflight = req.method == "OPTIONS" && !p_.cors_origin.empty();
  return p_.api_key.empty() || req.path == "/health" || preflight ||
         req.get_header_value("Authorization") == "Bearer " + p_.api_key;
}

api_error http_server::unauthorized(const httplib::Request& req) const {
  return api_error(401, req.has_header("Authorization") ? "invalid API key" : "missing API key (Authorization: Bearer KEY)",
                   "authentication_error", "", "invalid_api_key");
}

void http_server::send_error(httplib::Response& res, const api_error& e) const {
  t_last_error = e.what();
  res.status = e.status;
  if (e.status == 503) res.set_header("Retry-After", "1");
  res.set_content(dump(error_body(e)), "application/json");
}

void http_server::routes() {
  // Answered here, before cpp-httplib reads a body: requests that have none. A request with a body
  // goes on to its route (or the 404 / error handler), which first reads the body: answered here,
  // its body would stay in a keep-alive connection and be read as the next request.
  http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    ++http_requests_;
    const bool body = req.has_header("Transfer-Encoding") ||
                      (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0");
    if (!body && !authorized(req)) {
      send_error(res, unauthorized(req));
      return httplib::Server::HandlerResponse::Handled;
    }
    // a POST without Content-Length or chunked encoding has no body (HTTP/1.1); cpp-httplib 0.11
    // would wait for one until its read timeout (30 s)
    if (req.method == "POST" && !req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
      send_error(res, api_error(400,
                                "a POST request needs a JSON body with a Content-Length header (or chunked "
                                "Transfer-Encoding); this one had neither (curl: -d '{...}')",
                                "invalid_request_error", "", "missing_body"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http_.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const api_error& e) {
      send_error(res, e);
    } catch (const error& e) {
      const bool input = e.code() == errc::invalid_input;
      send_error(res, api_error(input ? 400 : 500, e.what(), input ? "invalid_request_error" : "server_error"));
    } catch (const std::exception& e) {
      send_error(res, api_error(500, std::string("internal error: ") + e.what(), "server_error"));
    } catch (...) {
      send_error(res, api_error(500, "internal error", "server_error"));
    }
  });
  http_.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (!authorized(req)) send_error(res, unauthorized(req));  // (a request with a body, no route)
    else if (res.status == 404) send_error(res, api_error(404, "no route " + req.method + " " + req.path, "invalid_request_error", "", "not_found"));
    else if (res.status == 413) {
      // cpp-httplib caps form bodies (curl -d's default type) at 8192 bytes, below the 16 MiB set above
      const bool form = req.get_header_value("Content-Type").find("application/x-www-form-urlencoded") == 0;
      send_error(res, api_error(413, form ? "request body too large for Content-Type application/x-www-form-urlencoded "
                                            "(curl -d's default; at most 8192 bytes): send the JSON body with "
                                            "'Content-Type: application/json' (up to 16 MiB)"
                                          : "request body too large (at most 16 MiB)",
                                "invalid_request_error", "", "payload_too_large"));
    } else send_error(res, api_error(res.status, "HTTP " + std::to_string(res.status), "invalid_request_error"));
  });
  http_.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (res.status < 400) return;
    ++http_errors_;
    std::string msg;
    try {
      msg = json::parse(res.body).at("error").at("message").get<std::string>();
    } catch (...) {
      msg = t_last_error;  // a compressed body
    }
    t_last_error.clear();
    std::fprintf(stderr, "[server] %s %s -> %d %s\n", req.method.c_str(), req.path.c_str(), res.status, msg.c_str());
  });

  if (!p_.cors_origin.empty())
    http_.Options(".*", [](const httplib::Request&, httplib::Response& res) {
      res.status = 204;
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
      res.set_header("Access-Control-Max-Age", "86400");
    });
  // every route but /health checks the key itself too: a request with a body passes the
  // pre-routing check unanswered (above)
  auto guarded = [this](httplib::Server::Handler h) {
    return [this, h](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req)) return send_error(res, unauthorized(req));
      h(req, res);
    };
  };
  auto get = [&](const char* path, httplib::Server::Handler h) { http_.Get(path, guarded(std::move(h))); };
  auto post = [&](const char* path, httplib::Server::Handler h) { http_.Post(path, guarded(std::move(h))); };
  http_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  auto model_object = [this] {
    const auto& hp = model_->hparams();
    return json{{"id", model_id_}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "kvq"},
                {"meta", {{"arch", hp.arch}, {"n_vocab", hp.n_vocab}, {"n_ctx_train", hp.n_ctx_train},
                          {"n_params", hp.n_params}, {"n_ctx", sched_->params().n_ctx}}}};
  };
  get("/v1/models", [=](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump({{"object", "list"}, {"data", json::array({model_object()})}}), "application/json");
  });
  // one model by id (the openai client's models.retrieve), 404 model_not_found for another id
  get("/v1/models/(.+)", [=, this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    if (id != model_id_)
      throw api_error(404, "model " + json_brief(json(id)) + " does not exist; this server serves '" + model_id_ + "'",
                      "invalid_request_error", "model", "model_not_found");
    res.set_content(dump(model_object()), "application/json");
  });
  get("/props", [this](const httplib::Request&, httplib::Response& res) {
    json j = {{"model", model_id_}, {"n_ctx", sched_->params().n_ctx}, {"n_parallel", p_.n_parallel},
              {"kv_cache", sched_->cache_describe()}, {"chat_template", template_text_},
              {"chat_format", template_ ? json(chat_format_name(template_->format())) : json(nullptr)},
              {"bos_token", tok_->bos() >= 0 ? tok_->token_text(tok_->bos()) : ""}};
    res.set_content(dump(j), "application/json");
  });
  get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_json_body(req.body);
    const json& content = required_field(body, "content", &json::is_string, "a string");
    bool add_special = false, with_pieces = false;  // llama-server's defaults (its /tokenize)
    if (body.contains("add_special")) {
      if (!body["add_special"].is_boolean()) fail_request("add_special", "'add_special' must be a boolean", "invalid_type");
      add_special = body["add_special"];
    }
    if (body.contains("with_pieces")) {
      if (!body["with_pieces"].is_boolean()) fail_request("with_pieces", "'with_pieces' must be a boolean", "invalid_type");
      with_pieces = body["with_pieces"];
    }
    bool parse_special = true;  // llama-server's default: "<|im_start|>" in the text is the control token
    if (body.contains("parse_special")) {
      if (!body["parse_special"].is_boolean()) fail_request("parse_special", "'parse_special' must be a boolean", "invalid_type");
      parse_special = body["parse_special"];
    }
    const auto ids = tok_->encode(content.get<std::string>(), add_special && tok_->add_bos_default(), parse_special);
    json tokens = json::array();
    for (int32_t id : ids)
      tokens.push_back(with_pieces ? token_piece_json(id, tok_->token_to_piece(id, /*special=*/true)) : json(id));
    res.set_content(dump({{"tokens", tokens}}), "application/json");
  });
  post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_json_body(req.body);
    std::vector<int32_t> ids;
    for (const json& t : required_field(body, "tokens", &json::is_array, "a list of token ids")) {
      // a whole-valued float is an id (JSON does not tell 5 from 5.0); one beyond 64 bits is out of range
      const auto id = json_to_int64(t);
      const bool whole =
          id || t.is_number_unsigned() || (t.is_number_float() && std::trunc(t.get<double>()) == t.get<double>());
      if (!whole)
        fail_request(
            "tokens",
            "'tokens' must be a list of integer token ids, got " + std::string(t.type_name()) + " " + json_brief(t),
            "invalid_type");
      if (!id || *id < 0 || *id >= tok_->n_vocab())
        fail_request("tokens", "token id " + json_brief(t) + " is not in [0, " + std::to_string(tok_->n_vocab()) + ")", "invalid_value");
      ids.push_back((int32_t)*id);
    }
    res.set_content(dump({{"content", tok_->decode(ids)}}), "application/json");
  });
  post("/apply-template", [this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_json_body(req.body);
    const completion_request r = parse_completion_request(body, true);
    if (!template_) throw api_error(400, template_note_, "invalid_request_error", "", "no_chat_template");
    bool agp = true;
    if (body.contains("add_generation_prompt") && body["add_generation_prompt"].is_boolean()) agp = body["add_generation_prompt"];
    try {
      res.set_content(dump({{"prompt", template_->render(r.messages, agp)}}), "application/json");
    } catch (const error& e) {
      fail_request("messages", e.what(), "invalid_value");
    }
  });
  post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { completion(req, res, false); });
  post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { completion(req, res, true); });
}

void http_server::completion(const httplib::Request& req, httplib::Response& res, bool chat) {
  const completion_request r = parse_completion_request(parse_json_body(req.body), chat);
  seq_request sr;
  if (chat) {
    if (!template_) throw api_error(400, template_note_, "invalid_request_error", "", "no_chat_template");
    std::string prompt;
    try {
      prompt = template_->render(r.messages, true);
    } catch (const error& e) {
      fail_request("messages", e.what(), "invalid_value");
    }
    // A template that writes BOS itself (Gemma's {{ bos_token }}) gets no second one.
    const bool has_bos = !template_->bos_text().empty() && prompt.rfind(template_->bos_text(), 0) == 0;
    sr.prompt = tok_->encode(prompt, !has_bos && tok_->add_bos_default(), true);
  } else if (r.prompt_is_ids) {
    sr.prompt = r.prompt_ids;
  } else {
    sr.prompt = tok_->encode(r.prompt, tok_->add_bos_default(), true);
  }
  sr.max_tokens = r.max_tokens;
  sr.sampling = r.sampling;
  sr.stop = r.stop;
  sr.ignore_eos = r.ignore_eos;
  const int n_prompt = (int)sr.prompt.size();
  std::shared_ptr<seq_job> job;
  try {
    job = sched_->submit(sr);  // throws 400 / 503
  } catch (api_error& e) {
    if (chat && e.param == "prompt") e.param = "messages";  // the rendered messages are the prompt
    throw;
  }

  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + id_prefix_ + std::to_string(next_id_++);
  const int64_t created = unix_now();
  auto finish_reason = [](const seq_update& u) -> json {
    if (u.finish_reason == "stop" || u.finish_reason == "length") return u.finish_reason;
    return u.finish_reason.empty() ? json(nullptr) : json(u.finish_reason);
  };
  auto chunk = [=, this](const json& choice) {
    return json{{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                {"model", model_id_}, {"choices", json::array({choice})}};
  };

  if (!r.stream) {
    auto text = std::make_shared<std::string>();
    auto reply = [=, this](const seq_update& u) {
      json choice = {{"index", 0}, {"finish_reason", finish_reason(u)}, {"logprobs", nullptr}};
      if (chat) choice["message"] = {{"role", "assistant"}, {"content", *text}};
      else choice["text"] = *text;
      return dump(json{{"id", id}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", created},
                       {"model", model_id_}, {"choices", json::array({choice})},
                       {"usage", usage(n_prompt, u.n_generated)}});
    };
    // A reply within a second (or an early failure) keeps its status and Content-Length.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (std::chrono::steady_clock::now() < until) {
      const seq_update u = job->poll(std::chrono::milliseconds(200));
      *text += u.text;
      if (!u.done) continue;
      if (u.finish_reason == "error") throw api_error(500, "generation failed: " + u.error, "server_error");
      res.set_content(reply(u), "application/json");
      return;
    }
    // Longer: a chunked body that sends one space (JSON allows leading whitespace) per poll while
    // generating, so that a client gone (the write fails) cancels the request and frees its slot
    // and pages: cpp-httplib 0.11 cannot tell a handler that its connection closed otherwise. A
    // failure from here on is a 200 with the error body. The type carries its charset so that
    // cpp-httplib does not compress the body for a client sending Accept-Encoding: gzip / br (the
    // openai client does): it compresses exactly "application/json", and its compressor would
    // hold the spaces back, so the write would never fail and the request would run to its end.
    res.set_chunked_content_provider(
        "application/json; charset=utf-8",
        [=](size_t, httplib::DataSink& sink) {
          const seq_update u = job->poll(std::chrono::milliseconds(200));
          *text += u.text;
          if (!u.done) {
            if (!sink.write(" ", 1)) {
              job->cancel();
              return false;
            }
            return true;
          }
          const std::string body =
              u.finish_reason == "error"
                  ? dump(error_body(api_error(500, "generation failed: " + u.error, "server_error")))
                  : reply(u);
          sink.write(body.data(), body.size());
          sink.done();
          return true;
        },
        [job](bool success) {
          if (!success) job->cancel();
        });
    return;
  }

  // Server-sent events: one data line per chunk, then "data: [DONE]". A failed write (client gone)
  // or the connection ending early cancels the request and frees its slot.
  const bool include_usage = r.include_usage;
  auto first = std::make_shared<bool>(true);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [=, this](size_t, httplib::DataSink& sink) {
        auto send = [&](const json& j) {
          const std::string s = "data: " + dump(j) + "\n\n";
          return sink.write(s.data(), s.size());
        };
        if (chat && *first) {  // OpenAI's first chat chunk carries the role
          *first = false;
          if (!send(chunk({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"finish_reason", nullptr}}))) {
            job->cancel();
            return false;
          }
        }
        const seq_update u = job->poll(std::chrono::milliseconds(100));
        if (!u.text.empty()) {
          json choice = {{"index", 0}, {"finish_reason", nullptr}};
          if (chat) choice["delta"] = {{"content", u.text}};
          else choice["text"] = u.text, choice["logprobs"] = nullptr;
          if (!send(chunk(choice))) {
            job->cancel();
            return false;
          }
        } else if (!u.done && !sink.is_writable()) {
          job->cancel();
          return false;
        }
        if (!u.done) return true;
        if (u.finish_reason == "error") {
          api_error e(500, "generation failed: " + u.error, "server_error");
          send(error_body(e));
        } else {
          json choice = {{"index", 0}, {"finish_reason", finish_reason(u)}};
          if (chat) choice["delta"] = json::object();
          else choice["text"] = "", choice["logprobs"] = nullptr;
          send(chunk(choice));
          if (include_usage) {
            json j = chunk(choice);
            j["choices"] = json::array();
            j["usage"] = usage(n_prompt, u.n_generated);
            send(j);
          }
        }
        const std::string done = "data: [DONE]\n\n";
        sink.write(done.data(), done.size());
        sink.done();
        return true;
      },
      [job](bool success) {
        if (!success) job->cancel();
      });
}

void http_server::stop() {
  // Every queued and running request ends with an error its client can read (the streams their
  // error event and [DONE]) before the sockets close: the scheduler ends them on its next turn, the
  // handlers see it within a poll (100 / 200 ms) and write.
  const scheduler_metrics before = sched_->metrics();
  sched_->shut_down("the server is shutting down");
  if (before.active + before.queued > 0) {
    for (int i = 0; i < 100; ++i) {
      const scheduler_metrics m = sched_->metrics();
      if (m.active == 0 && m.queued == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  http_.stop();
}

std::string http_server::metrics_text() const {
  const scheduler_metrics m = sched_->metrics();
  std::string s;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    char num[32];
    std::snprintf(num, sizeof num, "%.17g", v);
    s += std::string("# HELP kvq_") + name + " " + help + "\n# TYPE kvq_" + name + " " + type + "\nkvq_" + name +
         " " + num + "\n";
  };
  metric("http_requests_total", "counter", "HTTP requests received", (double)http_requests_.load());
  metric("http_errors_total", "counter", "HTTP responses with status >= 400", (double)http_errors_.load());
  metric("requests_total", "counter", "generation requests accepted", (double)m.requests);
  metric("requests_finished_total", "counter", "generation requests finished (stop or length)", (double)m.finished);
  metric("requests_cancelled_total", "counter", "generation requests cancelled (client disconnected)", (double)m.cancelled);
  metric("requests_failed_total", "counter", "generation requests ended by an error", (double)m.failed);
  metric("prompt_tokens_total", "counter", "prompt tokens admitted", (double)m.prompt_tokens);
  metric("tokens_generated_total", "counter", "tokens generated", (double)m.generated_tokens);
  metric("steps_total", "counter", "scheduler steps (one forward each)", (double)m.steps);
  metric("batch_tokens_total", "counter", "tokens run through the model", (double)m.batch_tokens);
  metric("batch_tokens_max", "gauge", "most tokens one step has run (--batch-tokens bounds its prompt pieces)", (double)m.batch_tokens_max);
  metric("sequences_active", "gauge", "requests holding a sequence slot", (double)m.active);
  metric("sequences_queued", "gauge", "requests waiting for a slot", (double)m.queued);
  metric("kv_cache_bytes_used", "gauge", "KV cache bytes holding stored positions", (double)m.kv_bytes_used);
  metric("kv_cache_bytes", "gauge", "KV cache bytes allocated", (double)m.kv_bytes);
  metric("kv_budget_bytes", "gauge", "bytes of the KV page pool (--kv-budget; 0: not paged)", (double)m.kv_budget_bytes);
  metric("kv_page_tokens", "gauge", "tokens per KV page (--kv-page; 0: not paged)", (double)m.page_size);
  metric("kv_pages_total", "gauge", "KV pages in the pool", (double)m.pages_total);
  metric("kv_pages_in_use", "gauge", "KV pages held by a sequence", (double)m.pages_in_use);
  metric("kv_pages_cached", "gauge", "KV pages held only by the prefix cache (reclaimable)", (double)m.pages_cached);
  metric("prefix_cache_hits_total", "counter", "requests that reused cached prompt pages", (double)m.prefix_hits);
  metric("prefix_cache_hit_tokens_total", "counter", "prompt tokens reused from cached pages", (double)m.prefix_hit_tokens);
  metric("prefix_cache_bytes", "gauge", "bytes of saved prompt states outside the KV page pool (exact rows, channel statistics, sliding-window rings)", (double)m.prefix_bytes);
  return s;
}

}  // namespace
}  // namespace server_detail

std::unique_ptr<server> server::create(const server_params& p) {
  return std::make_unique<server_detail::http_server>(p);
}

}  // namespace kvq
