#include "tokenizer/spm.h"

#include <fmt/format.h>

#include <queue>

#include "kvq/error.h"
#include "tokenizer/unicode.h"

namespace kvq::tok {

namespace {

struct symbol {
  int32_t prev, next;
  uint32_t off, n;  // bytes of the text; n == 0 once merged into its left neighbour
};

struct bigram {
  float score;
  int32_t left, right;
  uint32_t size;  // bytes of left + right when the pair was queued
};

// Max-heap order: higher score first, then smaller left index (llm_bigram_spm::comparator).
struct bigram_less {
  bool operator()(const bigram& l, const bigram& r) const {
    return l.score < r.score || (l.score == r.score && l.left > r.left);
  }
};

}  // namespace

void spm_tokenize(const vocab& v, std::string_view text, std::vector<int32_t>& out) {
  if (text.empty()) return;
  if (text.size() > UINT32_MAX) fail_input(fmt::format("[tokenizer] text of {} bytes is too long", text.size()));
  std::vector<symbol> sym;  // [n_chars]
  sym.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    const size_t n = std::min(utf8_len(text[off]), text.size() - off);
    const int32_t i = static_cast<int32_t>(sym.size());
    sym.push_back({i - 1, off + n == text.size() ? -1 : i + 1, static_cast<uint32_t>(off),
                   static_cast<uint32_t>(n)});
    off += n;
  }

  std::vector<bigram> heap_storage;
  heap_storage.reserve(sym.size());
  std::priority_queue<bigram, std::vector<bigram>, bigram_less> queue(bigram_less{}, std::move(heap_storage));
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t size = sym[l].n + sym[r].n;
    const int32_t id = v.find(text.substr(sym[l].off, size));
    if (id < 0) return;
    queue.push({v.score[id], l, r, size});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);

  while (!queue.empty()) {
    const bigram b = queue.top();
    queue.pop();
    symbol& l = sym[b.left];
    symbol& r = sym[b.right];
    // stale: one side already merged away, or grown since the pair was queued
    if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  for (int32_t i = 0; i != -1; i = sym[i].next) {
    const std::string_view piece = text.substr(sym[i].off, sym[i].n);
    const int32_t id = v.find(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // Not a token (a character absent from the vocabulary): byte fallback. llama.cpp's
    // resegment() also consults a reverse-merge map, but every merge result is a token, so that
    // path can never apply to a symbol that is not one.
    for (char c : piece) {
      const int32_t bt = v.byte_token[static_cast<uint8_t>(c)];
      if (bt >= 0) {
        out.push_back(bt);
      } else if (v.unk >= 0) {
        out.push_back(v.unk);
      } else {
        fail_input(fmt::format("[tokenizer] no byte-fallback token <0x{:02X}> and no unknown token",
                               static_cast<uint8_t>(c)));
      }
    }
  }
}

}  // namespace kvq::tok
