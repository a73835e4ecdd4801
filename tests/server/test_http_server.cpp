// kvq server over HTTP, in-process (server::create on 127.0.0.1) and through the kvq binary: the
// listening socket (a second server on a taken port fails instead of sharing it), cancellation of
// a non-streamed request whose client asked for gzip and left, and chat on a model without a chat
// template. Requests are raw HTTP/1.1 over a socket, so that the test controls every header and
// when the connection closes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <thread>

#include "kvq/error.h"
#include "kvq/server.h"
#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

using nlohmann::json;

constexpr const char* kTinylit = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf";

// A connected TCP socket to 127.0.0.1:port (-1 on failure).
int connect_local(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, (sockaddr*)&a, sizeof a) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

void send_all(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += (size_t)n;
  }
}

std::string request_text(const std::string& method, const std::string& path, const std::string& body,
                         const std::string& extra_headers = "") {
  return method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers +
         (body.empty() ? "" : "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n") +
         "\r\n" + body;
}

// One request on its own connection (Connection: close): the status and the raw body.
struct reply {
  int status = 0;
  std::string headers, body;
};
reply http(int port, const std::string& method, const std::string& path, const std::string& body = "",
           const std::string& extra_headers = "", int timeout_s = 0) {
  reply r;
  const int fd = connect_local(port);
  if (fd < 0) return r;
  if (timeout_s > 0) {  // no reply within timeout_s: status 0
    timeval tv{timeout_s, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  send_all(fd, request_text(method, path, body, extra_headers));
  std::string all;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) all.append(buf, (size_t)n);
  ::close(fd);
  const size_t end = all.find("\r\n\r\n");
  if (all.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::stoi(all.substr(9, 3));
  r.headers = all.substr(0, end);
  r.body = all.substr(end + 4);
  return r;
}

// The value of header `name` (case-insensitive) in a reply's header block; nullopt when absent.
std::optional<std::string> header(const reply& r, const std::string& name) {
  std::smatch m;
  if (std::regex_search(r.headers, m, std::regex("\r\n" + name + ": ([^\r]*)", std::regex::icase))) return m[1].str();
  return std::nullopt;
}

// A gauge or counter from GET /metrics (NaN when absent).
double metric(int port, const std::string& name) {
  const reply r = http(port, "GET", "/metrics");
  std::smatch m;
  if (std::regex_search(r.body, m, std::regex("\nkvq_" + name + " (\\S+)\n"))) return std::stod(m[1].str());
  return std::nan("");
}

// The parameters of a test server: the model, 127.0.0.1 on any free port (server::port() tells
// which), one compute thread, n_ctx positions per slot and n_parallel slots; the rest the defaults.
server_params test_server_params(const std::string& model, int n_ctx, int n_parallel = 1) {
  server_params p;
  p.model_path = model;
  p.port = 0;
  p.n_parallel = n_parallel;
  p.n_ctx = n_ctx;
  p.n_threads = 1;
  return p;
}

// A server running on its own thread until the end of the scope.
struct running_server {
  std::unique_ptr<server> srv;
  std::thread thread;
  explicit running_server(const server_params& p) : srv(server::create(p)) {
    thread = std::thread([this] { srv->run(); });
    for (int i = 0; i < 200 && http(port(), "GET", "/health").status != 200; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ~running_server() {
    srv->stop();
    thread.join();
  }
  int port() const { return srv->port(); }
};

// A second server on the port of a running one fails at start-up with "address already in use"
// naming host:port (cpp-httplib 0.11 sets SO_REUSEPORT by default, with which both would bind and
// split the connections), in-process (kvq::error io, exit code 2 in the CLI) and through kvq server
// against a socket of the test's own listening on that port.
TEST(HttpServer, SecondServerOnATakenPortFails) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  const std::unique_ptr<server> first = server::create(p);
  ASSERT_GT(first->port(), 0);
  server_params q = p;
  q.port = first->port();
  const std::string where = "127.0.0.1:" + std::to_string(q.port);
  try {
    const std::unique_ptr<server> second = server::create(q);
    FAIL() << "a second server bound " << where << " beside the first";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::io) << e.what();
    EXPECT_NE(std::string(e.what()).find("cannot listen on " + where + ": address already in use"), std::string::npos)
        << e.what();
  }

  // kvq server against a plain listening socket (SO_REUSEADDR, as most servers set): exit code 2.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  int yes = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, (sockaddr*)&a, sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(getsockname(fd, (sockaddr*)&a, &len), 0);
  const std::string port = std::to_string(ntohs(a.sin_port));
  const test::cmd_result r =
      test::run_cmd({test::kvq_bin(), "server", "-m", model, "--port", port, "-c", "64", "--parallel", "1", "-t", "1"});
  ::close(fd);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("cannot listen on 127.0.0.1:" + port + ": address already in use"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("listening on"), std::string::npos) << r.err;
}

// The most connections waiting to be accepted on this process's socket listening on 127.0.0.1:port
// (TCP_INFO of a listening socket: tcpi_sacked is its backlog on Linux); -1 when none is found.
int listen_backlog(int port) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    int fd = -1;
    try {
      fd = std::stoi(e.path().filename().string());
    } catch (...) { continue; }
    int acc = 0;
    socklen_t len = sizeof acc;
    sockaddr_in a{};
    socklen_t alen = sizeof a;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) continue;
    if (getsockname(fd, (sockaddr*)&a, &alen) != 0 || a.sin_family != AF_INET || ntohs(a.sin_port) != port) continue;
    tcp_info ti{};
    socklen_t tlen = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tlen) != 0) return -1;
    return (int)ti.tcpi_sacked;
  }
  return -1;
}

