// The OpenAI request and error shapes of kvq server (no HTTP here, so tests can call it): parsing
// and validating /v1/completions and /v1/chat/completions bodies, the error body, and the stream
// of generated text cut at stop strings.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvq/sampling.h"
#include "server/chat_template.h"

namespace kvq::server_detail {

// An HTTP error with OpenAI's body {"error": {"message", "type", "param", "code"}}.
struct api_error : std::runtime_error {
  int status;         // HTTP status: 400, 401, 404, 413, 500, 503
  std::string type;   // "invalid_request_error", "authentication_error", "server_error", "unavailable_error"
  std::string param;  // the offending field ("" = null)
  std::string code;   // machine-readable ("" = null), e.g. "context_length_exceeded"
  api_error(int status, std::string message, std::string type, std::string param = "", std::string code = "")
      : std::runtime_error(std::move(message)), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
};
// 400 invalid_request_error naming the field.
[[noreturn]] void fail_request(const std::string& param, const std::string& message, const std::string& code = "");
nlohmann::json error_body(const api_error& e);

// A parsed /v1/completions or /v1/chat/completions request (n = 1 only).
struct completion_request {
  bool chat = false;
  std::string prompt;                  // completions: the prompt text (when not token ids)
  std::vector<int32_t> prompt_ids;     // completions: the prompt as token ids (prompt: [ints])
  bool prompt_is_ids = false;
  std::vector<chat_message> messages;  // chat
  // max_tokens (chat: also max_completion_tokens); absent: 16 for completions (OpenAI's default),
  // until end of generation or a full context for chat.
  int max_tokens = -1;
  sampling_params sampling;            // temperature, top_p, top_k, min_p, seed; llama-server's defaults
  std::vector<std::string> stop;       // up to 4 non-empty strings
  bool stream = false;
  bool include_usage = false;          // stream_options.include_usage
  bool ignore_eos = false;             // llama-server's ignore_eos
};

// Parses and validates a request body. Throws api_error 400 (type invalid_request_error, param =
// the field) for: a body that is not a JSON object; a missing prompt / messages; a field of the
// wrong type (max_tokens not an integer, temperature not a number, stop not a string or list of
// strings, stream not a boolean...; an integer field takes a whole-valued float: 5.0, not 5.5);
// max_tokens < 1; temperature outside [0, 2] (OpenAI's range);
// top_p outside (0, 1]; top_k < -1; min_p outside [0, 1]; seed outside the 64-bit integers (-1:
// random); n != 1; more than 4 stop strings or an empty one;
// a message without a valid role or a string / text-part content (an assistant's may be null: empty).
// OpenAI fields kvq does not implement are refused (400, code "unsupported_parameter", param = the
// field) unless they hold the neutral value clients send by default: presence_penalty /
// frequency_penalty 0, logit_bias {}, logprobs false; completions: echo false, best_of 1, suffix "";
// chat: top_logprobs 0, response_format {"type": "text"}, tools / functions [], tool_choice /
// function_call "none" or "auto", a message's tool_calls []; null is neutral for all of them.
// Chat: max_completion_tokens wins over max_tokens. Other unknown fields are ignored.
completion_request parse_completion_request(const nlohmann::json& body, bool chat);

// The integer a JSON number holds: an integer, or a float with a whole value (5.0, 1e3), since JSON
// does not tell 5 from 5.0 (llama-server and Python's json take either), within the 64-bit
// integers (a float: strictly inside (-2^63, 2^63), since -2^63 is also what -2^63 - 1 rounds to).
// nullopt for anything else: 5.5, "5", true, 1e19, 2^63 as an integer.
std::optional<int64_t> json_to_int64(const nlohmann::json& v);

// Parses `text` as JSON; throws api_error 400 ("invalid_json") naming the parse error's position.
nlohmann::json parse_json_body(const std::string& text);

// Generated text as it is streamed: pieces are appended; text_ready() is what can be sent now
// (complete UTF-8 characters that cannot be the beginning of a stop string); a stop string found
// ends the text before it. Stop strings are matched on the decoded text, across token boundaries.
class text_stream {
 public:
  explicit text_stream(std::vector<std::string> stop) : stop_(std::move(stop)) {}
  // Appends a token's bytes; returns true when a stop string is now complete (the text ends
  // before it and nothing more may be appended).
  bool append(const std::string& piece);
  // The part of the text not yet taken that is safe to send; advances the taken mark. final:
  // the generation ended, so everything left (held-back bytes included) is released.
  std::string take(bool final);
  const std::string& text() const { return text_; }  // the whole text so far (cut at a stop string)
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stop_;
  std::string text_;
  size_t sent_ = 0;
  bool stopped_ = false;
};

// A request value as error messages show it: its JSON text, cut to at most max_chars bytes (then
// ending in "..."), written without recursion, so that a value nested 50,000 deep (a 100 KB body)
// costs max_chars of work and no stack (nlohmann's dump() recurses once per level).
std::string json_brief(const nlohmann::json& v, size_t max_chars = 60);

// Bytes at the end of s that form an incomplete UTF-8 sequence (0..3).
size_t utf8_incomplete_tail(const std::string& s);

// True when s is well-formed UTF-8 (RFC 3629: no overlong forms, surrogates or code points above
// U+10FFFF).
bool utf8_valid(const std::string& s);

// One entry of POST /tokenize with "with_pieces": true, as llama-server writes it
// (tools/server/server-context.cpp, post_tokenize): {"id", "piece"}, the piece being the token's text
// with control tokens by their vocabulary text (token_to_piece special = true, so <|im_start|> is
// "<|im_start|>", not ""), a string when it is valid UTF-8, else the list of its byte values (a
// byte-level token holding part of a multi-byte character).
nlohmann::json token_piece_json(int32_t id, const std::string& piece);

}  // namespace kvq::server_detail
