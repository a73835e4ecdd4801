// kvq::tokenizer over GGUF vocabularies: SPM ("llama") and byte-level BPE ("gpt2").
#include "kvq/tokenizer.h"

#include <fmt/format.h>

#include <optional>

#include "kvq/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/spm.h"
#include "tokenizer/vocab.h"

namespace kvq {

namespace {

class gguf_tokenizer final : public tokenizer {
 public:
  explicit gguf_tokenizer(const gguf_file& f) {
    using namespace tok;
    v_.model = f.get_string("tokenizer.ggml.model");
    v_.pre = f.try_string("tokenizer.ggml.pre").value_or("");
    const bpe_pre_row* pre = nullptr;
    if (v_.model == "llama") {
      v_.kind = vocab_kind::spm;
      v_.bos = 1, v_.eos = 2, v_.unk = 0;
      v_.add_space_prefix = true;
      v_.add_bos = true;
    } else if (v_.model == "gpt2") {
      v_.kind = vocab_kind::bpe;
      pre = find_bpe_pre(v_.pre);
      if (!pre)
        fail_unsupported(fmt::format("[tokenizer] {}: unsupported tokenizer.ggml.pre '{}' (supported: {})",
                                     f.path(), v_.pre, supported_bpe_pres()));
      v_.bos = pre->no_bos ? -1 : 11, v_.eos = 11, v_.unk = -1;
      v_.add_space_prefix = false;
      v_.ignore_merges = pre->ignore_merges;
      if (pre->force_add_bos) v_.add_bos = true;
    } else {
      fail_unsupported(fmt::format("[tokenizer] {}: unsupported tokenizer.ggml.model '{}' (supported: llama, gpt2)",
                                   f.path(), v_.model));
    }
    if (const gguf_value* sp = f.find("tokenizer.ggml.add_space_prefix")) {
      if (sp->type != gguf_value_type::boolean)
        fail_input(fmt::format("[tokenizer] {}: metadata 'tokenizer.ggml.add_space_prefix' has type {}, expected bool",
                               f.path(), gguf_value_type_name(sp->type)));
      v_.add_space_prefix = std::get<bool>(sp->scalar);
    }
    v_.load_common(f);
    if (pre) bpe_.emplace(f, v_, *pre);
    else build_spm_pairs(v_);
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_bos && v_.bos >= 0) out.push_back(v_.bos);
    const std::vector<tok::fragment> frags = v_.partition(text, parse_special);
    if (v_.kind == tok::vocab_kind::spm) {
      bool prev_special = true;  // the first text fragment gets the space prefix
      std::string buf;
      for (const tok::fragment& fr : frags) {
        if (fr.token >= 0) {
          out.push_back(fr.token);
          prev_special = true;
          continue;
        }
        buf.clear();
        buf.reserve(fr.length + fr.length / 2 + 3);
        if (v_.add_space_prefix && prev_special) buf += "\xE2\x96\x81";
        for (char c : text.substr(fr.offset, fr.length)) {
          if (c == ' ') buf += "\xE2\x96\x81";
          else buf.push_back(c);
        }
        tok::spm_tokenize(v_, buf, out);
        prev_special = false;
      }
    } else {
      for (const tok::fragment& fr : frags) {
        if (fr.token >= 0) out.push_back(fr.token);
        else bpe_->tokenize(text.substr(fr.offset, fr.length), out);
      }
    }
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids) s += piece(id);
    return s;
  }

  std::string token_to_piece(int32_t id, bool special = false) const override {
    if (!special) return piece(id);
    check(id);
    return v_.piece[id];  // llama_token_to_piece(special=true): control/unknown give their text
  }

  const std::string& token_text(int32_t id) const override {
    check(id);
    return v_.text[id];
  }

  int32_t n_vocab() const override { return v_.n_vocab(); }
  int32_t bos() const override { return v_.bos; }
  int32_t eos() const override { return v_.eos; }
  int32_t unk() const override { return v_.unk; }
  bool add_bos_default() const override { return v_.add_bos; }
  bool add_eos_default() const override { return v_.add_eos; }
  bool is_eog(int32_t id) const override { return id >= 0 && v_.eog.count(id) > 0; }
  const std::string& model_name() const override { return v_.model; }
  const std::string& pre_name() const override { return v_.pre; }

 private:
  void check(int32_t id) const {
    if (id < 0 || id >= v_.n_vocab())
      fail_input(fmt::format("[tokenizer] token id {} out of range [0, {})", id, v_.n_vocab()));
  }
  // llama_token_to_piece(special=false): control and unknown tokens render as nothing.
  const std::string& piece(int32_t id) const {
    static const std::string empty;
    check(id);
    if (v_.attr[id] & (tok::attr_control | tok::attr_unknown)) return empty;
    return v_.piece[id];
  }

  tok::vocab v_;
  std::optional<tok::bpe_model> bpe_;
};

}  // namespace

std::unique_ptr<tokenizer> tokenizer::from_gguf(const gguf_file& f) {
  return std::make_unique<gguf_tokenizer>(f);
}

}  // namespace kvq
