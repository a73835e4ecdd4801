// OpenAI request parsing and validation, the error body, and the streamed text's stop strings.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "server/api.h"

namespace kvq::server_detail {
namespace {

using nlohmann::json;

// The api_error a body raises (status 0 when it parses).
api_error error_of(const json& body, bool chat) {
  try {
    parse_completion_request(body, chat);
  } catch (const api_error& e) {
    return e;
  }
  return api_error(0, "", "");
}

TEST(ServerApi, ParsesOpenAiFields) {
  const auto r = parse_completion_request(
      json::parse(R"({"model":"x","prompt":"hi","max_tokens":7,"temperature":0,"top_p":0.5,"top_k":3,
                      "min_p":0.1,"seed":42,"stop":["a","bc"],"stream":true,"stream_options":{"include_usage":true},
                      "n":1,"user":"ignored","presence_penalty":null})"),
      false);
  EXPECT_EQ(r.prompt, "hi");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.sampling.temp, 0.0f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 3);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

// stream_options on a request that does not stream is refused as OpenAI and vLLM refuse it (400
// invalid_request_error, param stream_options) instead of being ignored; null counts as absent, and
// with "stream": true it keeps setting include_usage.
TEST(ServerApi, StreamOptionsOnlyWithStream) {
  for (const bool chat : {false, true}) {
    const std::string head = chat ? R"({"messages":[{"role":"user","content":"q"}])" : R"({"prompt":"x")";
    for (const char* tail :
         {R"(,"stream_options":{"include_usage":true}})", R"(,"stream":false,"stream_options":{"include_usage":true}})",
          R"(,"stream":null,"stream_options":{}})"}) {
      const std::string body = head + tail;
      const api_error e = error_of(json::parse(body), chat);
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.type, "invalid_request_error") << body;
      EXPECT_EQ(e.param, "stream_options") << body;
      EXPECT_EQ(e.code, "invalid_value") << body;
      EXPECT_NE(std::string(e.what()).find("only allowed with \"stream\": true"), std::string::npos) << e.what();
    }
    const auto null_opts = parse_completion_request(json::parse(head + R"(,"stream_options":null})"), chat);
    EXPECT_FALSE(null_opts.stream);
    EXPECT_FALSE(null_opts.include_usage);
    for (const bool usage : {false, true}) {
      const auto r =
          parse_completion_request(json::parse(head + R"(,"stream":true,"stream_options":{"include_usage":)" +
                                               (usage ? "true" : "false") + "}}"),
                                   chat);
      EXPECT_TRUE(r.stream);
      EXPECT_EQ(r.include_usage, usage);
    }
  }
}

TEST(ServerApi, Defaults) {
  const auto c = parse_completion_request(json::parse(R"({"prompt":"hi"})"), false);
  EXPECT_EQ(c.max_tokens, 16);  // OpenAI's completions default
  EXPECT_FALSE(c.stream);
  EXPECT_EQ(c.sampling.seed, 0xFFFFFFFFu);  // random
  const auto chat = parse_completion_request(json::parse(R"({"messages":[{"role":"user","content":"q"}]})"), true);
  EXPECT_EQ(chat.max_tokens, -1);  // until end of generation
  ASSERT_EQ(chat.messages.size(), 1u);
  EXPECT_EQ(chat.messages[0].parts, std::vector<std::string>{"q"});
  const auto mct = parse_completion_request(
      json::parse(R"({"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":3})"),
      true);
  EXPECT_EQ(mct.max_tokens, 3);
  EXPECT_EQ(mct.messages[0].role, "system");
  EXPECT_FALSE(mct.messages[0].content_is_string);
  EXPECT_EQ(mct.messages[0].parts, (std::vector<std::string>{"a", "b"}));
}

