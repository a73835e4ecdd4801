// Tokenizer algorithms against plain O(n^2) references on synthetic vocabularies written with the
// test GGUF writer, the pre-tokenizer regexes on hand-checked cases, the special-token partition,
// invalid UTF-8 and the metadata errors.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/error.h"
#include "kvq/gguf.h"
#include "kvq/tokenizer.h"
#include "support/data_dir.h"
#include "kvq/gguf_writer.h"
#include "tokenizer/regex_split.h"
#include "tokenizer/spm.h"
#include "tokenizer/unicode.h"
#include "tokenizer/vocab.h"

namespace {

using kvq::gguf_writer;
using ids_t = std::vector<int32_t>;

std::unique_ptr<kvq::tokenizer> load(const gguf_writer& w, const std::string& name) {
  const std::string path = ::testing::TempDir() + "kvq_tok_" + name + ".gguf";
  w.write(path);
  auto f = kvq::gguf_file::open(path);
  return kvq::tokenizer::from_gguf(*f);
}

kvq::error load_error(const gguf_writer& w, const std::string& name) {
  try {
    load(w, name);
  } catch (const kvq::error& e) {
    return e;
  }
  ADD_FAILURE() << name << ": no error";
  return kvq::error(kvq::errc::internal, "");
}

std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::min(kvq::tok::utf8_len(s[i]), s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// ---------------------------------------------------------------- SPM

struct spm_vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  std::map<std::string, int32_t> id;
  void add(const std::string& t, float s, int32_t type = 1) {
    id.emplace(t, static_cast<int32_t>(tokens.size()));
    tokens.push_back(t);
    scores.push_back(s);
    types.push_back(type);
  }
  gguf_writer writer() const {
    gguf_writer w;
    w.set_str("general.architecture", "llama");
    w.set_str("tokenizer.ggml.model", "llama");
    w.set_arr_str("tokenizer.ggml.tokens", tokens);
    w.set_arr_f32("tokenizer.ggml.scores", scores);
    w.set_arr_i32("tokenizer.ggml.token_type", types);
    return w;
  }
};

// A small SPM vocabulary: <unk> <s> </s>, 256 byte tokens, characters, and merged pieces with
// scores chosen to create ties and order-dependent merges.
spm_vocab make_spm_vocab() {
  spm_vocab v;
  v.add("<unk>", 0, 2);
  v.add("<s>", 0, 3);
  v.add("</s>", 0, 3);
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) v.add(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">", 0, 6);
  const char* chars[] = {"\xE2\x96\x81", "a", "b", "c", "\xC3\xA9"};  // ▁ a b c é
  for (const char* c : chars) v.add(c, -10);
  const std::pair<const char*, float> merged[] = {
      {"ab", -1}, {"bc", -1}, {"abc", -0.5f}, {"ca", -2}, {"aa", -3}, {"\xE2\x96\x81" "a", -1.5f},
      {"\xE2\x96\x81" "ab", -0.2f}, {"bca", -0.1f}, {"cab", -0.1f}, {"\xC3\xA9" "a", -1},
      {"aab", -0.3f}, {"\xE2\x96\x81\xE2\x96\x81", -4}};
  for (const auto& [t, s] : merged) v.add(t, s);
  return v;
}

// Reference: repeatedly merge the adjacent pair with the best score (leftmost on ties) whose
// concatenation is a token, scanning the whole symbol list each time.
ids_t spm_reference(const spm_vocab& v, const std::string& escaped) {
  std::vector<std::string> sym = utf8_chars(escaped);
  for (;;) {
    int best = -1;
    float best_score = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = v.id.find(sym[i] + sym[i + 1]);
      if (it == v.id.end()) continue;
      const float s = v.scores[it->second];
      if (best < 0 || s > best_score) best = static_cast<int>(i), best_score = s;
    }
    if (best < 0) break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  ids_t out;
  for (const std::string& s : sym) {
    auto it = v.id.find(s);
    if (it != v.id.end()) {
      out.push_back(it->second);
      continue;
    }
    for (unsigned char c : s) out.push_back(3 + c);  // <0xNN> ids start at 3
  }
  return out;
}

