#include "server/api.h"

#include <cmath>

namespace kvq::server_detail {

using nlohmann::json;

void fail_request(const std::string& param, const std::string& message, const std::string& code) {
  throw api_error(400, message, "invalid_request_error", param, code);
}

json error_body(const api_error& e) {
  json err = {{"message", e.what()}, {"type", e.type}, {"param", nullptr}, {"code", nullptr}};
  if (!e.param.empty()) err["param"] = e.param;
  if (!e.code.empty()) err["code"] = e.code;
  return {{"error", err}};
}

std::optional<int64_t> json_to_int64(const json& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t)INT64_MAX) return std::nullopt;
    return v.get<int64_t>();
  }
  if (!v.is_number_float()) return std::nullopt;
  const double d = v.get<double>();
  // (-2^63, 2^63): every whole double in it converts exactly. -2^63 itself is left out: it is also
  // what the literal -9223372036854775809 (below the range) rounds to; as an integer literal it parses.
  if (!std::isfinite(d) || std::trunc(d) != d || d <= -0x1p63 || d >= 0x1p63) return std::nullopt;
  return (int64_t)d;
}

json parse_json_body(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail_request("", std::string("request body is not valid JSON: ") + e.what(), "invalid_json");
  }
}

namespace {

const char* type_name(const json& v) { return v.type_name(); }

// The field when present and not null.
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t get_int(const json& v, const char* key) {
  // An integer literal beyond 64 bits reaches here as unsigned (up to 2^64 - 1) or, past that and
  // below -2^63, as a float (nlohmann-json): both are out of the range, not of the wrong type.
  const bool whole_float =
      v.is_number_float() && std::isfinite(v.get<double>()) && std::trunc(v.get<double>()) == v.get<double>();
  if ((v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t)INT64_MAX) ||
      (whole_float && !json_to_int64(v).has_value()))
    fail_request(key,
                 std::string("'") + key +
                     "' must be a 64-bit integer, in [-9223372036854775808, 9223372036854775807], got " + json_brief(v),
                 "invalid_value");
  if (const auto i = json_to_int64(v)) return *i;
  fail_request(key, std::string("'") + key + "' must be an integer, got " + type_name(v) + " " + json_brief(v),
               "invalid_type");
}

double get_number(const json& v, const char* key) {
  if (!v.is_number())
    fail_request(key, std::string("'") + key + "' must be a number, got " + type_name(v) + " " + json_brief(v), "invalid_type");
  return v.get<double>();
}

bool get_bool(const json& v, const char* key) {
  if (!v.is_boolean())
    fail_request(key, std::string("'") + key + "' must be a boolean, got " + type_name(v) + " " + json_brief(v), "invalid_type");
  return v.get<bool>();
}

chat_message parse_message(const json& m, size_t i) {
  const std::string where = "messages[" + std::to_string(i) + "]";
  if (!m.is_object()) fail_request(where, where + " must be an object, got " + type_name(m), "invalid_type");
  chat_message r;
  // a field left out is missing (as 'prompt' / 'messages' are); one of the wrong type, null included, says so
  const auto role = m.find("role");
  if (role == m.end()) fail_request(where + ".role", where + ".role is required", "missing_field");
  if (!role->is_string())
    fail_request(where + ".role", where + ".role must be a string, got " + type_name(*role), "invalid_type");
  r.role = role->get<std::string>();
  if (r.role != "system" && r.role != "user" && r.role != "assistant" && r.role != "developer")
    fail_request(where + ".role",
                 where + ".role '" + r.role + "' is not supported (system, developer, user, assistant)",
                 "invalid_value");
  if (r.role == "developer") r.role = "system";  // OpenAI's newer name for the system role
  if (const json* tc = field(m, "tool_calls"); tc && !(tc->is_array() && tc->empty()))
    fail_request(where + ".tool_calls", "'" + where + ".tool_calls' is not supported by kvq server (no tool calling)",
                 "unsupported_parameter");
  const json* content = field(m, "content");
  if (!content && r.role == "assistant") {  // OpenAI allows an assistant turn without content (null)
    r.parts = {std::string()};
    return r;
  }
  if (!m.contains("content")) fail_request(where + ".content", where + ".content is required", "missing_field");
  if (!content)
    fail_request(where + ".content", where + ".content must be a string or a list of text parts, got null",
                 "invalid_type");
  if (content->is_string()) {
    r.parts = {content->get<std::string>()};
  } else if (content->is_array()) {
    r.content_is_string = false;
    for (size_t j = 0; j < content->size(); ++j) {
      const json& part = (*content)[j];
      const std::string pw = where + ".content[" + std::to_string(j) + "]";
      const json* type = part.is_object() ? field(part, "type") : nullptr;
      const json* text = part.is_object() ? field(part, "text") : nullptr;
      if (!type || *type != "text" || !text || !text->is_string())
        fail_request(pw, pw + " must be {\"type\": \"text\", \"text\": string} (only text parts are supported)",
                     "invalid_value");
      r.parts.push_back(text->get<std::string>());
    }
    if (r.parts.empty()) fail_request(where + ".content", where + ".content is an empty list", "invalid_value");
  } else {
    fail_request(where + ".content", where + ".content must be a string or a list of text parts, got " +
                                         type_name(*content), "invalid_type");
  }
  return r;
}