// The server listens with a backlog for a burst of clients: cpp-httplib 0.11 (Debian's compiled
// library) listens with 5, and 32 streaming clients connecting at once on a busy host overflowed it
// (connections reset or waiting for SYN retries; issue 16's load run). At least --parallel 32 +
// --queue 64 connections can wait (net.core.somaxconn permitting).
TEST(HttpServer, ListenBacklogHoldsABurstOfClients) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  const std::unique_ptr<server> srv = server::create(p);
  int somaxconn = 4096;
  std::ifstream("/proc/sys/net/core/somaxconn") >> somaxconn;
  const int backlog = listen_backlog(srv->port());
  ASSERT_GE(backlog, 0) << "no listening socket on port " << srv->port();
  EXPECT_GE(backlog, std::min(100, somaxconn));
}

// GET /v1/models/{id} (the openai client's models.retrieve) answers the served model and 404
// model_not_found for another id; completion ids differ between two servers started alike (they
// were counters from 1 in every process).
TEST(HttpServer, ModelByIdAndIdsUniqueAcrossStarts) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  p.model_alias = "tiny";
  std::string ids[2];
  for (std::string& id : ids) {
    running_server s(p);
    const reply m = http(s.port(), "GET", "/v1/models/tiny");
    ASSERT_EQ(m.status, 200) << m.body;
    EXPECT_EQ(json::parse(m.body).value("id", ""), "tiny");
    const reply other = http(s.port(), "GET", "/v1/models/gpt-4");
    EXPECT_EQ(other.status, 404) << other.body;
    EXPECT_EQ(json::parse(other.body, nullptr, false)["error"].value("code", ""), "model_not_found") << other.body;
    const reply c = http(s.port(), "POST", "/v1/completions", R"({"prompt":"hi","max_tokens":1})");
    ASSERT_EQ(c.status, 200) << c.body;
    id = json::parse(c.body).value("id", "");
    EXPECT_EQ(id.rfind("cmpl-", 0), 0u) << id;
  }
  EXPECT_NE(ids[0], ids[1]);
}