std::string escape_spaces(const std::string& s) {
  std::string out;
  for (char c : s) out += c == ' ' ? std::string("\xE2\x96\x81") : std::string(1, c);
  return out;
}

TEST(tokenizer_spm, matches_reference_on_random_text) {
  const spm_vocab v = make_spm_vocab();
  auto tok = load(v.writer(), "spm_ref");
  std::mt19937 rng(7);
  const char* alphabet[] = {"a", "b", "c", " ", "\xC3\xA9", "d", "\xE2\x82\xAC"};  // d, € unknown
  for (int t = 0; t < 400; ++t) {
    std::string s;
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % 7];
    const ids_t want = spm_reference(v, escape_spaces(" " + s));
    EXPECT_EQ(tok->encode(s, false, false), want) << "'" << s << "'";
    ids_t with_bos = want;
    with_bos.insert(with_bos.begin(), 1);
    EXPECT_EQ(tok->encode(s, true, false), with_bos);
    EXPECT_EQ(tok->decode(want), " " + s);
  }
}

TEST(tokenizer_spm, segmented_equals_whole_text_merge) {
  // The segmented merge must give llama.cpp's whole-text result on real text and vocabularies.
  KVQ_REQUIRE_DATA(vocab_path, "golden/tokenizers/ggml-vocab-llama-spm.gguf");
  KVQ_REQUIRE_DATA(text_path, "data/wikitext-2-raw-test/wiki.test.raw");
  auto f = kvq::gguf_file::open(vocab_path);
  kvq::tok::vocab v;
  v.kind = kvq::tok::vocab_kind::spm;
  v.bos = 1, v.eos = 2, v.unk = 0, v.add_bos = true, v.add_space_prefix = true;
  v.load_common(*f);
  kvq::tok::build_spm_pairs(v);
  std::ifstream in(text_path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = escape_spaces(" " + ss.str().substr(0, 200000));
  ids_t a, b;
  kvq::tok::spm_tokenize(v, text, a, /*segment=*/true);
  kvq::tok::spm_tokenize(v, text, b, /*segment=*/false);
  EXPECT_GT(a.size(), 40000u);
  EXPECT_EQ(a, b);
}

TEST(tokenizer_spm, byte_fallback_and_invalid_utf8) {
  const spm_vocab v = make_spm_vocab();
  auto tok = load(v.writer(), "spm_bytes");
  // '€' is not a token: its three bytes; a stray 0xFF byte and a truncated sequence likewise.
  const std::string s = "a\xE2\x82\xAC\xFF" "b\xC3";
  const ids_t ids = tok->encode(s, false, false);
  EXPECT_EQ(ids, spm_reference(v, escape_spaces(" " + s)));
  EXPECT_EQ(tok->decode(ids), " " + s);
  EXPECT_TRUE(tok->encode("", false, false).empty());
  EXPECT_EQ(tok->encode("", true, false), ids_t{1});
}

TEST(tokenizer_spm, special_tokens_and_space_prefix) {
  const spm_vocab v = make_spm_vocab();
  auto tok = load(v.writer(), "spm_special");
  const int32_t s = v.id.at("<s>"), e = v.id.at("</s>");
  // parse_special: the text after a special token gets the space prefix again.
  ids_t want = spm_reference(v, escape_spaces(" ab"));
  want.push_back(e);
  want.push_back(s);
  for (int32_t id : spm_reference(v, escape_spaces(" c"))) want.push_back(id);
  EXPECT_EQ(tok->encode("ab</s><s>c", false, true), want);
  // without parse_special the markup is plain text
  EXPECT_EQ(tok->encode("ab</s><s>c", false, false), spm_reference(v, escape_spaces(" ab</s><s>c")));
  EXPECT_EQ(tok->token_to_piece(s), "");
  EXPECT_EQ(tok->token_text(s), "<s>");
  EXPECT_TRUE(tok->is_eog(e));
}

TEST(tokenizer_spm, user_defined_tokens_split_always_and_rstrip_for_phi3) {
  spm_vocab v = make_spm_vocab();
  v.add("<|u|>", 0, 4);  // user-defined
  const int32_t u = v.id.at("<|u|>");
  auto tok = load(v.writer(), "spm_user");
  ids_t want{};
  for (int32_t id : spm_reference(v, escape_spaces(" a"))) want.push_back(id);
  want.push_back(u);
  // the text after a special token gets the space prefix: "▁" + "▁b"
  for (int32_t id : spm_reference(v, escape_spaces("  b"))) want.push_back(id);
  EXPECT_EQ(tok->encode("a<|u|> b", false, false), want);
  EXPECT_EQ(tok->token_to_piece(u), "<|u|>");

  // general.name "Phi3": special tokens strip the whitespace to their right.
  gguf_writer w = v.writer();
  w.set_str("general.name", "Phi3");
  auto phi = load(w, "spm_phi3");
  want.resize(want.size() - spm_reference(v, escape_spaces("  b")).size());
  for (int32_t id : spm_reference(v, escape_spaces(" b"))) want.push_back(id);
  EXPECT_EQ(phi->encode("a<|u|> \n b", false, false), want);
  EXPECT_NE(tok->encode("a<|u|> \n b", false, false), want);
}

// ---------------------------------------------------------------- BPE

struct bpe_vocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  std::map<std::string, int32_t> id;
  void add(const std::string& t) {
    id.emplace(t, static_cast<int32_t>(tokens.size()));
    tokens.push_back(t);
  }
  gguf_writer writer(const std::string& pre) const {
    gguf_writer w;
    w.set_str("general.architecture", "gpt2");
    w.set_str("tokenizer.ggml.model", "gpt2");
    if (!pre.empty()) w.set_str("tokenizer.ggml.pre", pre);
    w.set_arr_str("tokenizer.ggml.tokens", tokens);
    w.set_arr_str("tokenizer.ggml.merges", merges);
    return w;
  }
};