// Refuses an OpenAI field kvq server does not implement unless it holds the neutral value clients
// send by default (null always; `neutral` says which others), so that a request is never answered
// as if the field had been applied (vLLM and llama-server refuse missing features the same way).
void refuse_unless(const json& body, const char* key, bool (*neutral)(const json&), const char* accepted) {
  const json* v = field(body, key);
  if (!v || neutral(*v)) return;
  const std::string shown = json_brief(*v);
  fail_request(key, std::string("'") + key + "' is not supported by kvq server (got " + shown +
                        "); leave it out or send " + accepted, "unsupported_parameter");
}

bool is_false(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool is_zero(const json& v) { return v.is_number() && v.get<double>() == 0; }
bool is_one(const json& v) { return v.is_number() && v.get<double>() == 1; }
bool is_empty_object(const json& v) { return v.is_object() && v.empty(); }
bool is_empty_array(const json& v) { return v.is_array() && v.empty(); }
bool is_empty_string(const json& v) { return v.is_string() && v.get<std::string>().empty(); }
bool is_text_format(const json& v) { return v.is_object() && v.value("type", json()) == "text"; }
bool is_no_tool_choice(const json& v) { return v == "none" || v == "auto"; }

// The OpenAI fields kvq server does not implement (docs/server.md, "Request fields").
void refuse_unsupported(const json& body, bool chat) {
  refuse_unless(body, "presence_penalty", is_zero, "0");
  refuse_unless(body, "frequency_penalty", is_zero, "0");
  refuse_unless(body, "logit_bias", is_empty_object, "null or {}");
  refuse_unless(body, "logprobs", is_false, "null or false");
  if (chat) {
    refuse_unless(body, "top_logprobs", is_zero, "null or 0");
    refuse_unless(body, "response_format", is_text_format, "null or {\"type\": \"text\"}");
    refuse_unless(body, "tools", is_empty_array, "null or []");
    refuse_unless(body, "tool_choice", is_no_tool_choice, "null, \"none\" or \"auto\"");
    refuse_unless(body, "functions", is_empty_array, "null or []");
    refuse_unless(body, "function_call", is_no_tool_choice, "null, \"none\" or \"auto\"");
  } else {
    refuse_unless(body, "echo", is_false, "null or false");
    refuse_unless(body, "best_of", is_one, "null or 1");
    refuse_unless(body, "suffix", is_empty_string, "null or \"\"");
  }
}

}  // namespace