// The sampling fields at the edges of their ranges (docs/server.md, "Request fields"): OpenAI's
// temperature 2 and top_p 1, top_k 0 / -1 (no cut) and large (capped), min_p 0 and 1, and any 64-bit
// seed as OpenAI takes it (-1: random as in llama-server; a negative seed is its two's complement).
TEST(ServerApi, AcceptsTheEdgesOfEachRange) {
  auto parse = [](const std::string& fields) {
    return parse_completion_request(json::parse(R"({"prompt":"x",)" + fields + "}"), false);
  };
  EXPECT_EQ(parse(R"("temperature":2)").sampling.temp, 2.0f);
  EXPECT_EQ(parse(R"("temperature":0)").sampling.temp, 0.0f);
  EXPECT_EQ(parse(R"("top_p":1)").sampling.top_p, 1.0f);
  EXPECT_EQ(parse(R"("top_p":1e-9)").sampling.top_p, 1e-9f);
  EXPECT_EQ(parse(R"("top_k":0)").sampling.top_k, 0);
  EXPECT_EQ(parse(R"("top_k":-1)").sampling.top_k, -1);
  EXPECT_EQ(parse(R"("top_k":10000000000)").sampling.top_k, INT32_MAX);
  EXPECT_EQ(parse(R"("min_p":0)").sampling.min_p, 0.0f);
  EXPECT_EQ(parse(R"("min_p":1)").sampling.min_p, 1.0f);
  EXPECT_EQ(parse(R"("seed":-1)").sampling.seed, 0xFFFFFFFFu);
  EXPECT_EQ(parse(R"("seed":4294967296)").sampling.seed, 1ull << 32);
  EXPECT_EQ(parse(R"("seed":-2)").sampling.seed, ~0ull - 1);
  EXPECT_EQ(parse(R"("seed":9223372036854775807)").sampling.seed, (uint64_t)INT64_MAX);
  EXPECT_EQ(parse(R"("max_tokens":100000)").max_tokens, 100000);  // beyond the context: cut there
  EXPECT_EQ(parse(R"("stop":[])").stop.size(), 0u);
  EXPECT_EQ(parse(R"("stop":["a","b","c","d"])").stop.size(), 4u);
}

TEST(ServerApi, PromptAsTokenIds) {
  const auto r = parse_completion_request(json::parse(R"({"prompt":[1,2,3]})"), false);
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt":["one"]})"), false).prompt, "one");
  // OpenAI's prompt types include a list of token lists: one of them is one prompt (it was refused
  // as "must be a string or a list of token ids"); two are two prompts, refused as ["a","b"] is
  const auto nested = parse_completion_request(json::parse(R"({"prompt":[[4,5,6]]})"), false);
  EXPECT_TRUE(nested.prompt_is_ids);
  EXPECT_EQ(nested.prompt_ids, (std::vector<int32_t>{4, 5, 6}));
  const api_error two = error_of(json::parse(R"({"prompt":[[1],[2]]})"), false);
  EXPECT_EQ(two.param, "prompt");
  EXPECT_NE(std::string(two.what()).find("list of 2 prompts"), std::string::npos) << two.what();
  EXPECT_EQ(error_of(json::parse(R"({"prompt":[[1,-2]]})"), false).code, "invalid_value");
  const api_error empty = error_of(json::parse(R"({"prompt":[]})"), false);
  EXPECT_EQ(empty.code, "invalid_value");
  EXPECT_NE(std::string(empty.what()).find("'prompt' is an empty list"), std::string::npos) << empty.what();
}