// 256 byte tokens (GPT-2 unicode forms) + merges over a, b, c, d with ranks that make the merge
// order matter.
bpe_vocab make_bpe_vocab() {
  bpe_vocab v;
  for (int b = 0; b < 256; ++b) v.add(kvq::tok::byte_to_unicode(static_cast<uint8_t>(b)));
  const std::pair<const char*, const char*> merges[] = {
      {"a", "b"}, {"b", "c"}, {"c", "a"}, {"ab", "c"}, {"a", "a"}, {"c", "ab"}, {"aa", "b"},
      {"d", "d"}, {"bc", "a"}, {"dd", "dd"}, {"a", "bc"}, {"\xC4\xA0", "a"}, {"\xC4\xA0" "a", "b"}};
  for (const auto& [l, r] : merges) {
    v.merges.push_back(std::string(l) + " " + r);
    if (!v.id.count(std::string(l) + r)) v.add(std::string(l) + r);
  }
  return v;
}

// Reference: repeatedly merge the adjacent pair with the lowest merge rank (leftmost on ties).
ids_t bpe_reference(const bpe_vocab& v, const std::string& word) {
  std::map<std::pair<std::string, std::string>, int> rank;
  for (size_t i = 0; i < v.merges.size(); ++i) {
    const size_t p = v.merges[i].find(' ', 1);
    rank.emplace(std::make_pair(v.merges[i].substr(0, p), v.merges[i].substr(p + 1)), static_cast<int>(i));
  }
  std::vector<std::string> sym = utf8_chars(word);
  for (;;) {
    int best = -1, best_rank = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      auto it = rank.find({sym[i], sym[i + 1]});
      if (it == rank.end()) continue;
      if (best < 0 || it->second < best_rank) best = static_cast<int>(i), best_rank = it->second;
    }
    if (best < 0) break;
    sym[best] += sym[best + 1];
    sym.erase(sym.begin() + best + 1);
  }
  ids_t out;
  for (const std::string& s : sym) out.push_back(v.id.at(s));
  return out;
}

