#include "tokenizer/vocab.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <initializer_list>

#include "kvq/error.h"
#include "tokenizer/unicode.h"

namespace kvq::tok {

namespace {

// tokenizer.ggml.token_type values (llama.h llama_token_type).
uint32_t attr_from_type(int64_t t) {
  switch (t) {
    case 1: return attr_normal;
    case 2: return attr_unknown;
    case 3: return attr_control;
    case 4: return attr_user_defined;
    case 5: return attr_unused;
    case 6: return attr_byte;
    default: return attr_undefined;  // 0 = undefined, anything else too
  }
}

const gguf_value* find_array(const gguf_file& f, const std::string& key) {
  const gguf_value* v = f.find(key);
  if (v && v->type != gguf_value_type::array)
    fail_input(fmt::format("[tokenizer] {}: metadata '{}' has type {}, expected an array", f.path(),
                           key, gguf_value_type_name(v->type)));
  return v;
}

// Optional boolean key (llama.cpp's get_key(..., false)); bool or integer accepted.
bool read_flag(const gguf_file& f, const std::string& key, bool& out) {
  const gguf_value* v = f.find(key);
  if (!v) return false;
  if (v->type == gguf_value_type::boolean) {
    out = std::get<bool>(v->scalar);
    return true;
  }
  if (auto i = f.try_int(key)) {
    out = *i != 0;
    return true;
  }
  fail_input(fmt::format("[tokenizer] {}: metadata '{}' has type {}, expected a bool", f.path(), key,
                         gguf_value_type_name(v->type)));
}

bool is_c_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

bool contains_any(const std::string& s, std::initializer_list<std::string_view> subs) {
  for (auto sub : subs)
    if (s.find(sub) != std::string::npos) return true;
  return false;
}

}  // namespace

void vocab::load_common(const gguf_file& f) {
  const std::string k_tokens = "tokenizer.ggml.tokens";
  const gguf_value* toks = find_array(f, k_tokens);
  if (!toks) fail_input(fmt::format("[tokenizer] {}: missing metadata '{}'", f.path(), k_tokens));
  if (toks->elem_type != gguf_value_type::string)
    fail_input(fmt::format("[tokenizer] {}: '{}' is an array of {}, expected strings", f.path(),
                           k_tokens, gguf_value_type_name(toks->elem_type)));
  const size_t n = toks->arr_str.size();
  if (n == 0) fail_input(fmt::format("[tokenizer] {}: '{}' is empty", f.path(), k_tokens));
  if (n > static_cast<size_t>(INT32_MAX))
    fail_input(fmt::format("[tokenizer] {}: '{}' has {} entries", f.path(), k_tokens, n));

  const gguf_value* scores = find_array(f, "tokenizer.ggml.scores");
  if (scores) {
    const size_t ns = scores->arr_float.empty() ? scores->arr_int.size() : scores->arr_float.size();
    if (scores->elem_type != gguf_value_type::f32 && scores->elem_type != gguf_value_type::i32)
      fail_input(fmt::format("[tokenizer] {}: 'tokenizer.ggml.scores' is an array of {}, expected f32",
                             f.path(), gguf_value_type_name(scores->elem_type)));
    if (ns < n)
      fail_input(fmt::format("[tokenizer] {}: 'tokenizer.ggml.scores' has {} entries for {} tokens",
                             f.path(), ns, n));
  }
  const gguf_value* types = find_array(f, "tokenizer.ggml.token_type");
  if (types) {
    if (types->elem_type != gguf_value_type::i32)
      fail_input(fmt::format("[tokenizer] {}: 'tokenizer.ggml.token_type' is an array of {}, expected i32",
                             f.path(), gguf_value_type_name(types->elem_type)));
    if (types->arr_int.size() < n)
      fail_input(fmt::format("[tokenizer] {}: 'tokenizer.ggml.token_type' has {} entries for {} tokens",
                             f.path(), types->arr_int.size(), n));
  }

  text.resize(n);
  score.assign(n, 0.0f);
  attr.assign(n, attr_normal);
  to_id.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    std::string w = toks->arr_str[i];
    if (w.empty()) w = "[EMPTY_" + std::to_string(i) + "]";  // as llama.cpp
    to_id.emplace(w, static_cast<int32_t>(i));
    text[i] = std::move(w);
    if (scores)
      score[i] = scores->arr_float.empty() ? static_cast<float>(scores->arr_int[i])
                                           : static_cast<float>(scores->arr_float[i]);
    if (types) attr[i] = attr_from_type(types->arr_int[i]);
  }