TEST(ServerApi, RejectsBadInputWithFieldAndStatus) {
  struct bad { const char* body; bool chat; const char* param; };
  const bad cases[] = {
      {R"([1,2])", false, ""},
      {R"({})", false, "prompt"},
      {R"({"prompt":5})", false, "prompt"},
      {R"({"prompt":["a","b"]})", false, "prompt"},
      {R"({"prompt":[1,-2]})", false, "prompt"},
      {R"({"prompt":"x","max_tokens":0})", false, "max_tokens"},
      {R"({"prompt":"x","max_tokens":-5})", false, "max_tokens"},
      {R"({"prompt":"x","max_tokens":-1})", false, "max_tokens"},  // llama-server: no limit; refused here
      {R"({"prompt":"x","max_tokens":"10"})", false, "max_tokens"},
      {R"({"prompt":"x","max_tokens":1.5})", false, "max_tokens"},
      {R"({"prompt":"x","temperature":"hot"})", false, "temperature"},
      {R"({"prompt":"x","temperature":-1})", false, "temperature"},
      {R"({"prompt":"x","temperature":2.5})", false, "temperature"},
      {R"({"prompt":"x","temperature":1e300})", false, "temperature"},
      {R"({"prompt":"x","top_k":-2})", false, "top_k"},
      {R"({"prompt":"x","top_k":1.5})", false, "top_k"},
      {R"({"prompt":"x","min_p":-0.1})", false, "min_p"},
      {R"({"prompt":"x","seed":18446744073709551615})", false, "seed"},
      {R"({"prompt":"x","seed":1.5})", false, "seed"},
      {R"({"prompt":"x","top_p":0})", false, "top_p"},
      {R"({"prompt":"x","top_p":1.5})", false, "top_p"},
      {R"({"prompt":"x","min_p":2})", false, "min_p"},
      {R"({"prompt":"x","n":2})", false, "n"},
      {R"({"prompt":"x","stop":7})", false, "stop"},
      {R"({"prompt":"x","stop":["a",1]})", false, "stop"},
      {R"({"prompt":"x","stop":["a","b","c","d","e"]})", false, "stop"},
      {R"({"prompt":"x","stop":""})", false, "stop"},
      {R"({"prompt":"x","stream":"yes"})", false, "stream"},
      {R"({"prompt":"x","stream_options":{"include_usage":1}})", false, "stream_options.include_usage"},
      {R"({"prompt":"x"})", true, "messages"},
      {R"({"messages":{}})", true, "messages"},
      {R"({"messages":[]})", true, "messages"},
      {R"({"messages":["hi"]})", true, "messages[0]"},
      {R"({"messages":[{"role":"user"}]})", true, "messages[0].content"},
      {R"({"messages":[{"role":"wizard","content":"x"}]})", true, "messages[0].role"},
      {R"({"messages":[{"role":"user","content":5}]})", true, "messages[0].content"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true, "messages[0].content[0]"},
  };
  for (const bad& c : cases) {
    const api_error e = error_of(json::parse(c.body), c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_FALSE(std::string(e.what()).empty()) << c.body;
  }
}

// OpenAI fields kvq server does not implement are refused (400, param = the field, code
// unsupported_parameter, the message naming the field) instead of being ignored, except for the
// neutral values clients send by default, which must keep parsing.
TEST(ServerApi, RefusesUnsupportedFieldsButAcceptsTheirNeutralValues) {
  struct bad { const char* body; bool chat; const char* param; };
  const bad cases[] = {
      {R"({"prompt":"x","logprobs":5})", false, "logprobs"},
      {R"({"prompt":"x","logprobs":true})", false, "logprobs"},
      {R"({"prompt":"x","echo":true})", false, "echo"},
      {R"({"prompt":"x","presence_penalty":0.5})", false, "presence_penalty"},
      {R"({"prompt":"x","frequency_penalty":-1})", false, "frequency_penalty"},
      {R"({"prompt":"x","logit_bias":{"50256":-100}})", false, "logit_bias"},
      {R"({"prompt":"x","best_of":3})", false, "best_of"},
      {R"({"prompt":"x","suffix":"end"})", false, "suffix"},
      {R"({"messages":[{"role":"user","content":"q"}],"presence_penalty":1})", true, "presence_penalty"},
      {R"({"messages":[{"role":"user","content":"q"}],"frequency_penalty":0.1})", true, "frequency_penalty"},
      {R"({"messages":[{"role":"user","content":"q"}],"logit_bias":{"1":5}})", true, "logit_bias"},
      {R"({"messages":[{"role":"user","content":"q"}],"response_format":{"type":"json_object"}})", true, "response_format"},
      {R"({"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f"}}]})", true, "tools"},
      {R"({"messages":[{"role":"user","content":"q"}],"tool_choice":"required"})", true, "tool_choice"},
      {R"({"messages":[{"role":"user","content":"q"}],"logprobs":true})", true, "logprobs"},
      {R"({"messages":[{"role":"user","content":"q"}],"top_logprobs":2})", true, "top_logprobs"},
      {R"({"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a"}]}]})", true, "messages[0].tool_calls"},
  };
  for (const bad& c : cases) {
    const api_error e = error_of(json::parse(c.body), c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_EQ(e.code, "unsupported_parameter") << c.body;
    EXPECT_NE(std::string(e.what()).find(std::string(c.param) + "' is not supported by kvq server"), std::string::npos)
        << e.what();
  }
  // The defaults the official clients send (or a user spelling out "off") parse as if absent.
  const auto comp = parse_completion_request(
      json::parse(R"({"prompt":"x","max_tokens":3,"logprobs":null,"echo":false,"presence_penalty":0,
                      "frequency_penalty":0.0,"logit_bias":{},"best_of":1,"suffix":null})"),
      false);
  EXPECT_EQ(comp.max_tokens, 3);
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt":"x","logit_bias":null,"logprobs":false,"suffix":""})"), false).prompt, "x");
  const auto chat = parse_completion_request(
      json::parse(R"({"messages":[{"role":"user","content":"q"}],"logprobs":false,"top_logprobs":null,
                      "response_format":{"type":"text"},"tools":[],"tool_choice":"none","presence_penalty":0,
                      "frequency_penalty":0,"logit_bias":null})"),
      true);
  EXPECT_EQ(chat.messages.size(), 1u);
  EXPECT_EQ(parse_completion_request(json::parse(R"({"messages":[{"role":"user","content":"q"}],"tools":null,"top_logprobs":0})"), true).messages.size(), 1u);
}