TEST(tokenizer_bpe, matches_reference_on_random_words) {
  const bpe_vocab v = make_bpe_vocab();
  auto tok = load(v.writer("gpt-2"), "bpe_ref");
  std::mt19937 rng(11);
  for (int t = 0; t < 400; ++t) {
    std::string s;
    const int len = 1 + static_cast<int>(rng() % 30);
    for (int i = 0; i < len; ++i) s += "abcd"[rng() % 4];
    EXPECT_EQ(tok->encode(s, false, false), bpe_reference(v, s)) << s;  // one pre-token
    // " word": the space is the byte-encoded "Ġ" and merges with the word
    EXPECT_EQ(tok->encode(" " + s, false, false), bpe_reference(v, "\xC4\xA0" + s)) << s;
    EXPECT_EQ(tok->decode(tok->encode(" " + s + "!\n", false, false)), " " + s + "!\n");
  }
}

TEST(tokenizer_bpe, invalid_utf8_becomes_replacement_char) {
  const bpe_vocab v = make_bpe_vocab();
  auto tok = load(v.writer("gpt-2"), "bpe_utf8");
  EXPECT_EQ(tok->decode(tok->encode("a\xFF" "b", false, false)), "a\xEF\xBF\xBD" "b");
  EXPECT_TRUE(tok->encode("", true, false).empty() == false);  // BOS only when asked: default id 11
  EXPECT_EQ(tok->encode("", true, false), ids_t{11});
}

// ---------------------------------------------------------------- pre-tokenizer

std::vector<std::string> split(const std::vector<std::string>& rx, const std::string& s) {
  return kvq::tok::regex_splitter(rx).split(s, /*byte_encode=*/false);
}

const std::string k_gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
const std::string k_llama3 =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

using words = std::vector<std::string>;

TEST(tokenizer_pretok, gpt2_regex) {
  EXPECT_EQ(split({k_gpt2}, "Hello world"), (words{"Hello", " world"}));
  EXPECT_EQ(split({k_gpt2}, "a  b"), (words{"a", " ", " b"}));
  EXPECT_EQ(split({k_gpt2}, "a\tb"), (words{"a", "\t", "b"}));  // gap between matches
  EXPECT_EQ(split({k_gpt2}, "x   "), (words{"x", "   "}));
  EXPECT_EQ(split({k_gpt2}, "it's 42!!"), (words{"it", "'s", " 42", "!!"}));
  EXPECT_EQ(split({k_gpt2}, "caf\xC3\xA9 \xE2\x80\x94"), (words{"caf\xC3\xA9", " \xE2\x80\x94"}));
  // U+3000 (ideographic space) is whitespace: neither letter nor "other"
  EXPECT_EQ(split({k_gpt2}, "a\xE3\x80\x80" "b"), (words{"a", "\xE3\x80\x80", "b"}));
  EXPECT_TRUE(split({k_gpt2}, "").empty());
}

TEST(tokenizer_pretok, llama3_regex) {
  EXPECT_EQ(split({k_llama3}, "12345"), (words{"123", "45"}));
  EXPECT_EQ(split({k_llama3}, "\n\n  x"), (words{"\n\n", " ", " x"}));
  EXPECT_EQ(split({k_llama3}, "I'M ok"), (words{"I", "'M", " ok"}));
  EXPECT_EQ(split({k_llama3}, "(x)\n"), (words{"(x", ")\n"}));
}

TEST(tokenizer_pretok, sequence_of_regexes_and_dollar) {
  // deepseek-llm style: a later regex only sees the pieces of the earlier ones; "$" is the end of
  // the piece, not before a final newline.
  EXPECT_EQ(split({"[\r\n]", R"(\s+$)"}, "a  \nb  "), (words{"a", "  ", "\n", "b", "  "}));
  EXPECT_EQ(split({R"(\p{N}+)"}, "ab12c"), (words{"ab", "12", "c"}));
}

