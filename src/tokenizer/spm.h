// SentencePiece-style BPE by score, as llama.cpp's llm_tokenizer_spm_session (which follows the
// original SentencePiece bpe_model.cc): start from UTF-8 characters, repeatedly merge the adjacent
// pair whose concatenation is a vocabulary token with the highest score (leftmost on ties), then
// emit each final symbol as its token or, when it is not one, as byte-fallback tokens <0xNN>.
// Symbols form a doubly linked list and candidate pairs a max-heap, so a text of n bytes costs
// O(n log n) (no rescans of the whole text per merge).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/vocab.h"

namespace kvq::tok {

// `text` is already escaped (' ' -> U+2581) and prefixed as the caller wants. Appends to `out`.
// segment = false runs llama.cpp's literal single-heap loop over the whole text (the reference
// for tests); segment = true first cuts the text where no token can span (see vocab::spm_pairs)
// and gives identical ids.
void spm_tokenize(const vocab& v, std::string_view text, std::vector<int32_t>& out, bool segment = true);

// Fills v.spm_pairs from the token strings.
void build_spm_pairs(vocab& v);

}  // namespace kvq::tok