// A --chat-template-file kvq does not render stops the server at start-up naming the file, what the
// template holds and the formats kvq renders (not "--chat-template-file takes another template").
TEST(HttpServer, RejectedChatTemplateFileSaysWhatIsSupported) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  const std::string file = ::testing::TempDir() + "kvq_llama3_template.jinja";
  {
    std::ofstream f(file);
    f << "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
         "{% endfor %}";
  }
  server_params p = test_server_params(model, 64);
  p.chat_template_file = file;
  try {
    server::create(p);
    FAIL() << "the template was accepted";
  } catch (const error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), errc::unsupported) << msg;
    EXPECT_NE(msg.find("[server] --chat-template-file '" + file + "': "), std::string::npos) << msg;
    EXPECT_NE(msg.find("found <|start_header_id|> (Llama 3)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("kvq renders two formats"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("takes another template text"), std::string::npos) << msg;
  }
  std::remove(file.c_str());
}

// A non-streamed request whose client sends Accept-Encoding: gzip (the openai client does) and
// hangs up while it generates is cancelled and its pages freed, as without gzip: the space the
// server writes every 200 ms must reach the socket (a compressed body would buffer it, the write
// would never fail, and the request would run all its tokens). Reference: /metrics' counters.
TEST(HttpServer, NonStreamedGzipClientThatLeavesIsCancelled) {
  KVQ_REQUIRE_MODEL(model, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
  server_params p = test_server_params(model, 1024);
  running_server s(p);
  const int max_tokens = 600;  // far more than this host generates in the test's seconds
  const std::string body = json{{"prompt", "def fibonacci(n):"}, {"max_tokens", max_tokens}, {"ignore_eos", true}}.dump();
  const int fd = connect_local(s.port());
  ASSERT_GE(fd, 0);
  send_all(fd, request_text("POST", "/v1/completions", body, "Accept-Encoding: gzip, deflate, br\r\n"));
  // Past the first second the reply is chunked: read its headers, then hang up mid-body.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  char buf[1024];
  const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  const std::string head = n > 0 ? std::string(buf, (size_t)n) : "";
  EXPECT_NE(head.find("Transfer-Encoding: chunked"), std::string::npos) << head;
  EXPECT_EQ(head.find("Content-Encoding"), std::string::npos) << head;
  EXPECT_EQ(metric(s.port(), "sequences_active"), 1);
  ::close(fd);
  double cancelled = 0, active = 1;
  for (int i = 0; i < 100 && (cancelled != 1 || active != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cancelled = metric(s.port(), "requests_cancelled_total");
    active = metric(s.port(), "sequences_active");
  }
  EXPECT_EQ(cancelled, 1);
  EXPECT_EQ(active, 0);
  EXPECT_EQ(metric(s.port(), "requests_finished_total"), 0);
  EXPECT_LT(metric(s.port(), "tokens_generated_total"), max_tokens);
  EXPECT_EQ(metric(s.port(), "kv_pages_in_use"), 0);
}

// Stopping the server (SIGINT / SIGTERM) while requests run: a stream ends with its error event
// and [DONE], a non-streamed request gets its error body (valid JSON), a new request 503 or a refused
// connection; the stream was cut with neither before.
TEST(HttpServer, StopEndsRunningRequestsWithAnError) {
  KVQ_REQUIRE_MODEL(model, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");  // slow enough to stop mid-way
  server_params p = test_server_params(model, 1024, 2);
  running_server s(p);
  const std::string body =
      R"({"prompt":"Once upon a time","max_tokens":1000,"ignore_eos":true,"temperature":0,"stream":true})";
  const int fd = connect_local(s.port());
  ASSERT_GE(fd, 0);
  send_all(fd, request_text("POST", "/v1/completions", body));
  std::string got;
  char buf[4096];
  while (got.find("data: {") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, (size_t)n);
  }
  std::string plain_body;
  std::thread plain([&] {
    std::string b = body;
    b.replace(b.find(R"("stream":true)"), 13, R"("stream":false)");
    plain_body = http(s.port(), "POST", "/v1/completions", b).body;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  s.srv->stop();
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) got.append(buf, (size_t)n);
  ::close(fd);
  plain.join();
  EXPECT_NE(got.find("the server is shutting down"), std::string::npos) << got.substr(got.size() - std::min<size_t>(got.size(), 400));
  EXPECT_NE(got.find("data: [DONE]"), std::string::npos);
  const json pj = json::parse(plain_body, nullptr, false);
  ASSERT_FALSE(pj.is_discarded()) << plain_body;
  EXPECT_NE(pj["error"].value("message", "").find("the server is shutting down"), std::string::npos) << plain_body;
}

// A request cut by the context (finish_reason "length", max_tokens beyond it or absent) fills the
// context and no more: usage.prompt_tokens + completion_tokens == n_ctx, non-streamed and streamed
// (its usage chunk); it counted n_ctx + 1, the token sampled from the last position. Prompts of
// several lengths (a 63-token one leaves one token), as /tokenize counts them.
TEST(HttpServer, UsageWithinTheContextWhenCutByIt) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  running_server s(p);
  for (const int n_prompt : {1, 5, 40, 63}) {
    json ids = json::array();
    for (int i = 0; i < n_prompt; ++i) ids.push_back(10 + 7 * i);
    for (const bool stream : {false, true}) {
      json req = {{"prompt", ids}, {"max_tokens", 500}, {"temperature", 0}, {"ignore_eos", true}};
      if (stream) req["stream"] = true, req["stream_options"] = {{"include_usage", true}};
      const reply r = http(s.port(), "POST", "/v1/completions", req.dump());
      ASSERT_EQ(r.status, 200) << r.body;
      json reply_json, usage;
      if (stream) {  // the last data event before [DONE] carries usage; the one before it finish_reason
        std::vector<json> events;
        for (size_t at = r.body.find("data: {"); at != std::string::npos; at = r.body.find("data: {", at + 1))
          events.push_back(json::parse(r.body.substr(at + 6, r.body.find('\n', at) - at - 6)));
        ASSERT_GE(events.size(), 2u) << r.body;
        usage = events.back()["usage"];
        reply_json = events[events.size() - 2];
      } else {
        reply_json = json::parse(r.body);
        usage = reply_json["usage"];
      }
      EXPECT_EQ(reply_json["choices"][0]["finish_reason"], "length") << r.body;
      EXPECT_EQ(usage.value("prompt_tokens", -1), n_prompt) << usage;
      EXPECT_EQ(usage.value("prompt_tokens", 0) + usage.value("completion_tokens", 0), p.n_ctx)
          << "prompt " << n_prompt << (stream ? " streamed: " : ": ") << usage;
      EXPECT_EQ(usage.value("total_tokens", 0), p.n_ctx) << usage;
    }
  }
  // without max_tokens (a completion's default is 16) and a prompt of 60: cut at the context too
  json ids = json::array();
  for (int i = 0; i < 60; ++i) ids.push_back(10 + 7 * i);
  const reply r = http(s.port(), "POST", "/v1/completions", json{{"prompt", ids}, {"ignore_eos", true}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["usage"].value("completion_tokens", -1), 4) << r.body;
}

// CORS for browser UIs (as llama-server): every response, errors included, carries
// Access-Control-Allow-Origin (default "*", or the configured origin), and an OPTIONS preflight to a
// /v1 route answers 204 with the methods and headers a page may use, without the API key (a browser
// sends the preflight without credentials). cors_origin "" turns it off: no header, and a
// preflight is an ordinary unauthenticated request (401 with a key, 404 without one).
TEST(HttpServer, CorsHeadersAndPreflight) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  p.api_key = "secret";
  const std::string key = "Authorization: Bearer secret\r\n";
  const std::string preflight =
      "Origin: http://localhost:5173\r\nAccess-Control-Request-Method: POST\r\n"
      "Access-Control-Request-Headers: authorization, content-type\r\n";
  const std::string completion = R"({"prompt":"hi","max_tokens":1})";
  for (const std::string origin : {"*", "http://localhost:5173"}) {
    p.cors_origin = origin;
    running_server s(p);
    for (const char* path : {"/v1/chat/completions", "/v1/completions", "/v1/models"}) {
      const reply o = http(s.port(), "OPTIONS", path, "", preflight);
      EXPECT_EQ(o.status, 204) << path << ": " << o.headers;
      EXPECT_EQ(header(o, "Access-Control-Allow-Origin"), origin) << o.headers;
      const std::string methods = header(o, "Access-Control-Allow-Methods").value_or("");
      EXPECT_NE(methods.find("POST"), std::string::npos) << o.headers;
      EXPECT_NE(methods.find("GET"), std::string::npos) << o.headers;
      const std::string allowed = header(o, "Access-Control-Allow-Headers").value_or("");
      EXPECT_NE(allowed.find("Authorization"), std::string::npos) << o.headers;
      EXPECT_NE(allowed.find("Content-Type"), std::string::npos) << o.headers;
      EXPECT_EQ(o.body, "");
    }
    const reply ok = http(s.port(), "POST", "/v1/completions", completion, key);
    EXPECT_EQ(ok.status, 200) << ok.body;
    EXPECT_EQ(header(ok, "Access-Control-Allow-Origin"), origin) << ok.headers;
    const reply denied = http(s.port(), "POST", "/v1/completions", completion);
    EXPECT_EQ(denied.status, 401) << denied.body;
    EXPECT_EQ(header(denied, "Access-Control-Allow-Origin"), origin) << denied.headers;
    const reply stream =
        http(s.port(), "POST", "/v1/completions", R"({"prompt":"hi","max_tokens":2,"stream":true})", key);
    EXPECT_EQ(stream.status, 200) << stream.body;
    EXPECT_EQ(header(stream, "Access-Control-Allow-Origin"), origin) << stream.headers;
  }
  p.cors_origin = "";
  {
    running_server s(p);
    const reply o = http(s.port(), "OPTIONS", "/v1/chat/completions", "", preflight);
    EXPECT_EQ(o.status, 401) << o.headers;
    EXPECT_FALSE(header(o, "Access-Control-Allow-Origin")) << o.headers;
    EXPECT_FALSE(header(o, "Access-Control-Allow-Methods")) << o.headers;
    const reply ok = http(s.port(), "POST", "/v1/completions", completion, key);
    EXPECT_EQ(ok.status, 200) << ok.body;
    EXPECT_FALSE(header(ok, "Access-Control-Allow-Origin")) << ok.headers;
  }
  p.api_key = "";
  {
    running_server s(p);
    EXPECT_EQ(http(s.port(), "OPTIONS", "/v1/chat/completions", "", preflight).status, 404);
  }
  p.cors_origin = "http://a\r\nSet-Cookie: x=1";
  EXPECT_THROW(server::create(p), error);
}

// A refused key on a keep-alive connection: the request's body is read with it, so the next request
// on the connection is answered as itself (the body was left unread and parsed as the next request,
// which got "400 HTTP 400", or 414 for a long body: found by a new user with the openai client, whose
// second call after a 401 failed). The body arrives after the headers, as httpx sends it. A GET with
// a body and no key is refused too (the key is checked on the route as well as before routing).
TEST(HttpServer, RefusedKeyLeavesTheConnectionInStep) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  server_params p = test_server_params(model, 64);
  p.api_key = "secret";
  running_server s(p);
  // one reply read from fd: the status line and the body (by its Content-Length); "" when none came
  auto read_reply = [](int fd) -> std::pair<std::string, std::string> {
    std::string buf;
    char c[4096];
    size_t end;
    while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
      const ssize_t n = ::recv(fd, c, sizeof c, 0);
      if (n <= 0) return {"", buf};
      buf.append(c, (size_t)n);
    }
    std::smatch m;
    const std::string head = buf.substr(0, end);
    if (!std::regex_search(head, m, std::regex("Content-Length: (\\d+)", std::regex::icase))) return {head, ""};
    const size_t len = std::stoul(m[1].str());
    std::string body = buf.substr(end + 4);
    while (body.size() < len) {
      const ssize_t n = ::recv(fd, c, sizeof c, 0);
      if (n <= 0) break;
      body.append(c, (size_t)n);
    }
    return {head.substr(0, head.find("\r\n")), body};
  };
  for (const size_t body_bytes : {(size_t)40, (size_t)15000}) {
    const std::string body = R"({"prompt":")" + std::string(body_bytes, 'a') + R"(","max_tokens":1})";
    const int fd = connect_local(s.port());
    ASSERT_GE(fd, 0);
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n"
                 "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    send_all(fd, body);
    const auto [status1, body1] = read_reply(fd);
    EXPECT_EQ(status1, "HTTP/1.1 401 Unauthorized") << body_bytes;
    EXPECT_NE(body1.find("invalid API key"), std::string::npos) << body1;
    send_all(fd, "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");  // the same connection
    const auto [status2, body2] = read_reply(fd);
    ::close(fd);
    EXPECT_EQ(status2, "HTTP/1.1 200 OK") << body_bytes << " bytes of body before: " << body2.substr(0, 200);
    EXPECT_EQ(body2, R"({"status":"ok"})");
  }
  const reply m = http(s.port(), "GET", "/metrics", "{}");
  EXPECT_EQ(m.status, 401) << m.body.substr(0, 200);
  const reply r = http(s.port(), "POST", "/no/such/route", "{}");
  EXPECT_EQ(r.status, 401) << r.body;
}

