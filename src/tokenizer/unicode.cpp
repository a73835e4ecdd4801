#include "tokenizer/unicode.h"

#include <array>

namespace kvq::tok {

std::vector<uint32_t> cpts_from_utf8(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  const size_t n = s.size();
  auto cont = [&](size_t i) { return i < n && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80; };
  size_t i = 0;
  while (i < n) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    auto u = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
    if (b < 0x80) {
      out.push_back(b);
      i += 1;
    } else if ((b & 0x40) == 0) {  // stray continuation byte
      out.push_back(k_replacement_cpt);
      i += 1;
    } else if ((b & 0x20) == 0) {
      if (!cont(i + 1)) { out.push_back(k_replacement_cpt); i += 1; continue; }
      out.push_back(((b & 0x1Fu) << 6) | (u(1) & 0x3F));
      i += 2;
    } else if ((b & 0x10) == 0) {
      if (!cont(i + 1) || !cont(i + 2)) { out.push_back(k_replacement_cpt); i += 1; continue; }
      out.push_back(((b & 0x0Fu) << 12) | ((u(1) & 0x3F) << 6) | (u(2) & 0x3F));
      i += 3;
    } else if ((b & 0x08) == 0) {
      if (!cont(i + 1) || !cont(i + 2) || !cont(i + 3)) {
        out.push_back(k_replacement_cpt);
        i += 1;
        continue;
      }
      out.push_back(((b & 0x07u) << 18) | ((u(1) & 0x3F) << 12) | ((u(2) & 0x3F) << 6) |
                    (u(3) & 0x3F));
      i += 4;
    } else {  // 0xF8..0xFF never start a sequence
      out.push_back(k_replacement_cpt);
      i += 1;
    }
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cpt) {
  if (cpt <= 0x7F) {
    out.push_back(static_cast<char>(cpt));
  } else if (cpt <= 0x7FF) {
    out.push_back(static_cast<char>(0xC0 | (cpt >> 6)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else if (cpt <= 0xFFFF) {
    out.push_back(static_cast<char>(0xE0 | (cpt >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else if (cpt <= 0x10FFFF) {
    out.push_back(static_cast<char>(0xF0 | (cpt >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else {
    append_utf8(out, k_replacement_cpt);
  }
}

namespace {

bool is_printable_byte(int b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

struct byte_tables {
  std::array<std::string, 256> to_unicode;
  std::array<int16_t, 512> from_cpt;  // mapped codepoints are all below 0x100 + 68
  byte_tables() {
    from_cpt.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cpt = is_printable_byte(b) ? static_cast<uint32_t>(b) : 256u + n++;
      append_utf8(to_unicode[b], cpt);
      from_cpt[cpt] = static_cast<int16_t>(b);
    }
  }
};

const byte_tables& tables() {
  static const byte_tables t;
  return t;
}

}  // namespace

const std::string& byte_to_unicode(uint8_t b) { return tables().to_unicode[b]; }

int unicode_to_byte(uint32_t cpt) { return cpt < 512 ? tables().from_cpt[cpt] : -1; }

bool is_unicode_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

}  // namespace kvq::tok
