// Byte-level BPE (GPT-2 style) as llama.cpp's llm_tokenizer_bpe_session: the text is split into
// words by the pre-tokenizer regexes of tokenizer.ggml.pre, each word's bytes are mapped through
// GPT-2 bytes_to_unicode, and inside each word adjacent symbols are merged by merge rank (lowest
// rank first, leftmost on ties) from tokenizer.ggml.merges. A final symbol that is not a token is
// emitted byte by byte when single-byte tokens exist (else dropped, as llama.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/gguf.h"
#include "tokenizer/regex_split.h"
#include "tokenizer/vocab.h"

namespace kvq::tok {

// One row per llama.cpp pre-tokenizer family: the tokenizer.ggml.pre names that select it, its
// regexes and the flags llama.cpp sets with it.
struct bpe_pre_row {
  const char* family;
  std::vector<std::string_view> names;
  std::vector<std::string> regexes;
  bool clean_spaces = true;
  bool ignore_merges = false;
  bool force_add_bos = false;  // llama.cpp sets add_bos = true (the GGUF key may still override)
  bool no_bos = false;         // llama.cpp sets the default BOS id to none
};

// The supported families; nullptr when `pre` is not one of their names.
const bpe_pre_row* find_bpe_pre(std::string_view pre);
// Comma-separated list of supported tokenizer.ggml.pre values (for error messages).
std::string supported_bpe_pres();

class bpe_model {
 public:
  // Reads tokenizer.ggml.merges. `v` must outlive the model.
  bpe_model(const gguf_file& f, const vocab& v, const bpe_pre_row& pre);
  // Tokenizes one raw-text fragment, appending ids to `out`.
  void tokenize(std::string_view text, std::vector<int32_t>& out) const;

 private:
  int32_t rank(std::string_view left, std::string_view right, std::string& key_buf) const;
  const vocab& v_;
  bool ignore_merges_;
  regex_splitter splitter_;
  token_map ranks_;  // key: u32 length of left (4 bytes, little-endian) + left + right
};

}  // namespace kvq::tok