// Chat on a model without a chat template (Gemma 3 270M base) is the client's error, 400
// invalid_request_error (a 5xx would be retried by the openai client), saying how to give one; the
// model still serves completions.
// /detokenize refuses an id that is not an integer as a wrong type (it said "token id 1.5 is not in
// [0, n_vocab)", which 1.5 is), and an integer outside the vocabulary as a wrong value; the ids
// /tokenize gives come back as the text.
TEST(HttpServer, DetokenizeTellsAWrongTypeFromAnIdOutsideTheVocabulary) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  running_server s(test_server_params(model, 64));
  const reply t = http(s.port(), "POST", "/tokenize", R"({"content":"Once upon a time"})");
  ASSERT_EQ(t.status, 200) << t.body;
  const json ids = json::parse(t.body)["tokens"];
  const reply back = http(s.port(), "POST", "/detokenize", json({{"tokens", ids}}).dump());
  ASSERT_EQ(back.status, 200) << back.body;
  // (the vocabulary's pieces: a leading space from SentencePiece's space prefix)
  EXPECT_NE(json::parse(back.body)["content"].get<std::string>().find("Once upon a time"), std::string::npos)
      << back.body;
  // the same ids as whole-valued floats (JSON does not tell 5 from 5.0) give the same text
  json float_ids = json::array();
  for (const json& id : ids) float_ids.push_back((double)id.get<int64_t>());
  ASSERT_TRUE(float_ids[0].is_number_float());
  const reply back_f = http(s.port(), "POST", "/detokenize", json({{"tokens", float_ids}}).dump());
  ASSERT_EQ(back_f.status, 200) << back_f.body;
  EXPECT_EQ(json::parse(back_f.body)["content"], json::parse(back.body)["content"]);
  const json n_vocab = json::parse(http(s.port(), "GET", "/v1/models", "").body)["data"][0]["meta"]["n_vocab"];
  struct bad {
    json id;
    const char* code;
  };
  for (const bad& c :
       {bad{1.5, "invalid_type"}, bad{"a", "invalid_type"}, bad{true, "invalid_type"},
        bad{json::array({1}), "invalid_type"}, bad{-1, "invalid_value"}, bad{n_vocab, "invalid_value"},
        bad{-1.0, "invalid_value"}, bad{1e19, "invalid_value"}, bad{(uint64_t)1 << 63, "invalid_value"}}) {
    const reply r = http(s.port(), "POST", "/detokenize", json({{"tokens", {1, c.id}}}).dump());
    EXPECT_EQ(r.status, 400) << c.id << ": " << r.body;
    const json e = json::parse(r.body, nullptr, false).value("error", json::object());
    EXPECT_EQ(e.value("code", ""), c.code) << c.id << ": " << r.body;
    EXPECT_EQ(e.value("param", ""), "tokens") << r.body;
    const std::string msg = e.value("message", "");
    EXPECT_EQ(msg.find("is not in [0, ") != std::string::npos, std::string(c.code) == "invalid_value") << msg;
  }
  // a body without the field says it is missing (as a completion without 'prompt'), a field of the
  // wrong type says so
  struct shape {
    const char *path, *body, *param, *code;
  };
  for (const shape& c : {shape{"/tokenize", "{}", "content", "missing_field"},
                         shape{"/tokenize", R"({"content":7})", "content", "invalid_type"},
                         shape{"/tokenize", "[]", "content", "invalid_type"},
                         shape{"/detokenize", "{}", "tokens", "missing_field"},
                         shape{"/detokenize", R"({"tokens":"1 2"})", "tokens", "invalid_type"}}) {
    const reply r = http(s.port(), "POST", c.path, c.body);
    EXPECT_EQ(r.status, 400) << c.path << " " << c.body << ": " << r.body;
    const json e = json::parse(r.body, nullptr, false).value("error", json::object());
    EXPECT_EQ(e.value("code", ""), c.code) << c.path << " " << c.body << ": " << r.body;
    EXPECT_EQ(e.value("param", ""), c.param) << r.body;
  }
}

