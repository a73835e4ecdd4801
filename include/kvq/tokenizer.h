// Tokenizers read from GGUF metadata (tokenizer.ggml.*), matching llama.cpp's llama-vocab:
//  - "llama": SentencePiece-style (scores, byte fallback <0xNN>, BOS/EOS/UNK, space prefix "▁").
//  - "gpt2": byte-level BPE with merges and the pre-tokenizer regexes named by
//    tokenizer.ggml.pre (gpt-2/default, llama3/llama-bpe, qwen2, deepseek-llm, ...) via PCRE2.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/gguf.h"

namespace kvq {

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  // Throws invalid_input naming the key when tokenizer metadata is missing or inconsistent,
  // unsupported for an unknown tokenizer.ggml.model / tokenizer.ggml.pre.
  static std::unique_ptr<tokenizer> from_gguf(const gguf_file& f);

  // add_bos: prepend BOS (when the vocabulary has one). parse_special: recognise control tokens
  // such as "<s>" written in the text (llama.cpp's parse_special).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const = 0;
  // Concatenated pieces; special/control tokens render as empty (as llama.cpp with special=false).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // Raw bytes of one token (byte-fallback tokens give their byte; "▁" becomes ' ').
  virtual std::string token_to_piece(int32_t id) const = 0;

  virtual int32_t n_vocab() const = 0;
  virtual int32_t bos() const = 0;  // -1 when absent
  virtual int32_t eos() const = 0;  // -1 when absent
  virtual bool add_bos_default() const = 0;  // tokenizer.ggml.add_bos_token (default per model)
  virtual bool is_eog(int32_t id) const = 0;  // EOS, EOT or other end-of-generation token
};

}  // namespace kvq
