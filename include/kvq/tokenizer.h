// Tokenizers read from GGUF metadata (tokenizer.ggml.*), matching llama.cpp's llama-vocab:
//  - "llama": SentencePiece-style (scores, byte fallback <0xNN>, BOS/EOS/UNK, space prefix "▁").
//    Encoding is llama.cpp's llm_tokenizer_spm: the whole text fragment is split into UTF-8
//    characters and adjacent pairs are merged greedily by vocabulary score (highest first, leftmost
//    on ties) while the merged string is a token; leftovers fall back to <0xNN> byte tokens.
//  - "gpt2": byte-level BPE with merges and the pre-tokenizer regexes named by
//    tokenizer.ggml.pre (gpt-2/default, llama3/llama-bpe, qwen2, deepseek-llm, ...) via PCRE2.
//    Merges are applied by rank (lowest first, leftmost on ties) inside each pre-token (Sennrich et
//    al. 2016, "Neural Machine Translation of Rare Words with Subword Units"; GPT-2 byte mapping).
// Before either, the text is split on the strings of user-defined tokens (always) and of
// control/unknown tokens (only with parse_special), as llama.cpp's tokenizer_st_partition.
// All strings are UTF-8 bytes; ids are vocabulary indices in [0, n_vocab()).
// Thread safety: a tokenizer is immutable after from_gguf(); all const methods may run
// concurrently.
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
  // llama.cpp's llama_tokenize(add_special=true) equals encode(text, add_bos_default(), ...) plus
  // EOS when add_eos_default(). Invalid UTF-8 never throws: SPM keeps the raw bytes (byte
  // fallback); BPE replaces each invalid byte by U+FFFD as llama.cpp does.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const = 0;
  // Concatenated pieces; special/control tokens render as empty (as llama.cpp with special=false).
  // Unlike llama_detokenize this neither strips the SPM leading space nor "cleans" spaces, so for
  // SPM decode(encode(s, false, false)) == " " + s and for BPE it equals s (valid UTF-8 s).
  // Throws invalid_input for an id outside [0, n_vocab()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // Raw bytes of one token (byte-fallback tokens give their byte; "▁" becomes ' '); control and
  // unknown tokens give "" (llama_token_to_piece with special=false), or with special = true
  // their vocabulary text such as "<start_of_turn>" (llama_token_to_piece with special=true, as
  // llama-tokenize --show-pieces prints them); user-defined tokens give their text. Throws
  // invalid_input for an id outside [0, n_vocab()).
  virtual std::string token_to_piece(int32_t id, bool special = false) const = 0;
  // The vocabulary string as stored in tokenizer.ggml.tokens (e.g. "▁the", "<0x0A>", "Ġthe").
  virtual const std::string& token_text(int32_t id) const = 0;

  virtual int32_t n_vocab() const = 0;
  virtual int32_t bos() const = 0;  // -1 when absent
  virtual int32_t eos() const = 0;  // -1 when absent
  virtual int32_t unk() const = 0;  // -1 when absent
  virtual bool add_bos_default() const = 0;  // tokenizer.ggml.add_bos_token (default per model)
  virtual bool add_eos_default() const = 0;  // tokenizer.ggml.add_eos_token (default false)
  virtual bool is_eog(int32_t id) const = 0;  // EOS, EOT or other end-of-generation token
  // tokenizer.ggml.model ("llama" or "gpt2") and tokenizer.ggml.pre ("" when absent).
  virtual const std::string& model_name() const = 0;
  virtual const std::string& pre_name() const = 0;
};

}  // namespace kvq
