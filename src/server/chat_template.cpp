#include "server/chat_template.h"

#include <regex>

#include "kvq/error.h"

namespace kvq::server_detail {

namespace {

// Jinja's `trim` filter is Python's str.strip(): here the ASCII whitespace and the separators
// \x1c-\x1f that str.isspace() accepts (other Unicode spaces are kept).
std::string trim(const std::string& s) {
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f'); };
  size_t a = 0, b = s.size();
  while (a < b && space(s[a])) ++a;
  while (b > a && space(s[b - 1])) --b;
  return s.substr(a, b - a);
}

std::string joined(const chat_message& m) {
  std::string s;
  for (const auto& p : m.parts) s += p;
  return s;
}

// Undoes the escapes of a Jinja string literal ('\n', '\t', '\\', '\'', '\"').
std::string unescape_literal(const std::string& s) {
  std::string r;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) { r += s[i]; continue; }
    const char c = s[++i];
    r += c == 'n' ? '\n' : c == 't' ? '\t' : c;
  }
  return r;
}

std::string first_line(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.size() > 80 ? line.substr(0, 80) + "..." : line;
}

// What a template that is neither ChatML nor Gemma holds: the known markers it has, and the family
// they belong to, so that an error can say what was found.
std::string found_markers(const std::string& text) {
  struct marker {
    const char* text;
    const char* family;
  };
  static const marker markers[] = {
      {"<|im_start|>", "ChatML"},          {"<|im_end|>", "ChatML"},
      {"add_generation_prompt", ""},       {"<start_of_turn>", "Gemma"},
      {"<end_of_turn>", "Gemma"},          {"first_user_prefix", "Gemma"},
      {"[INST]", "Llama 2 / Mistral"},     {"<|start_header_id|>", "Llama 3"},
      {"<|user|>", "Phi-3 / Zephyr"},      {"<|system|>", "Phi-3 / Zephyr"},
  };
  std::string has, families;
  for (const marker& m : markers) {
    if (text.find(m.text) == std::string::npos) continue;
    has += (has.empty() ? "" : ", ") + std::string(m.text);
    if (*m.family && families.find(m.family) == std::string::npos)
      families += (families.empty() ? "" : " / ") + std::string(m.family);
  }
  if (has.empty()) return "none of the markers of a known format";
  std::string r = "found " + has;
  if (!families.empty()) r += " (" + families + ")";
  return r;
}

}  // namespace

const char* chat_format_name(chat_format f) {
  switch (f) {
    case chat_format::chatml: return "chatml";
    case chat_format::gemma: return "gemma";
    default: return "?";
  }
}

chat_template chat_template::from_text(const std::string& text, const std::string& bos_text) {
  chat_template t;
  t.bos_text_ = bos_text;
  const auto has = [&](const char* s) { return text.find(s) != std::string::npos; };
  if (has("<|im_start|>") && has("<|im_end|>") && has("add_generation_prompt")) {
    t.format_ = chat_format::chatml;
    // The default system turn: a literal '<|im_start|>system\n...<|im_end|>' (Qwen2.5: "You are
    // Qwen, created by Alibaba Cloud. You are a helpful assistant."); none in plain ChatML.
    static const std::regex def(R"(<\|im_start\|>system\\n([^'"{}+]*)<\|im_end\|>)");
    std::smatch m;
    if (std::regex_search(text, m, def)) t.default_system_ = unescape_literal(m[1].str());
    return t;
  }
  if (has("<start_of_turn>") && has("<end_of_turn>") && has("first_user_prefix")) {
    t.format_ = chat_format::gemma;
    return t;
  }
  fail_unsupported("[chat_template] unrecognised chat template (first line: '" + first_line(text) + "'; " +
                   found_markers(text) +
                   "); kvq renders two formats, recognised by their markers: ChatML as Qwen2 / Qwen2.5 write it "
                   "(<|im_start|>, <|im_end|> and add_generation_prompt) and Gemma's turn format (<start_of_turn>, "
                   "<end_of_turn> and first_user_prefix)");
}

std::string chat_template::render(const std::vector<chat_message>& messages, bool add_generation_prompt) const {
  if (messages.empty()) fail_input("[chat_template] messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      fail_input("[chat_template] messages[" + std::to_string(i) + "].role '" + r +
                 "' is not supported (system, user, assistant)");
  }
  std::string out;
  if (format_ == chat_format::chatml) {
    if (messages[0].role == "system") out += "<|im_start|>system\n" + joined(messages[0]) + "<|im_end|>\n";
    else if (!default_system_.empty()) out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
    for (size_t i = 0; i < messages.size(); ++i) {
      if (i == 0 && messages[i].role == "system") continue;
      out += "<|im_start|>" + messages[i].role + "\n" + joined(messages[i]) + "<|im_end|>\n";
    }
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
  // Gemma: system text (its first part when a list) + "\n\n" opens the first turn of the loop.
  out += bos_text_;
  size_t i0 = 0;
  std::string prefix;
  if (messages[0].role == "system") {
    prefix = (messages[0].parts.empty() ? std::string() : messages[0].parts[0]) + "\n\n";
    i0 = 1;
  }
  for (size_t i = i0; i < messages.size(); ++i) {
    const chat_message& m = messages[i];
    if ((m.role == "user") != ((i - i0) % 2 == 0))
      fail_input("[chat_template] Conversation roles must alternate user/assistant/user/assistant/... "
                 "(messages[" + std::to_string(i) + "].role is '" + m.role + "')");
    out += "<start_of_turn>" + std::string(m.role == "assistant" ? "model" : m.role) + "\n" + (i == i0 ? prefix : "");
    for (const auto& p : m.parts) out += trim(p);
    out += "<end_of_turn>\n";
  }
  if (add_generation_prompt) out += "<start_of_turn>model\n";
  return out;
}

}  // namespace kvq::server_detail
