#include "tokenizer/regex_split.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

#include "kvq/error.h"
#include "tokenizer/unicode.h"

namespace kvq::tok {

struct regex_splitter::compiled {
  std::string pattern;
  pcre2_code* code = nullptr;
  bool jit = false;
  ~compiled() {
    if (code) pcre2_code_free(code);
  }
};

regex_splitter::regex_splitter(const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns) {
    auto c = std::make_unique<compiled>();
    c->pattern = p;
    int err = 0;
    PCRE2_SIZE err_off = 0;
    // DOLLAR_ENDONLY: '$' is the end of the piece only (ECMAScript/std::regex), not before a
    // final newline.
    c->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(),
                            PCRE2_UTF | PCRE2_DOLLAR_ENDONLY, &err, &err_off, nullptr);
    if (!c->code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      fail(errc::internal, fmt::format("[tokenizer] cannot compile pre-tokenizer regex '{}' at {}: {}",
                                       p, err_off, reinterpret_cast<const char*>(msg)));
    }
    c->jit = pcre2_jit_compile(c->code, PCRE2_JIT_COMPLETE) == 0;
    rx_.push_back(std::move(c));
  }
}

regex_splitter::~regex_splitter() = default;

std::vector<std::string> regex_splitter::split(std::string_view text, bool byte_encode) const {
  const std::vector<uint32_t> cpts = cpts_from_utf8(text);
  const size_t n_cpts = cpts.size();

  // The subject PCRE2 sees: valid UTF-8, non-ASCII White_Space as U+000B, surrogates and values
  // past U+10FFFF (decodable from malformed input) as U+FFFD. byte_pos[i] = byte offset of cpt i.
  std::string subject;
  subject.reserve(text.size());
  std::vector<uint32_t> byte_pos(n_cpts + 1);
  for (size_t i = 0; i < n_cpts; ++i) {
    byte_pos[i] = static_cast<uint32_t>(subject.size());
    uint32_t c = cpts[i];
    if (c > 0x7F && is_unicode_whitespace(c)) c = 0x0B;
    else if ((c >= 0xD800 && c <= 0xDFFF) || c > 0x10FFFF) c = k_replacement_cpt;
    append_utf8(subject, c);
  }
  byte_pos[n_cpts] = static_cast<uint32_t>(subject.size());
  if (subject.size() > UINT32_MAX - 1)
    fail_input(fmt::format("[tokenizer] text of {} bytes is too long", text.size()));
  // cpt index of a byte offset that starts a codepoint
  std::vector<uint32_t> cpt_at(subject.size() + 1, 0);
  for (size_t i = 0; i <= n_cpts; ++i) cpt_at[byte_pos[i]] = static_cast<uint32_t>(i);

  std::vector<size_t> pieces{n_cpts};  // lengths in codepoints, as llama.cpp's bpe_offsets
  if (n_cpts == 0) pieces.clear();
  pcre2_match_data* md = nullptr;
  std::vector<size_t> next;
  for (const auto& rx : rx_) {
    if (!md) md = pcre2_match_data_create(1, nullptr);
    next.clear();
    next.reserve(pieces.size() * 2);
    size_t start = 0;
    for (size_t len : pieces) {
      const size_t b0 = byte_pos[start], b1 = byte_pos[start + len];
      const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data() + b0);
      const size_t subj_len = b1 - b0;
      size_t pos = 0;       // bytes, relative to b0
      size_t prev_end = 0;  // bytes, relative to b0
      uint32_t opts = 0;    // after an empty match: look for a non-empty one at the same place
      while (pos <= subj_len) {
        int rc = rx->jit ? pcre2_jit_match(rx->code, subj, subj_len, pos, opts, md, nullptr)
                         : PCRE2_ERROR_JIT_BADOPTION;
        if (rc == PCRE2_ERROR_JIT_BADOPTION || rc == PCRE2_ERROR_JIT_STACKLIMIT)
          rc = pcre2_match(rx->code, subj, subj_len, pos, opts | PCRE2_NO_UTF_CHECK, md, nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) {
          if (opts == 0 || pos >= subj_len) break;
          pos += utf8_len(subject[b0 + pos]);  // std::regex_iterator: step past the empty match
          opts = 0;
          continue;
        }
        if (rc < 0) {
          pcre2_match_data_free(md);
          PCRE2_UCHAR msg[256];
          pcre2_get_error_message(rc, msg, sizeof(msg));
          fail(errc::internal, fmt::format("[tokenizer] pre-tokenizer regex '{}' failed: {}", rx->pattern,
                                           reinterpret_cast<const char*>(msg)));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        const size_t ms = ov[0], me = ov[1];
        if (ms > prev_end) next.push_back(cpt_at[b0 + ms] - cpt_at[b0 + prev_end]);
        if (me > ms) next.push_back(cpt_at[b0 + me] - cpt_at[b0 + ms]);  // empty pieces make no tokens
        prev_end = pos = me;
        opts = me == ms ? (PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED) : 0;
      }
      if (prev_end < subj_len) next.push_back(cpt_at[b1] - cpt_at[b0 + prev_end]);
      start += len;
    }
    pieces.swap(next);
  }
  if (md) pcre2_match_data_free(md);

  std::vector<std::string> words;
  words.reserve(pieces.size());
  std::string utf8;
  size_t start = 0;
  for (size_t len : pieces) {
    utf8.clear();
    for (size_t i = start; i < start + len; ++i) append_utf8(utf8, cpts[i]);
    start += len;
    if (!byte_encode) {
      words.push_back(utf8);
      continue;
    }
    std::string w;
    w.reserve(utf8.size() * 2);
    for (char c : utf8) w += byte_to_unicode(static_cast<uint8_t>(c));
    words.push_back(std::move(w));
  }
  return words;
}

}  // namespace kvq::tok