// An integer beyond 64 bits is refused as out of the range, naming it, whether nlohmann-json read it
// as unsigned (2^63 .. 2^64 - 1) or, past that or below -2^63, as a float (it was "is out of range"
// without the range, and "must be an integer" for the floats); the ends of the range parse.
TEST(ServerApi, IntegersBeyond64BitsAreOutOfTheirRange) {
  for (const char* seed : {"9223372036854775808", "18446744073709551615", "18446744073709551616",
                           "-9223372036854775809", "1e19", "-1e300"}) {
    const std::string body = std::string(R"({"prompt":"x","seed":)") + seed + "}";
    const api_error e = error_of(json::parse(body), false);
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.param, "seed") << body;
    EXPECT_EQ(e.code, "invalid_value") << body << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find("[-9223372036854775808, 9223372036854775807]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt":"x","seed":9223372036854775807})"), false).sampling.seed,
            (uint64_t)INT64_MAX);
  EXPECT_EQ(parse_completion_request(json::parse(R"({"prompt":"x","seed":-9223372036854775808})"), false).sampling.seed,
            (uint64_t)1 << 63);  // a negative seed is its two's complement (docs/server.md)
  const api_error frac = error_of(json::parse(R"({"prompt":"x","seed":1.5})"), false);
  EXPECT_EQ(frac.code, "invalid_type");
  const api_error mt = error_of(json::parse(R"({"prompt":"x","max_tokens":1e20})"), false);
  EXPECT_EQ(mt.param, "max_tokens");
  EXPECT_EQ(mt.code, "invalid_value") << mt.what();
}