TEST(tokenizer_pretok, byte_encoding) {
  const auto w = kvq::tok::regex_splitter({k_gpt2}).split(" a\n", true);
  EXPECT_EQ(w, (words{"\xC4\xA0" "a", "\xC4\x8A"}));  // Ġa, Ċ
  for (int b = 0; b < 256; ++b)
    EXPECT_EQ(kvq::tok::unicode_to_byte(kvq::tok::cpts_from_utf8(kvq::tok::byte_to_unicode(b))[0]), b);
}

// ---------------------------------------------------------------- errors

TEST(tokenizer_errors, unsupported_model_and_pre) {
  bpe_vocab v = make_bpe_vocab();
  auto e = load_error(v.writer("no-such-pre"), "err_pre");
  EXPECT_EQ(e.code(), kvq::errc::unsupported);
  EXPECT_NE(std::string(e.what()).find("'no-such-pre'"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.pre"), std::string::npos) << e.what();

  gguf_writer w = v.writer("gpt-2");
  w.set_str("tokenizer.ggml.model", "bert");
  e = load_error(w, "err_model");
  EXPECT_EQ(e.code(), kvq::errc::unsupported);
  EXPECT_NE(std::string(e.what()).find("'bert'"), std::string::npos) << e.what();

  // the supported pre-tokenizers all load
  for (const char* pre : {"default", "gpt-2", "llama3", "llama-bpe", "qwen2", "deepseek-llm",
                          "deepseek-coder", "starcoder", "falcon", "tekken", "gpt-4o", "qwen35",
                          "chatglm-bpe", "dbrx"})
    EXPECT_NO_THROW(load(v.writer(pre), std::string("ok_") + pre)) << pre;
}

TEST(tokenizer_errors, bad_metadata) {
  bpe_vocab v = make_bpe_vocab();
  gguf_writer w;
  w.set_str("tokenizer.ggml.model", "gpt2");
  w.set_str("tokenizer.ggml.pre", "gpt-2");
  w.set_arr_str("tokenizer.ggml.merges", v.merges);
  auto e = load_error(w, "err_tokens");
  EXPECT_EQ(e.code(), kvq::errc::invalid_input);
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.tokens"), std::string::npos) << e.what();

  w = v.writer("gpt-2");
  w.set_arr_str("tokenizer.ggml.merges", {});
  w = gguf_writer();
  w.set_str("tokenizer.ggml.model", "gpt2");
  w.set_arr_str("tokenizer.ggml.tokens", v.tokens);
  e = load_error(w, "err_merges");
  EXPECT_EQ(e.code(), kvq::errc::invalid_input);
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.merges"), std::string::npos) << e.what();

  spm_vocab s = make_spm_vocab();
  w = s.writer();
  w.set_arr_i32("tokenizer.ggml.token_type", {1, 1});
  e = load_error(w, "err_types");
  EXPECT_EQ(e.code(), kvq::errc::invalid_input);
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.token_type"), std::string::npos) << e.what();

  w = s.writer();
  w.set_arr_i32("tokenizer.ggml.scores", {1, 2, 3});
  e = load_error(w, "err_scores");
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.scores"), std::string::npos) << e.what();

  // add_bos_token with no BOS in the vocabulary (gpt2 default BOS id 11 is out of range here)
  bpe_vocab small;
  for (const char* t : {"a", "b"}) small.add(t);
  w = small.writer("gpt-2");
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  e = load_error(w, "err_bos");
  EXPECT_EQ(e.code(), kvq::errc::invalid_input);
  EXPECT_NE(std::string(e.what()).find("tokenizer.ggml.add_bos_token"), std::string::npos) << e.what();

  // a stored special id outside the vocabulary keeps the default (llama.cpp)
  w = s.writer();
  w.set_u32("tokenizer.ggml.eos_token_id", 4294967295u);
  EXPECT_EQ(load(w, "eos_oob")->eos(), 2);
}

}  // namespace
