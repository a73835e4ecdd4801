// UTF-8 and GPT-2 byte<->unicode helpers with llama.cpp's exact (lenient) semantics
// (llama.cpp src/unicode.cpp: unicode_len_utf8, unicode_cpt_from_utf8, unicode_byte_to_utf8).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::tok {

// Byte length of a UTF-8 sequence from its first byte's high nibble (1 for continuation bytes).
inline size_t utf8_len(char c) {
  static constexpr uint8_t k_len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return k_len[static_cast<uint8_t>(c) >> 4];
}

constexpr uint32_t k_replacement_cpt = 0xFFFD;

// Codepoints of `s`. An invalid or truncated sequence consumes one byte and yields U+FFFD.
// Overlong forms and surrogates are decoded as their value, as llama.cpp does.
std::vector<uint32_t> cpts_from_utf8(std::string_view s);

// Appends the UTF-8 encoding of `cpt` (values above U+10FFFF append U+FFFD).
void append_utf8(std::string& out, uint32_t cpt);

// GPT-2 bytes_to_unicode: the printable bytes map to themselves, the other 68 bytes to U+0100..
// in byte order. byte_to_unicode(b) is the UTF-8 of that codepoint.
const std::string& byte_to_unicode(uint8_t b);
// Inverse on codepoints: the byte for a mapped codepoint, or -1.
int unicode_to_byte(uint32_t cpt);

// Unicode White_Space (the set llama.cpp's unicode tables mark is_whitespace).
bool is_unicode_whitespace(uint32_t cpt);

}  // namespace kvq::tok