// JSON does not tell 5 from 5.0 (a client computing max_tokens in floating point sends 5.0, and
// llama-server takes it): a whole-valued float is the integer in every integer field, token ids
// included; a fractional one stays a 400 naming the field (invalid_type), one beyond 64 bits out of range.
TEST(ServerApi, WholeValuedFloatsAreIntegers) {
  auto parse = [](const std::string& fields, bool chat = false) {
    const std::string head = chat ? R"({"messages":[{"role":"user","content":"q"}],)" : R"({"prompt":"x",)";
    return parse_completion_request(json::parse(head + fields + "}"), chat);
  };
  EXPECT_EQ(parse(R"("max_tokens":5.0)").max_tokens, 5);
  EXPECT_EQ(parse(R"("max_tokens":1e3)").max_tokens, 1000);
  EXPECT_EQ(parse(R"("max_completion_tokens":7.0)", true).max_tokens, 7);
  EXPECT_EQ(parse(R"("n":1.0)").max_tokens, 16);
  EXPECT_EQ(parse(R"("top_k":3.0)").sampling.top_k, 3);
  EXPECT_EQ(parse(R"("top_k":-1.0)").sampling.top_k, -1);
  EXPECT_EQ(parse(R"("seed":42.0)").sampling.seed, 42u);
  EXPECT_EQ(parse(R"("seed":-1.0)").sampling.seed, 0xFFFFFFFFu);
  EXPECT_EQ(parse(R"("seed":-2.0)").sampling.seed, ~0ull - 1);
  EXPECT_EQ(parse(R"("seed":4294967296.0)").sampling.seed, 1ull << 32);
  const auto ids = parse_completion_request(json::parse(R"({"prompt":[1.0,2,3e0]})"), false);
  EXPECT_EQ(ids.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  // the range checks still apply to the value
  EXPECT_EQ(error_of(json::parse(R"({"prompt":"x","max_tokens":0.0})"), false).code, "invalid_value");
  EXPECT_EQ(error_of(json::parse(R"({"prompt":"x","n":2.0})"), false).param, "n");
  for (const char* f : {"max_tokens", "n", "top_k", "seed"}) {
    const std::string body = std::string(R"({"prompt":"x",")") + f + R"(":5.5})";
    const api_error e = error_of(json::parse(body), false);
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.param, f) << body;
    EXPECT_EQ(e.code, "invalid_type") << body;
    EXPECT_NE(std::string(e.what()).find(std::string("'") + f + "' must be an integer, got number 5.5"),
              std::string::npos)
        << e.what();
  }
  const api_error big = error_of(json::parse(R"({"prompt":"x","seed":9223372036854775808.0})"), false);  // 2^63
  EXPECT_EQ(big.code, "invalid_value") << big.what();
  EXPECT_EQ(error_of(json::parse(R"({"prompt":[1,2.5]})"), false).param, "prompt");
  // the helper itself, against the integers the doubles hold
  EXPECT_EQ(json_to_int64(json(5)), 5);
  EXPECT_EQ(json_to_int64(json(-5.0)), -5);
  EXPECT_EQ(json_to_int64(json(0x1p62)), (int64_t)1 << 62);
  EXPECT_FALSE(json_to_int64(json(0x1p63)).has_value());
  EXPECT_FALSE(json_to_int64(json((uint64_t)INT64_MAX + 1)).has_value());
  EXPECT_EQ(json_to_int64(json(INT64_MIN)), INT64_MIN);    // as an integer
  EXPECT_FALSE(json_to_int64(json(-0x1p63)).has_value());  // as a float: also -2^63 - 1 rounded
  EXPECT_EQ(json_to_int64(json(-0x1p63 + 1024)), INT64_MIN + 1024);
  EXPECT_FALSE(json_to_int64(json(0.5)).has_value());
  EXPECT_FALSE(json_to_int64(json("5")).has_value());
  EXPECT_FALSE(json_to_int64(json(true)).has_value());
}

// A message without its role or content says the field is missing (code missing_field, as a request
// without 'prompt' or 'messages', and /tokenize without 'content'); it said "content is missing" with
// code invalid_type, and "role must be a string" for a role left out. A null or a wrong type stays
// invalid_type, naming the type; an assistant's content may be null or left out (OpenAI).
TEST(ServerApi, MessageWithoutRoleOrContentSaysItIsMissing) {
  struct bad {
    const char *messages, *param, *code, *says;
  };
  for (const bad& c :
       {bad{R"([{"role":"user"}])", "messages[0].content", "missing_field", "messages[0].content is required"},
        bad{R"([{"role":"user","content":"a"},{"content":"b"}])", "messages[1].role", "missing_field",
            "messages[1].role is required"},
        bad{R"([{"role":"user","content":null}])", "messages[0].content", "invalid_type", "got null"},
        bad{R"([{"role":null,"content":"a"}])", "messages[0].role", "invalid_type",
            "messages[0].role must be a string, got null"},
        bad{R"([{"role":5,"content":"a"}])", "messages[0].role", "invalid_type", "got number"}}) {
    const api_error e = error_of(json::parse(std::string(R"({"messages":)") + c.messages + "}"), true);
    EXPECT_EQ(e.status, 400) << c.messages;
    EXPECT_EQ(e.param, c.param) << c.messages;
    EXPECT_EQ(e.code, c.code) << c.messages << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
  }
  for (const char* ok : {R"([{"role":"assistant"}])", R"([{"role":"assistant","content":null}])"})
    EXPECT_EQ(parse_completion_request(json::parse(std::string(R"({"messages":)") + ok + "}"), true).messages[0].parts,
              std::vector<std::string>{""});
}

// The refusal of a role lists the roles accepted, all of them: each of OpenAI's roles either parses
// and is in the list, or is refused and is not (the list left out "developer", which is accepted).
TEST(ServerApi, RoleErrorListsEveryAcceptedRole) {
  const std::string listed = error_of(json::parse(R"({"messages":[{"role":"wizard","content":"x"}]})"), true).what();
  const size_t open = listed.find('('), close = listed.rfind(')');
  ASSERT_TRUE(open != std::string::npos && close != std::string::npos && open < close) << listed;
  const std::string roles = ", " + listed.substr(open + 1, close - open - 1) + ",";
  for (const char* role : {"system", "developer", "user", "assistant", "tool", "function"}) {
    const json body = {{"messages", {{{"role", role}, {"content", "x"}}}}};
    bool accepted = true;
    try {
      parse_completion_request(body, true);
    } catch (const api_error&) { accepted = false; }
    EXPECT_EQ(accepted, roles.find(std::string(", ") + role + ",") != std::string::npos)
        << role << (accepted ? " is accepted" : " is refused") << "; the error lists (" << roles << ")";
  }
}

// max_completion_tokens (OpenAI's newer name) wins over the deprecated max_tokens when a chat
// request gives both, as OpenAI and vLLM take them; an assistant turn with content null (OpenAI
// allows it) is an empty turn, not "content is missing".
TEST(ServerApi, MaxCompletionTokensWinsAndAssistantContentMayBeNull) {
  const auto both = parse_completion_request(
      json::parse(R"({"messages":[{"role":"user","content":"q"}],"max_tokens":50,"max_completion_tokens":7})"), true);
  EXPECT_EQ(both.max_tokens, 7);
  const auto reversed = parse_completion_request(
      json::parse(R"({"max_completion_tokens":9,"messages":[{"role":"user","content":"q"}],"max_tokens":2})"), true);
  EXPECT_EQ(reversed.max_tokens, 9);
  EXPECT_EQ(error_of(json::parse(R"({"messages":[{"role":"user","content":"q"}],"max_tokens":5,"max_completion_tokens":0})"), true).param,
            "max_completion_tokens");
  const auto null_content = parse_completion_request(
      json::parse(R"({"messages":[{"role":"user","content":"a"},{"role":"assistant","content":null},{"role":"user","content":"b"}]})"),
      true);
  ASSERT_EQ(null_content.messages.size(), 3u);
  EXPECT_EQ(null_content.messages[1].role, "assistant");
  EXPECT_EQ(null_content.messages[1].parts, std::vector<std::string>{""});
  EXPECT_EQ(error_of(json::parse(R"({"messages":[{"role":"user","content":null}]})"), true).param, "messages[0].content");
}

TEST(ServerApi, MalformedJsonAndErrorBody) {
  try {
    parse_json_body("{\"prompt\": ");
    FAIL() << "no error";
  } catch (const api_error& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.code, "invalid_json");
    const json b = error_body(e);
    EXPECT_TRUE(b["error"]["message"].is_string());
    EXPECT_EQ(b["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(b["error"]["param"].is_null());
    EXPECT_EQ(b["error"]["code"], "invalid_json");
  }
}

// A value nested 50,000 deep (a 100 KB body) in a field the parser reads: a 400 naming the field
// with a short message, not a stack overflow (json::dump recursed once per level and crashed the
// server on prompt, max_tokens and stop). The reference text is written here by hand.
TEST(ServerApi, DeeplyNestedFieldIsA400WithAShortMessage) {
  const int depth = 50000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  for (const char* key : {"prompt", "max_tokens", "stop", "temperature"}) {
    const std::string text = std::string("{") + (std::strcmp(key, "prompt") == 0 ? "" : "\"prompt\":\"x\",") + "\"" +
                             key + "\":" + deep + "}";
    const api_error e = error_of(parse_json_body(text), false);
    EXPECT_EQ(e.status, 400) << key;
    EXPECT_EQ(e.param, key);
    EXPECT_LT(std::strlen(e.what()), 200u) << key;
  }
  EXPECT_EQ(json_brief(parse_json_body(deep)), std::string(57, '[') + "...");
  EXPECT_EQ(json_brief(parse_json_body(deep), 8), "[[[[[...");
}

TEST(ServerApi, JsonBriefWritesWhatDumpWrites) {
  const char* texts[] = {R"(7)", R"("a\"b")", R"([])", R"({})", R"([1,[2,[3,{}]],"x"])",
                         R"({"a":[1,2],"b":{"c":null,"d":true},"e":"\u00e9"})", R"([[[]],[{}],{"k":[]}])"};
  for (const char* t : texts) {
    const json v = json::parse(t);
    EXPECT_EQ(json_brief(v, 1000), v.dump()) << t;
    const std::string cut = json_brief(v, 6);
    EXPECT_LE(cut.size(), 6u) << t;
    if (v.dump().size() > 6) {
      EXPECT_EQ(cut, v.dump().substr(0, 3) + "...") << t;
    }
  }
}

TEST(ServerApi, Utf8IncompleteTail) {
  EXPECT_EQ(utf8_incomplete_tail("abc"), 0u);
  EXPECT_EQ(utf8_incomplete_tail("a\xC3"), 1u);          // é cut after its lead byte
  EXPECT_EQ(utf8_incomplete_tail("a\xC3\xA9"), 0u);
  EXPECT_EQ(utf8_incomplete_tail("\xE2\x9C"), 2u);       // ✓ (E2 9C 93) cut
  EXPECT_EQ(utf8_incomplete_tail("\xF0\x9F\x98"), 3u);   // 😀 cut
  EXPECT_EQ(utf8_incomplete_tail("\xF0\x9F\x98\x80"), 0u);
}

// RFC 3629 section 4's syntax: every scalar value encodes to valid UTF-8; overlong forms, surrogates,
// values above U+10FFFF, stray continuation bytes and cut sequences are not.
TEST(ServerApi, Utf8Valid) {
  auto enc = [](uint32_t c) {  // the encoding of RFC 3629 section 3
    std::string s;
    if (c < 0x80) s += (char)c;
    else if (c < 0x800) s += (char)(0xC0 | c >> 6), s += (char)(0x80 | (c & 0x3F));
    else if (c < 0x10000) s += (char)(0xE0 | c >> 12), s += (char)(0x80 | (c >> 6 & 0x3F)), s += (char)(0x80 | (c & 0x3F));
    else
      s += (char)(0xF0 | c >> 18), s += (char)(0x80 | (c >> 12 & 0x3F)), s += (char)(0x80 | (c >> 6 & 0x3F)),
          s += (char)(0x80 | (c & 0x3F));
    return s;
  };
  int bad = 0;
  for (uint32_t c = 0; c <= 0x10FFFF; ++c) bad += utf8_valid(enc(c)) == (c >= 0xD800 && c < 0xE000) ? 1 : 0;
  EXPECT_EQ(bad, 0);  // scalar values valid, surrogates (ED A0 80 ..) not
  EXPECT_TRUE(utf8_valid(""));
  EXPECT_TRUE(utf8_valid("<|im_start|>user\nH\xC3\xA9llo \xF0\x9F\xA6\x99"));
  for (const char* s : {"\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xF0\x80\x80\x80",  // overlong
                        "\xF4\x90\x80\x80", "\xF5\x80\x80\x80", "\xFF",              // > U+10FFFF
                        "\x80", "a\xBF", "\xE4", "\xE4\xB8", "\xF0\x9F\xA6", "\xC3" "a"})  // stray, cut
    EXPECT_FALSE(utf8_valid(s)) << json(std::vector<int>(s, s + std::strlen(s))).dump();
}

// POST /tokenize with_pieces as llama-server writes it: text, or the byte values of a piece that is
// not valid UTF-8 (a byte-level token holding part of a character).
TEST(ServerApi, TokenPieceJson) {
  EXPECT_EQ(token_piece_json(151644, "<|im_start|>"), json({{"id", 151644}, {"piece", "<|im_start|>"}}));
  EXPECT_EQ(token_piece_json(7, " \xC3\xA9"), json({{"id", 7}, {"piece", " \xC3\xA9"}}));
  EXPECT_EQ(token_piece_json(8, "\xE4\xB8"), json({{"id", 8}, {"piece", {0xE4, 0xB8}}}));
  EXPECT_EQ(token_piece_json(9, ""), json({{"id", 9}, {"piece", ""}}));
}

// The text a client receives: the concatenation of every take(), then take(true).
std::string stream_all(text_stream& s, const std::vector<std::string>& pieces, std::vector<std::string>* sent = nullptr) {
  std::string out;
  for (const auto& p : pieces) {
    const bool stop = s.append(p);
    const std::string t = s.take(false);
    if (sent) sent->push_back(t);
    out += t;
    if (stop) break;
  }
  return out + s.take(true);
}

TEST(ServerApi, StopStringsAcrossTokens) {
  {
    text_stream s({"\n\n", "END"});
    std::vector<std::string> sent;
    EXPECT_EQ(stream_all(s, {"def f", "():\n", "    return 1", "\n", "\nmore"}, &sent), "def f():\n    return 1");
    EXPECT_TRUE(s.stopped());
    EXPECT_EQ(sent[1], "():");  // the trailing "\n" is held back: it may start "\n\n"
  }
  {
    text_stream s({"END"});
    EXPECT_EQ(stream_all(s, {"abc E", "N", "D tail"}), "abc ");
  }
  {
    text_stream s({"END"});  // a held-back prefix that turns out not to be a stop string is sent
    EXPECT_EQ(stream_all(s, {"abc E", "N", "x"}), "abc ENx");
    EXPECT_FALSE(s.stopped());
  }
  {
    text_stream s({"stop"});  // the earliest stop string wins within one piece
    EXPECT_EQ(stream_all(s, {"a stop b stop"}), "a ");
  }
  {
    text_stream s({});  // a character split across tokens is sent whole
    std::vector<std::string> sent;
    EXPECT_EQ(stream_all(s, {"h\xC3", "\xA9llo"}, &sent), "h\xC3\xA9llo");
    EXPECT_EQ(sent[0], "h");
  }
}

}  // namespace
}  // namespace kvq::server_detail
