// The merge loop shared by the SPM and BPE tokenizers (llama.cpp llm_tokenizer_spm_session and
// llm_tokenizer_bpe_session): the text is a linked list of symbols, one per UTF-8 character at the
// start; a heap holds candidate pairs of adjacent symbols, the best on top; each step merges the
// best pair into its left symbol unless the pair is stale, then offers the new neighbours to
// try_add. The tokenizers differ only in how a pair is scored (SPM: vocabulary score of the joined
// text, BPE: merge rank) and so in the heap order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "tokenizer/unicode.h"

namespace kvq::tok {

struct merge_symbol {
  int32_t prev, next;  // neighbours in the list, -1 at the ends
  uint32_t off, n;     // bytes of the text; n == 0 once merged into its left neighbour
};

// sym = one symbol per UTF-8 character of text (a truncated final sequence is one symbol).
inline void utf8_symbols(std::string_view text, std::vector<merge_symbol>& sym) {
  sym.clear();
  sym.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    const size_t n = std::min(utf8_len(text[off]), text.size() - off);
    const int32_t i = static_cast<int32_t>(sym.size());
    sym.push_back({i - 1, off + n == text.size() ? -1 : i + 1, static_cast<uint32_t>(off), static_cast<uint32_t>(n)});
    off += n;
  }
}

// Pair: {score or rank, int32_t left, right, uint32_t size (bytes of left + right when queued)};
// HeapOrder: the std::push_heap comparison that puts the pair to merge first on top.
// try_add(l, r): queues the pair (l, r) when it can merge (l or r may be -1).
template <class HeapOrder, class Pair, class TryAdd>
void merge_best_pairs(std::vector<merge_symbol>& sym, std::vector<Pair>& heap, TryAdd&& try_add) {
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), HeapOrder{});
    const Pair b = heap.back();
    heap.pop_back();
    merge_symbol& l = sym[b.left];
    merge_symbol& r = sym[b.right];
    // stale: a side was merged away or grew since the pair was queued (llama.cpp compares the
    // texts, which for adjacent live symbols is the same test)
    if (l.n == 0 || r.n == 0 || l.n + r.n != b.size) continue;
    l.n += r.n;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }
}

}  // namespace kvq::tok