  // Special token ids: a default outside the vocabulary is disabled; a stored id outside it is
  // ignored (llama.cpp warns and keeps the default).
  const std::pair<const char*, int32_t*> ids[] = {
      {"tokenizer.ggml.bos_token_id", &bos},        {"tokenizer.ggml.eos_token_id", &eos},
      {"tokenizer.ggml.eot_token_id", &eot},        {"tokenizer.ggml.eom_token_id", &eom},
      {"tokenizer.ggml.unknown_token_id", &unk},    {"tokenizer.ggml.seperator_token_id", &sep},
      {"tokenizer.ggml.padding_token_id", &pad},    {"tokenizer.ggml.mask_token_id", &mask},
      {"tokenizer.ggml.fim_pre_token_id", &fim_pre}, {"tokenizer.ggml.fim_suf_token_id", &fim_suf},
      {"tokenizer.ggml.fim_mid_token_id", &fim_mid}, {"tokenizer.ggml.fim_pad_token_id", &fim_pad},
      {"tokenizer.ggml.fim_rep_token_id", &fim_rep}, {"tokenizer.ggml.fim_sep_token_id", &fim_sep},
      {"tokenizer.ggml.prefix_token_id", &fim_pre},  {"tokenizer.ggml.suffix_token_id", &fim_suf},
      {"tokenizer.ggml.middle_token_id", &fim_mid},
  };
  for (const auto& [key, id] : ids) {
    if (*id >= 0 && *id >= n_vocab()) *id = -1;
    const gguf_value* v = f.find(key);
    if (!v) continue;
    const auto x = f.try_int(key);  // throws naming the key when not an integer
    if (x && *x >= 0 && *x < n_vocab()) *id = static_cast<int32_t>(*x);
  }

  read_flag(f, "tokenizer.ggml.add_bos_token", add_bos);
  read_flag(f, "tokenizer.ggml.add_eos_token", add_eos);
  read_flag(f, "tokenizer.ggml.add_sep_token", add_sep);
  const std::pair<bool, std::pair<int32_t, const char*>> checks[] = {
      {add_bos, {bos, "bos"}}, {add_eos, {eos, "eos"}}, {add_sep, {sep, "seperator"}}};
  for (const auto& [on, idname] : checks)
    if (on && idname.first < 0)
      fail_input(fmt::format("[tokenizer] {}: tokenizer.ggml.add_{}_token is true, but "
                             "tokenizer.ggml.{}_token_id is not set",
                             f.path(), std::string_view(idname.second).substr(0, 3), idname.second));

  for (int b = 0; b < 256; ++b) byte_token[b] = -1;
  if (kind == vocab_kind::spm) {
    static const char* hex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      const char buf[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
      int32_t id = find(buf);
      if (id < 0) id = find(std::string(1, static_cast<char>(b)));
      byte_token[b] = id;
    }
  }

  detect_special_tokens();
  build_caches();
  apply_model_attrs(f);
}

