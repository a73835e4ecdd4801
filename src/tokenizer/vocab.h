// Vocabulary shared by the SPM and BPE tokenizers: token strings, scores, attributes, special ids
// and flags read from GGUF tokenizer.ggml.* keys with llama.cpp's defaults and fix-ups
// (llama-vocab.cpp llama_vocab::impl::load), plus the special-token partition of the input text.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvq/gguf.h"

namespace kvq::tok {

// Token attributes (llama.h llama_token_attr bit values).
enum token_attr : uint32_t {
  attr_undefined = 0,
  attr_unknown = 1u << 0,
  attr_unused = 1u << 1,
  attr_normal = 1u << 2,
  attr_control = 1u << 3,
  attr_user_defined = 1u << 4,
  attr_byte = 1u << 5,
  attr_normalized = 1u << 6,
  attr_lstrip = 1u << 7,
  attr_rstrip = 1u << 8,
  attr_single_word = 1u << 9,
};

enum class vocab_kind { spm, bpe, count };

// string_view-keyed hash map lookups without building a std::string.
struct sv_hash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using token_map = std::unordered_map<std::string, int32_t, sv_hash, std::equal_to<>>;

// A piece of the input after the special-token partition: either raw text [offset, offset+length)
// of the input, or one token id.
struct fragment {
  int32_t token = -1;  // -1: raw text
  size_t offset = 0;
  size_t length = 0;
};

struct vocab {
  vocab_kind kind = vocab_kind::spm;
  std::string model;  // tokenizer.ggml.model
  std::string pre;    // tokenizer.ggml.pre

  std::vector<std::string> text;   // [n_vocab]
  std::vector<float> score;        // [n_vocab]
  std::vector<uint32_t> attr;      // [n_vocab] token_attr bits
  token_map to_id;                 // text -> id (first id wins on duplicates)

  int32_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, sep = -1, pad = -1, mask = -1;
  int32_t fim_pre = -1, fim_suf = -1, fim_mid = -1, fim_pad = -1, fim_rep = -1, fim_sep = -1;
  bool add_space_prefix = false, add_bos = false, add_eos = false, add_sep = false;
  bool ignore_merges = false, clean_spaces = false;
  std::set<int32_t> eog;

  std::vector<int32_t> special_by_length;  // control/user-defined/unknown ids, longest text first
  std::vector<std::string> piece;          // [n_vocab] llama token_to_piece(special=true)
  int32_t byte_token[256];                 // SPM byte fallback id per byte value (-1: none)
  // SPM: every pair of adjacent characters inside some token, each character packed as its
  // (up to 4) UTF-8 bytes; key = first << 32 | second.
  std::unordered_set<uint64_t> spm_pairs;

  int32_t n_vocab() const { return static_cast<int32_t>(text.size()); }
  int32_t find(std::string_view s) const {
    auto it = to_id.find(s);
    return it == to_id.end() ? -1 : it->second;
  }

  // Reads tokens, scores, types, special ids and flags. `kind` and the kind-specific defaults
  // (BOS/EOS/UNK ids, add_bos, add_space_prefix, ...) are set by the caller before this.
  void load_common(const gguf_file& f);
  // Splits `text` on special token strings: user-defined tokens always, control/unknown tokens
  // only when parse_special. Honours lstrip/rstrip attributes.
  std::vector<fragment> partition(std::string_view text, bool parse_special) const;

 private:
  void detect_special_tokens();
  void build_caches();
  void apply_model_attrs(const gguf_file& f);
};

}  // namespace kvq::tok
