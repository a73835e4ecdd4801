// kvq's C++ chat template renderer against Python jinja2's rendering of the real template texts
// (tests/server/data/chat_template_golden.json, written by scripts/render_chat_templates.py).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/error.h"
#include "kvq/gguf.h"
#include "server/chat_template.h"
#include "support/data_dir.h"

namespace kvq::server_detail {
namespace {

using nlohmann::json;

std::string data_file(const std::string& name) { return std::string(KVQ_SOURCE_DIR) + "/tests/server/data/" + name; }

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<chat_message> messages_of(const json& j) {
  std::vector<chat_message> v;
  for (const json& m : j) {
    chat_message c;
    c.role = m["role"];
    if (m["content"].is_string()) {
      c.parts = {m["content"].get<std::string>()};
    } else {
      c.content_is_string = false;
      for (const json& p : m["content"]) c.parts.push_back(p["text"]);
    }
    v.push_back(c);
  }
  return v;
}

TEST(ChatTemplate, MatchesJinja2Rendering) {
  std::ifstream f(data_file("chat_template_golden.json"));
  ASSERT_TRUE(f) << data_file("chat_template_golden.json");
  const json golden = json::parse(f);
  int n_rendered = 0, n_refused = 0;
  for (const json& t : golden["templates"]) {
    const std::string text = read_text(data_file(t["file"]));
    ASSERT_FALSE(text.empty()) << t["file"];
    const chat_template tmpl = chat_template::from_text(text, t["bos_token"]);
    for (const json& c : t["cases"]) {
      const auto msgs = messages_of(c["messages"]);
      const bool agp = c["add_generation_prompt"];
      bool all_strings = true;
      for (const auto& m : msgs) all_strings = all_strings && m.content_is_string;
      if (c.contains("rendered")) {
        EXPECT_EQ(tmpl.render(msgs, agp), c["rendered"].get<std::string>()) << t["file"] << " " << c["messages"].dump();
        ++n_rendered;
      } else if (all_strings) {  // the template refuses it (raise_exception): so must kvq
        EXPECT_THROW(tmpl.render(msgs, agp), error) << t["file"] << " " << c["messages"].dump();
        ++n_refused;
      }
      // (ChatML with text-part lists: jinja2 fails to concatenate a list; kvq joins the parts.)
    }
  }
  EXPECT_GE(n_rendered, 30);
  EXPECT_GE(n_refused, 2);
}

TEST(ChatTemplate, QwenFixtureIsTheModelsTemplate) {
  KVQ_REQUIRE_MODEL(model, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
  const auto g = gguf_file::open(model);
  EXPECT_EQ(g->get_string("tokenizer.chat_template"), read_text(data_file("qwen2.5_chat_template.jinja")));
  const chat_template t = chat_template::from_text(g->get_string("tokenizer.chat_template"), "");
  EXPECT_EQ(t.format(), chat_format::chatml);
  EXPECT_EQ(t.default_system(), "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
}

TEST(ChatTemplate, UnknownTemplateIsAClearError) {
  try {
    chat_template::from_text("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}", "<s>");
    FAIL() << "no error";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::unsupported);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("first line: '{% for m in messages %}[INST]"), std::string::npos) << msg;  // names the template
    // says what it found and which formats kvq renders, by the markers it recognises them by
    EXPECT_NE(msg.find("found [INST] (Llama 2 / Mistral)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ChatML as Qwen2 / Qwen2.5 write it (<|im_start|>, <|im_end|> and add_generation_prompt)"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("Gemma's turn format (<start_of_turn>, <end_of_turn> and first_user_prefix)"), std::string::npos)
        << msg;
    EXPECT_EQ(msg.find("takes another template text"), std::string::npos) << msg;
  }
  try {  // ChatML's markers without add_generation_prompt: what it has is named
    chat_template::from_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "");
    FAIL() << "no error";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("found <|im_start|>, <|im_end|> (ChatML)"), std::string::npos) << e.what();
  }
  try {
    chat_template::from_text("{{ messages[0].content }}", "");
    FAIL() << "no error";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("none of the markers of a known format"), std::string::npos) << e.what();
  }
  EXPECT_THROW(chat_template::from_text("", ""), error);
  const chat_template t = chat_template::from_text(read_text(data_file("gemma3_chat_template.jinja")), "<bos>");
  EXPECT_THROW(t.render({}, true), error);
  EXPECT_THROW(t.render({{"tool", true, {"x"}}}, true), error);
}

}  // namespace
}  // namespace kvq::server_detail
