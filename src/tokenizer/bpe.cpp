#include "tokenizer/bpe.h"

#include <fmt/format.h>

#include <cstring>
#include <queue>

#include "kvq/error.h"
#include "tokenizer/symbol_merge.h"
#include "tokenizer/unicode.h"

namespace kvq::tok {

namespace {

// Pre-tokenizer regexes, verbatim from llama.cpp (llm_tokenizer_bpe, llama-vocab.cpp).
const char* const k_gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
const char* const k_llama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const k_qwen2 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const k_qwen35 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const k_tekken =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const k_gpt4o =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const k_cjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";

const std::vector<bpe_pre_row>& pre_table() {
  static const std::vector<bpe_pre_row> rows = {
      {"default", {"default"},
       {R"([\p{P}\$\+<=>\^~\|]+)", k_gpt2, R"(\p{N}+)", "[0-9][0-9][0-9]"}},
      {"gpt2",
       {"gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
        "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"},
       {k_gpt2}},
      {"llama3",
       {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
        "jina-v5-nano"},
       {k_llama3}, /*ignore_merges=*/true, /*force_add_bos=*/true},
      {"dbrx", {"dbrx", "smaug-bpe"}, {k_llama3}},
      {"chatglm4", {"glm4", "chatglm-bpe"}, {k_llama3}, false, false, /*no_bos=*/true},
      {"qwen2",
       {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"},
       {k_qwen2}},
      {"qwen35", {"qwen35"}, {k_qwen35}},
      {"deepseek-llm",
       {"deepseek-llm"},
       {"[\r\n]",
        R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)",
        R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", "\\s+$", k_cjk, "\\p{N}+"}},
      {"deepseek-coder",
       {"deepseek-coder"},
       {"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", k_cjk, R"(\p{N})"}},
      {"starcoder",
       {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"},
       {R"(\p{N})", k_gpt2}},
      {"falcon", {"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", k_gpt2, "[0-9][0-9][0-9]"}},
      {"tekken", {"tekken"}, {k_tekken}, /*ignore_merges=*/true, /*force_add_bos=*/true},
      {"gpt-4o", {"gpt-4o", "llama4", "kanana2", "talkie"}, {k_gpt4o}},
  };
  return rows;
}

struct bigram {
  int32_t rank;
  int32_t left, right;
  uint32_t size;  // bytes of left + right when queued
};

// Min-heap order for std::priority_queue: lower rank first, then smaller left index
// (llm_bigram_bpe::comparator).
struct bigram_greater {
  bool operator()(const bigram& l, const bigram& r) const {
    return l.rank > r.rank || (l.rank == r.rank && l.left > r.left);
  }
};

void make_key(std::string& key, std::string_view left, std::string_view right) {
  const uint32_t ll = static_cast<uint32_t>(left.size());
  key.resize(4 + left.size() + right.size());
  std::memcpy(key.data(), &ll, 4);
  std::memcpy(key.data() + 4, left.data(), left.size());
  std::memcpy(key.data() + 4 + left.size(), right.data(), right.size());
}

}  // namespace

const bpe_pre_row* find_bpe_pre(std::string_view pre) {
  if (pre.empty()) pre = "default";  // llama.cpp warns and uses 'default'
  for (const auto& r : pre_table())
    for (auto nm : r.names)
      if (nm == pre) return &r;
  return nullptr;
}

std::string supported_bpe_pres() {
  std::string s;
  for (const auto& r : pre_table())
    for (auto nm : r.names) {
      if (!s.empty()) s += ", ";
      s += nm;
    }
  return s;
}

bpe_model::bpe_model(const gguf_file& f, const vocab& v, const bpe_pre_row& pre)
    : v_(v), ignore_merges_(pre.ignore_merges), splitter_(pre.regexes) {
  const std::string key = "tokenizer.ggml.merges";
  const gguf_value* m = f.find(key);
  if (!m) fail_input(fmt::format("[tokenizer] {}: missing metadata '{}' (required by tokenizer.ggml.model 'gpt2')",
                                 f.path(), key));
  if (m->type != gguf_value_type::array || m->elem_type != gguf_value_type::string)
    fail_input(fmt::format("[tokenizer] {}: metadata '{}' must be an array of strings", f.path(), key));
  ranks_.reserve(m->arr_str.size() * 2);
  std::string k;
  for (size_t i = 0; i < m->arr_str.size(); ++i) {
    const std::string& w = m->arr_str[i];
    std::string_view first, second;  // no space after position 0: ("", ""), as llama.cpp
    const size_t pos = w.find(' ', 1);
    if (pos != std::string::npos) {
      first = std::string_view(w).substr(0, pos);
      second = std::string_view(w).substr(pos + 1);
    }
    make_key(k, first, second);
    ranks_.emplace(k, static_cast<int32_t>(i));  // first occurrence wins
  }
}

int32_t bpe_model::rank(std::string_view left, std::string_view right, std::string& key_buf) const {
  make_key(key_buf, left, right);
  auto it = ranks_.find(std::string_view(key_buf));
  return it == ranks_.end() ? -1 : it->second;
}

void bpe_model::tokenize(std::string_view text, std::vector<int32_t>& out) const {
  const std::vector<std::string> words = splitter_.split(text, /*byte_encode=*/true);
  std::vector<merge_symbol> sym;
  std::vector<bigram> heap;
  std::string key;
  for (const std::string& word : words) {
    if (word.empty()) continue;
    const std::string_view w(word);
    heap.clear();
    if (ignore_merges_ && v_.find(w) >= 0) {
      out.push_back(v_.find(w));
      continue;
    }
    utf8_symbols(w, sym);
    auto try_add = [&](int32_t l, int32_t r) {
      if (l < 0 || r < 0) return;
      const int32_t rk = rank(w.substr(sym[l].off, sym[l].n), w.substr(sym[r].off, sym[r].n), key);
      if (rk < 0) return;
      heap.push_back({rk, l, r, sym[l].n + sym[r].n});
      std::push_heap(heap.begin(), heap.end(), bigram_greater{});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(sym.size()); ++i) try_add(i - 1, i);
    merge_best_pairs<bigram_greater>(sym, heap, try_add);
    for (int32_t i = 0; i != -1; i = sym[i].next) {
      const std::string_view piece = w.substr(sym[i].off, sym[i].n);
      const int32_t id = v_.find(piece);
      if (id >= 0) {
        out.push_back(id);
        continue;
      }
      for (char c : piece) {  // llama.cpp: single-byte tokens when present, else nothing
        const int32_t bt = v_.find(std::string_view(&c, 1));
        if (bt >= 0) out.push_back(bt);
      }
    }
  }
}

}  // namespace kvq::tok
