#include "tokenizer/spm.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvq/error.h"
#include "tokenizer/symbol_merge.h"
#include "tokenizer/unicode.h"

namespace kvq::tok {

namespace {

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

static uint64_t spm_char_key(std::string_view c) {
  uint32_t k = 0;
  for (size_t i = 0; i < c.size() && i < 4; ++i) k |= static_cast<uint32_t>(static_cast<uint8_t>(c[i])) << (8 * i);
  return k;
}

void spm_tokenize(const vocab& v, std::string_view text, std::vector<int32_t>& out, bool segment) {
  if (text.empty()) return;
  if (text.size() > UINT32_MAX) fail_input(fmt::format("[tokenizer] text of {} bytes is too long", text.size()));
  std::vector<merge_symbol> sym;  // [n_chars]
  utf8_symbols(text, sym);
  const int32_t n_sym = static_cast<int32_t>(sym.size());

  std::vector<bigram> heap;
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t size = sym[l].n + sym[r].n;
    const int32_t id = v.find(text.substr(sym[l].off, size));
    if (id < 0) return;
    heap.push_back({v.score[id], l, r, size});
    std::push_heap(heap.begin(), heap.end(), bigram_less{});
  };

  // Merge inside [s, e). A boundary between two characters that never appear next to each other
  // in any token can never be merged across, so the segments on either side evolve
  // independently and the result equals merging the whole text at once (llama.cpp), with small
  // heaps instead of one of the text's size.
  auto merge_range = [&](int32_t s, int32_t e) {
    sym[s].prev = -1;
    sym[e - 1].next = -1;
    heap.clear();
    for (int32_t i = s + 1; i < e; ++i) try_add(i - 1, i);
    merge_best_pairs<bigram_less>(sym, heap, try_add);
  };
  std::vector<int32_t> seg_starts{0};
  if (segment) {
    for (int32_t i = 1; i < n_sym; ++i) {
      const uint64_t key = spm_char_key(text.substr(sym[i - 1].off, sym[i - 1].n)) << 32 |
                           spm_char_key(text.substr(sym[i].off, sym[i].n));
      if (!v.spm_pairs.count(key)) seg_starts.push_back(i);
    }
  }
  for (size_t k = 0; k < seg_starts.size(); ++k)
    merge_range(seg_starts[k], k + 1 < seg_starts.size() ? seg_starts[k + 1] : n_sym);

  for (const int32_t s : seg_starts) {
    for (int32_t i = s; i != -1; i = sym[i].next) {
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
}

void build_spm_pairs(vocab& v) {
  v.spm_pairs.clear();
  for (const std::string& t : v.text) {
    uint64_t prev = 0;
    bool have_prev = false;
    for (size_t off = 0; off < t.size();) {
      const size_t n = std::min(utf8_len(t[off]), t.size() - off);
      const uint64_t k = spm_char_key(std::string_view(t).substr(off, n));
      if (have_prev) v.spm_pairs.insert(prev << 32 | k);
      prev = k;
      have_prev = true;
      off += n;
    }
  }
}

}  // namespace kvq::tok
