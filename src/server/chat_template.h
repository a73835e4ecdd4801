// Chat templates rendered in C++ for the families whose tokenizer.chat_template kvq recognises
// (no Jinja interpreter): ChatML as Qwen2 / Qwen2.5 write it (<|im_start|>role\n...<|im_end|>\n,
// with the template's default system prompt) and Gemma's turn format (<start_of_turn>user / model,
// system text prefixed to the first user turn, contents trimmed, roles alternating). The output
// equals Python jinja2's rendering of the template text for messages of roles system / user /
// assistant with string or text-part contents (tests/server/test_chat_template.cpp against
// tests/server/data/chat_template_golden.json); tools and images are not rendered.
#pragma once
#include <string>
#include <vector>

namespace kvq::server_detail {

struct chat_message {
  std::string role;                // "system", "user" or "assistant"
  bool content_is_string = true;   // content was a JSON string (else a list of text parts)
  std::vector<std::string> parts;  // the string (one part), or the text parts in order
};

enum class chat_format { chatml, gemma, count };
const char* chat_format_name(chat_format f);

class chat_template {
 public:
  // Recognises `text` (a tokenizer.chat_template). bos_text: the BOS token's text ("<bos>"), what
  // the template's {{ bos_token }} renders. Throws unsupported "[chat_template] unrecognised chat
  // template (first line: '...'); kvq renders ChatML (Qwen2.5) and Gemma turn templates" for
  // anything else, and for an empty text.
  static chat_template from_text(const std::string& text, const std::string& bos_text);

  // The prompt for `messages` (non-empty), ending with the assistant turn's opening when
  // add_generation_prompt. Throws invalid_input "[chat_template] ..." for what the template itself
  // refuses (Gemma: roles that do not alternate user / assistant after an optional first system
  // message) and for roles other than system / user / assistant.
  std::string render(const std::vector<chat_message>& messages, bool add_generation_prompt) const;

  chat_format format() const { return format_; }
  const std::string& bos_text() const { return bos_text_; }
  const std::string& default_system() const { return default_system_; }

 private:
  chat_format format_ = chat_format::chatml;
  std::string bos_text_;
  std::string default_system_;  // ChatML: the system turn used when messages[0] is not system
};

}  // namespace kvq::server_detail
