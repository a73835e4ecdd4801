// Pre-tokenizer: split text into words with a list of regexes, as llama.cpp's
// unicode_regex_split(): each regex further splits every piece produced by the previous one
// (matches and the gaps between them both become pieces), and each piece is matched on its own
// (lookarounds and $ do not see neighbouring pieces). Matching is PCRE2 in UTF mode with JIT.
//
// Whitespace follows llama.cpp: it feeds its regex engines non-ASCII White_Space codepoints as
// U+000B, so \s means exactly Unicode White_Space and a literal U+3000 in a class never matches.
// kvq does the same substitution and compiles without PCRE2_UCP (\s, \d, \w are ASCII; \p{..}
// stays Unicode).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::tok {

class regex_splitter {
 public:
  // Compiles the patterns (PCRE2 syntax); throws kvq::error(internal) naming a bad pattern.
  explicit regex_splitter(const std::vector<std::string>& patterns);
  ~regex_splitter();
  regex_splitter(const regex_splitter&) = delete;
  regex_splitter& operator=(const regex_splitter&) = delete;

  // Words of `text` (UTF-8; each invalid byte becomes U+FFFD first, as llama.cpp). With
  // byte_encode, each word's UTF-8 bytes are mapped through GPT-2 bytes_to_unicode.
  std::vector<std::string> split(std::string_view text, bool byte_encode) const;

 private:
  struct compiled;
  std::vector<std::unique_ptr<compiled>> rx_;
};

}  // namespace kvq::tok