// A POST without a body (curl -X POST without -d: no Content-Length) is refused before routing,
// at once; the 400 says what is missing (it said "HTTP 400", code null, and came after cpp-httplib's
// 30 s read timeout). With a Content-Length of 0 the route answers (invalid JSON).
TEST(HttpServer, PostWithoutABodySaysSo) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  running_server s(test_server_params(model, 64));
  for (const char* path : {"/v1/completions", "/tokenize"}) {
    const reply r = http(s.port(), "POST", path, "", "", 10);  // (it waited for cpp-httplib's 30 s read timeout)
    EXPECT_EQ(r.status, 400) << path << ": " << r.body;
    const json e = json::parse(r.body, nullptr, false).value("error", json::object());
    EXPECT_EQ(e.value("code", json()), "missing_body") << r.body;
    EXPECT_NE(e.value("message", "").find("Content-Length"), std::string::npos) << r.body;
  }
  const reply empty = http(s.port(), "POST", "/v1/completions", "", "Content-Length: 0\r\n");
  EXPECT_EQ(empty.status, 400) << empty.body;
  EXPECT_EQ(json::parse(empty.body, nullptr, false).value("error", json::object()).value("code", json()),
            "invalid_json")
      << empty.body;
}

TEST(HttpServer, ChatWithoutATemplateIs400) {
  KVQ_REQUIRE_MODEL(model, "gemma-3-270m-q4_k_m.gguf");
  server_params p = test_server_params(model, 128);
  running_server s(p);
  const std::string msgs = R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2})";
  for (const char* path : {"/v1/chat/completions", "/apply-template"}) {
    const reply r = http(s.port(), "POST", path, msgs);
    EXPECT_EQ(r.status, 400) << path << ": " << r.body;
    const json e = json::parse(r.body, nullptr, false).value("error", json::object());
    EXPECT_EQ(e.value("type", ""), "invalid_request_error") << r.body;
    EXPECT_EQ(e.value("code", ""), "no_chat_template") << r.body;
    const std::string msg = e.value("message", "");
    EXPECT_NE(msg.find("has no chat template"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--chat-template-file"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/v1/completions"), std::string::npos) << msg;
  }
  const reply c = http(s.port(), "POST", "/v1/completions", R"({"prompt":"hi","max_tokens":2,"temperature":0})");
  EXPECT_EQ(c.status, 200) << c.body;
  // /props answers 200 saying there is no template (chat_format null, chat_template "") rather than a 500
  const reply props = http(s.port(), "GET", "/props", "");
  ASSERT_EQ(props.status, 200) << props.body;
  const json pj = json::parse(props.body, nullptr, false);
  EXPECT_TRUE(pj.value("chat_format", json(0)).is_null()) << props.body;
  EXPECT_EQ(pj.value("chat_template", json(0)), "") << props.body;
}

}  // namespace
}  // namespace kvq