completion_request parse_completion_request(const json& body, bool chat) {
  if (!body.is_object())
    fail_request("", std::string("request body must be a JSON object, got ") + type_name(body), "invalid_type");
  completion_request r;
  r.chat = chat;
  if (chat) {
    const json* msgs = field(body, "messages");
    if (!msgs) fail_request("messages", "'messages' is required", "missing_field");
    if (!msgs->is_array()) fail_request("messages", std::string("'messages' must be a list, got ") + type_name(*msgs), "invalid_type");
    if (msgs->empty()) fail_request("messages", "'messages' must not be empty", "invalid_value");
    for (size_t i = 0; i < msgs->size(); ++i) r.messages.push_back(parse_message((*msgs)[i], i));
  } else {
    const json* p = field(body, "prompt");
    if (!p) fail_request("prompt", "'prompt' is required", "missing_field");
    // token ids: a list of numbers, or one such list in a list (OpenAI's list of token lists)
    const json* ids = nullptr;
    if (p->is_array() && !p->empty() && (*p)[0].is_number()) ids = p;
    else if (p->is_array() && p->size() == 1 && (*p)[0].is_array() && !(*p)[0].empty() && (*p)[0][0].is_number())
      ids = &(*p)[0];
    if (p->is_string()) {
      r.prompt = p->get<std::string>();
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
      r.prompt = (*p)[0].get<std::string>();
    } else if (ids) {
      r.prompt_is_ids = true;
      for (const json& t : *ids) {
        const auto id = json_to_int64(t);
        if (!id || *id < 0 || *id > INT32_MAX)
          fail_request("prompt", "'prompt' token ids must be non-negative integers, got " + json_brief(t), "invalid_value");
        r.prompt_ids.push_back((int32_t)*id);
      }
    } else if (p->is_array() && p->empty()) {
      fail_request("prompt", "'prompt' is an empty list (give a string or a list of token ids)", "invalid_value");
    } else if (p->is_array() && p->size() > 1) {
      fail_request("prompt", "'prompt' as a list of " + std::to_string(p->size()) +
                                 " prompts is not supported (one prompt per request)", "invalid_value");
    } else {
      fail_request("prompt", std::string("'prompt' must be a string or a list of token ids, got ") + type_name(*p) +
                                 " " + json_brief(*p), "invalid_type");
    }
  }
  refuse_unsupported(body, chat);
  // Chat: max_completion_tokens, OpenAI's newer name, wins over the deprecated max_tokens when both
  // are given (as OpenAI and vLLM take them).
  const json* mt = field(body, "max_tokens");
  const char* mt_name = "max_tokens";
  if (const json* mct = chat ? field(body, "max_completion_tokens") : nullptr) mt = mct, mt_name = "max_completion_tokens";
  if (mt) {
    const int64_t v = get_int(*mt, mt_name);
    if (v < 1) fail_request(mt_name, std::string("'") + mt_name + "' must be >= 1, got " + std::to_string(v), "invalid_value");
    r.max_tokens = (int)std::min<int64_t>(v, INT32_MAX);
  } else if (!chat) {
    r.max_tokens = 16;  // OpenAI's default for completions
  }
  if (const json* n = field(body, "n")) {
    const int64_t v = get_int(*n, "n");
    if (v != 1) fail_request("n", "'n' must be 1 (kvq server returns one choice), got " + std::to_string(v), "invalid_value");
  }
  // OpenAI's ranges where OpenAI has the field (temperature [0, 2], top_p (0, 1], seed any 64-bit
  // integer); llama-server's meanings for its own (top_k, min_p). docs/server.md, "Request fields".
  if (const json* v = field(body, "temperature")) {
    const double t = get_number(*v, "temperature");
    if (!(t >= 0 && t <= 2))
      fail_request("temperature", "'temperature' must be in [0, 2] (0: greedy), got " + json_brief(*v),
                   "invalid_value");
    r.sampling.temp = (float)t;
  }
  if (const json* v = field(body, "top_p")) {
    const double t = get_number(*v, "top_p");
    if (!(t > 0 && t <= 1)) fail_request("top_p", "'top_p' must be in (0, 1], got " + json_brief(*v), "invalid_value");
    r.sampling.top_p = (float)t;
  }
  if (const json* v = field(body, "top_k")) {
    const int64_t k = get_int(*v, "top_k");
    if (k < -1)
      fail_request("top_k", "'top_k' must be >= 1, or 0 or -1 for no top-k cut, got " + std::to_string(k),
                   "invalid_value");
    r.sampling.top_k = (int)std::min<int64_t>(k, INT32_MAX);
  }
  if (const json* v = field(body, "min_p")) {
    const double t = get_number(*v, "min_p");
    if (!(t >= 0 && t <= 1)) fail_request("min_p", "'min_p' must be in [0, 1], got " + json_brief(*v), "invalid_value");
    r.sampling.min_p = (float)t;
  }
  if (const json* v = field(body, "seed")) {
    // any 64-bit integer, as OpenAI takes it; -1 (llama-server's) and 4294967295 (llama.cpp's
    // LLAMA_DEFAULT_SEED) draw a random seed; a negative one is its two's complement
    r.sampling.seed = sampling_seed(get_int(*v, "seed"));
  }
  if (const json* v = field(body, "stop")) {
    if (v->is_string()) {
      r.stop = {v->get<std::string>()};
    } else if (v->is_array()) {
      for (const json& s : *v) {
        if (!s.is_string()) fail_request("stop", "'stop' entries must be strings, got " + json_brief(s), "invalid_type");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      fail_request("stop", std::string("'stop' must be a string or a list of strings, got ") + type_name(*v), "invalid_type");
    }
    if (r.stop.size() > 4) fail_request("stop", "'stop' has " + std::to_string(r.stop.size()) + " strings, at most 4", "invalid_value");
    for (const auto& s : r.stop)
      if (s.empty()) fail_request("stop", "'stop' strings must not be empty", "invalid_value");
  }
  if (const json* v = field(body, "stream")) r.stream = get_bool(*v, "stream");
  if (const json* v = field(body, "stream_options")) {
    if (!v->is_object()) fail_request("stream_options", "'stream_options' must be an object", "invalid_type");
    if (const json* u = field(*v, "include_usage")) r.include_usage = get_bool(*u, "stream_options.include_usage");
    // OpenAI and vLLM refuse it on a request that does not stream rather than ignore it (a client
    // asking for usage chunks would otherwise get a plain reply it did not ask for); null is absent
    if (!r.stream)
      fail_request("stream_options", "'stream_options' is only allowed with \"stream\": true; leave it out, or stream",
                   "invalid_value");
  }
  if (const json* v = field(body, "ignore_eos")) r.ignore_eos = get_bool(*v, "ignore_eos");
  return r;
}

size_t utf8_incomplete_tail(const std::string& s) {
  // Walk back over at most 3 continuation bytes to a lead byte; incomplete if the lead announces
  // more bytes than are present.
  const size_t n = s.size();
  for (size_t k = 1; k <= std::min<size_t>(4, n); ++k) {
    const unsigned char c = (unsigned char)s[n - k];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > k ? k : 0;
  }
  return 0;
}

bool utf8_valid(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = b[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) len = 1, cp = c;
    else if (c >= 0xC2 && c < 0xE0) len = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c < 0xF0) len = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c < 0xF5) len = 4, cp = c & 0x07;
    else return false;  // a continuation byte, C0 / C1 (overlong) or F5..FF
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((b[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp < 0xE000))
      return false;
    i += len;
  }
  return true;
}