void vocab::detect_special_tokens() {
  // llama.cpp finds EOT/EOM/FIM and end-of-generation tokens by their text and forces them to
  // control type. It walks an unordered_map; kvq walks ids in order (deterministic).
  auto force_control = [&](int32_t id) { attr[id] |= attr_control; };
  auto detect = [&](int32_t& slot, std::initializer_list<std::string_view> names) {
    if (slot >= 0) return;
    for (int32_t id = 0; id < n_vocab(); ++id) {
      if (to_id.at(text[id]) != id) continue;  // duplicate text: only the mapped id counts
      for (auto nm : names)
        if (text[id] == nm) {
          slot = id;
          force_control(id);
          return;
        }
    }
  };
  detect(eot, {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
               "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
               "<end_of_utterance>"});
  detect(eom, {"<|eom_id|>"});
  detect(fim_pre, {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                   "▁<PRE>", "<|code_prefix|>", "<|prefix|>"});
  detect(fim_suf, {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                   "▁<SUF>", "<|code_suffix|>", "<|suffix|>"});
  detect(fim_mid, {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                   "▁<MID>", "<|code_middle|>", "<|middle|>"});
  detect(fim_pad, {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"});
  detect(fim_rep, {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"});
  detect(fim_sep, {"<|file_sep|>"});

  // Control tokens whose text says "unused" are unused.
  for (int32_t id = 0; id < n_vocab(); ++id)
    if ((attr[id] & attr_control) && text[id].find("unused") != std::string::npos)
      attr[id] |= attr_unused;

  eog.clear();
  for (int32_t id : {fim_pad, fim_rep, fim_sep})
    if (id >= 0) eog.insert(id);
  static const std::string_view k_eog_text[] = {
      "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
      "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
      "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
      "<｜end▁of▁sentence｜>", "[e~["};
  for (const auto& nm : k_eog_text) {
    const int32_t id = find(nm);
    if (id < 0) continue;
    eog.insert(id);
    force_control(id);
  }
  // gpt-oss: always render these.
  for (std::string_view nm : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
    if (const int32_t id = find(nm); id >= 0) attr[id] = attr_user_defined;
  for (int32_t id : {eos, eot, eom})
    if (id >= 0) eog.insert(id);

  // o200k_harmony / solar-open: "<|end|>" is not end-of-generation when <|return|>+<|call|> or
  // <|calls|>+<|flush|> are.
  auto in_eog = [&](std::string_view nm) {
    const int32_t id = find(nm);
    return id >= 0 && eog.count(id) ? id : -1;
  };
  const int32_t end_id = in_eog("<|end|>");
  const bool has_call = in_eog("<|call|>") >= 0 || in_eog("<|calls|>") >= 0;
  if (end_id >= 0 && has_call && (in_eog("<|return|>") >= 0 || in_eog("<|flush|>") >= 0)) {
    eog.erase(end_id);
    attr[end_id] = attr_user_defined;
  }
  // gemma4 / paddleocr: "</s>" is not end-of-generation next to "<|tool_response>".
  const int32_t s_id = in_eog("</s>");
  if (s_id >= 0 && in_eog("<|tool_response>") >= 0) {
    eog.erase(s_id);
    attr[s_id] = attr_normal;
  }
}

void vocab::build_caches() {
  special_by_length.clear();
  for (int32_t id = 0; id < n_vocab(); ++id)
    if (attr[id] & (attr_control | attr_user_defined | attr_unknown)) special_by_length.push_back(id);
  // llama.cpp uses an unstable sort by length; ties here keep id order.
  std::stable_sort(special_by_length.begin(), special_by_length.end(),
                   [&](int32_t a, int32_t b) { return text[a].size() > text[b].size(); });

  // token_to_piece with special=true (llama.cpp's cache_token_to_piece).
  piece.assign(text.size(), std::string());
  for (int32_t id = 0; id < n_vocab(); ++id) {
    const uint32_t a = attr[id];
    const std::string& t = text[id];
    std::string& p = piece[id];
    if (a & (attr_unknown | attr_control | attr_user_defined)) {
      p = t;
    } else if (a & attr_normal) {
      if (kind == vocab_kind::spm) {
        // unescape U+2581 -> ' '
        for (size_t i = 0; i < t.size();) {
          if (t.compare(i, 3, "\xE2\x96\x81") == 0) {
            p.push_back(' ');
            i += 3;
          } else {
            p.push_back(t[i++]);
          }
        }
      } else {
        // GPT-2 unicode -> bytes; unmapped codepoints render as llama.cpp's [UNK_BYTE_0x..] marker
        for (uint32_t cpt : cpts_from_utf8(t)) {
          const int b = unicode_to_byte(cpt);
          if (b >= 0) {
            p.push_back(static_cast<char>(b));
          } else {
            std::string u;
            append_utf8(u, cpt);
            p += "[UNK_BYTE_0x";
            for (unsigned char c : u) p += fmt::format("{:02x}", c);
            p += t + "]";
          }
        }
      }
    } else if (a & attr_byte) {
      // "<0xNN>": strtol of the two hex digits
      unsigned v = 0;
      for (size_t i = 3; i < 5 && i < t.size() && std::isxdigit(static_cast<unsigned char>(t[i])); ++i)
        v = v * 16 + static_cast<unsigned>(std::isdigit(static_cast<unsigned char>(t[i]))
                                               ? t[i] - '0'
                                               : (std::tolower(static_cast<unsigned char>(t[i])) - 'a' + 10));
      p.assign(1, static_cast<char>(v));
    }
    // unused / undefined tokens render as "".
  }
}

void vocab::apply_model_attrs(const gguf_file& f) {
  std::string name = f.try_string("general.name").value_or("");
  const std::string arch = f.try_string("general.architecture").value_or("");
  std::transform(name.begin(), name.end(), name.begin(),
                 [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); });
  auto set = [&](std::string_view nm, uint32_t bit, bool on) {
    const int32_t id = find(nm);
    if (id < 0) return;
    attr[id] = on ? (attr[id] | bit) : (attr[id] & ~bit);
  };
  if (contains_any(pre, {"jina-v2-de", "jina-v2-es", "jina-v2-code"}) ||
      contains_any(arch, {"nomic-bert-moe", "jina-bert-v3"})) {
    set("<mask>", attr_lstrip, true);
  } else if (contains_any(name, {"phi-3", "phi3"})) {
    for (int32_t id : special_by_length) attr[id] |= attr_rstrip;
    set("</s>", attr_rstrip, true);
    for (std::string_view nm : {"<unk>", "<s>", "<|endoftext|>"}) set(nm, attr_rstrip, false);
  } else if (contains_any(name, {"modern-bert"})) {
    set("[MASK]", attr_lstrip, true);
  }
}

std::vector<fragment> vocab::partition(std::string_view raw, bool parse_special) const {
  std::vector<fragment> frags;
  if (raw.empty()) return frags;
  frags.push_back({-1, 0, raw.size()});
  // Cheap filter: a token can only occur if every adjacent byte pair of it occurs in the text.
  std::vector<uint64_t> pair_seen(65536 / 64, 0), byte_seen(4, 0);
  for (size_t i = 0; i < raw.size(); ++i) {
    const unsigned b0 = static_cast<uint8_t>(raw[i]);
    byte_seen[b0 >> 6] |= 1ull << (b0 & 63);
    if (i + 1 < raw.size()) {
      const unsigned p = (b0 << 8) | static_cast<uint8_t>(raw[i + 1]);
      pair_seen[p >> 6] |= 1ull << (p & 63);
    }
  }
  auto may_occur = [&](const std::string& t) {
    if (t.size() > raw.size()) return false;
    const unsigned b0 = static_cast<uint8_t>(t[0]);
    if (!(byte_seen[b0 >> 6] >> (b0 & 63) & 1)) return false;
    for (size_t i = 0; i + 1 < t.size(); ++i) {
      const unsigned p = (static_cast<unsigned>(static_cast<uint8_t>(t[i])) << 8) | static_cast<uint8_t>(t[i + 1]);
      if (!(pair_seen[p >> 6] >> (p & 63) & 1)) return false;
    }
    return true;
  };
  std::vector<fragment> next;
  for (const int32_t id : special_by_length) {
    const uint32_t a = attr[id];
    if (!parse_special && (a & (attr_control | attr_unknown))) continue;
    const std::string& tt = text[id];
    if (!may_occur(tt)) continue;
    bool any = false;
    for (const fragment& fr : frags)
      if (fr.token < 0 && raw.substr(fr.offset, fr.length).find(tt) != std::string_view::npos) {
        any = true;
        break;
      }
    if (!any) continue;
    next.clear();
    for (const fragment& fr : frags) {
      if (fr.token >= 0) {
        next.push_back(fr);
        continue;
      }
      size_t off = fr.offset, len = fr.length;
      while (len > 0) {
        const size_t m = raw.substr(0, off + len).find(tt, off);
        if (m == std::string_view::npos) {
          next.push_back({-1, off, len});
          break;
        }
        size_t left_len = m - off;
        if (a & attr_lstrip)
          while (left_len > 0 && is_c_space(raw[off + left_len - 1])) --left_len;
        if (left_len > 0) next.push_back({-1, off, left_len});
        next.push_back({id, 0, 0});
        size_t r_off = m + tt.size();
        size_t r_len = off + len - r_off;
        if (a & attr_rstrip)
          while (r_len > 0 && is_c_space(raw[r_off])) ++r_off, --r_len;
        off = r_off;
        len = r_len;
      }
    }
    frags.swap(next);
  }
  return frags;
}

}  // namespace kvq::tok