json token_piece_json(int32_t id, const std::string& piece) {
  if (utf8_valid(piece)) return {{"id", id}, {"piece", piece}};
  json bytes = json::array();
  for (unsigned char c : piece) bytes.push_back((int)c);
  return {{"id", id}, {"piece", bytes}};
}

bool text_stream::append(const std::string& piece) {
  if (stopped_) return true;
  const size_t old = text_.size();
  text_ += piece;
  size_t cut = std::string::npos;
  for (const auto& s : stop_) {
    const size_t from = old >= s.size() ? old - s.size() + 1 : 0;
    const size_t at = text_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut == std::string::npos) return false;
  text_.resize(std::max(cut, sent_));  // what was sent stays (it cannot contain the stop string)
  stopped_ = true;
  return true;
}

std::string text_stream::take(bool final) {
  size_t end = text_.size();
  if (!final && !stopped_) {
    size_t hold = utf8_incomplete_tail(text_);
    for (const auto& s : stop_)  // a suffix that may be the start of a stop string
      for (size_t k = std::min(s.size() - 1, text_.size()); k > hold; --k)
        if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    end = text_.size() - hold;
  }
  if (end <= sent_) return {};
  std::string r = text_.substr(sent_, end - sent_);
  sent_ = end;
  return r;
}

std::string json_brief(const nlohmann::json& v, size_t max_chars) {
  std::string out;
  // Depth-first over the value with an explicit stack of open arrays / objects; scalars are
  // dumped (a string's dump is its escaped text, bounded by the body's size, then cut).
  struct open_value {
    const json* v;
    json::const_iterator it;
  };
  std::vector<open_value> stack;
  auto emit_value = [&](const json& x) {
    if (x.is_array() || x.is_object()) {
      out += x.is_array() ? '[' : '{';
      stack.push_back({&x, x.cbegin()});
    } else {
      out += x.dump(-1, ' ', false, json::error_handler_t::replace);
    }
  };
  emit_value(v);
  while (!stack.empty() && out.size() <= max_chars) {
    open_value& top = stack.back();
    if (top.it == top.v->cend()) {
      out += top.v->is_array() ? ']' : '}';
      stack.pop_back();
      continue;
    }
    if (top.it != top.v->cbegin()) out += ',';
    const json& x = *top.it;
    if (top.v->is_object()) out += json(top.it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ':';
    ++top.it;
    emit_value(x);  // may push: `top` is not used after this
  }
  if (out.size() > max_chars) out = out.substr(0, max_chars >= 3 ? max_chars - 3 : 0) + "...";
  return out;
}

}  // namespace kvq::server_detail
