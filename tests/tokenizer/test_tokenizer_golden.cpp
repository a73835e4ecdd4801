// Tokenizer against real vocabularies: llama.cpp's own tokenizer test vectors
// (golden/tokenizers/*.gguf.inp/.out) and llama-tokenize output on stories260K
// (golden/stories260K/tokenization.json), plus round trips and whole-file token counts.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/error.h"
#include "kvq/gguf.h"
#include "kvq/tokenizer.h"
#include "support/data_dir.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct vectors {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
};

// .inp: strings each followed by "\n__ggml_vocab_test__\n"; .out: one line of ids per string.
vectors load_vectors(const std::string& gguf_path) {
  vectors v;
  const std::string inp = read_file(gguf_path + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  for (size_t pos = 0; pos < inp.size();) {
    const size_t e = inp.find(sep, pos);
    if (e == std::string::npos) break;
    v.texts.push_back(inp.substr(pos, e - pos));
    pos = e + sep.size();
  }
  std::istringstream out(read_file(gguf_path + ".out"));
  std::string line;
  while (std::getline(out, line)) {
    std::istringstream ls(line);
    std::vector<int32_t> ids;
    for (int32_t id; ls >> id;) ids.push_back(id);
    v.ids.push_back(ids);
  }
  return v;
}

class golden_vocab : public ::testing::TestWithParam<const char*> {};

TEST_P(golden_vocab, matches_llama_cpp_vectors) {
  const std::string name = GetParam();
  KVQ_REQUIRE_DATA(path, "golden/tokenizers/" + name + ".gguf");
  auto f = kvq::gguf_file::open(path);
  auto tok = kvq::tokenizer::from_gguf(*f);
  const vectors v = load_vectors(path);
  ASSERT_EQ(v.texts.size(), 46u);
  ASSERT_GE(v.ids.size(), v.texts.size());
  int pass = 0;
  for (size_t i = 0; i < v.texts.size(); ++i) {
    const auto got = tok->encode(v.texts[i], /*add_bos=*/false, /*parse_special=*/false);
    EXPECT_EQ(got, v.ids[i]) << name << " vector " << i << ": '" << v.texts[i] << "'";
    pass += got == v.ids[i];
  }
  std::printf("[ golden ] %s: %d/%zu vectors match\n", name.c_str(), pass, v.texts.size());
}

TEST_P(golden_vocab, round_trip) {
  const std::string name = GetParam();
  KVQ_REQUIRE_DATA(path, "golden/tokenizers/" + name + ".gguf");
  auto f = kvq::gguf_file::open(path);
  auto tok = kvq::tokenizer::from_gguf(*f);
  const bool spm = tok->model_name() == "llama";
  for (const std::string& s : load_vectors(path).texts) {
    const auto ids = tok->encode(s, false, false);
    // SPM adds a leading space to the first text fragment (add_space_prefix).
    const std::string want = spm && !s.empty() ? " " + s : s;
    EXPECT_EQ(tok->decode(ids), want) << name;
    std::string cat;
    for (int32_t id : ids) cat += tok->token_to_piece(id);
    EXPECT_EQ(cat, want) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(tokenizers, golden_vocab,
                         ::testing::Values("ggml-vocab-llama-spm", "ggml-vocab-phi-3",
                                           "ggml-vocab-gpt-2", "ggml-vocab-deepseek-llm"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(golden_vocab_meta, special_ids_and_flags) {
  KVQ_REQUIRE_DATA(spm, "golden/tokenizers/ggml-vocab-llama-spm.gguf");
  KVQ_REQUIRE_DATA(gpt2, "golden/tokenizers/ggml-vocab-gpt-2.gguf");
  KVQ_REQUIRE_DATA(phi3, "golden/tokenizers/ggml-vocab-phi-3.gguf");
  auto fs = kvq::gguf_file::open(spm);
  auto ts = kvq::tokenizer::from_gguf(*fs);
  EXPECT_EQ(ts->n_vocab(), 32000);
  EXPECT_EQ(ts->bos(), 1);
  EXPECT_EQ(ts->eos(), 2);
  EXPECT_EQ(ts->unk(), 0);
  EXPECT_TRUE(ts->add_bos_default());
  EXPECT_TRUE(ts->is_eog(2));
  EXPECT_FALSE(ts->is_eog(1));
  EXPECT_EQ(ts->token_text(13), "<0x0A>");
  EXPECT_EQ(ts->token_to_piece(13), "\n");
  EXPECT_EQ(ts->token_to_piece(1), "");  // control
  EXPECT_EQ(ts->token_to_piece(0), "");  // unknown
  EXPECT_THROW(ts->token_to_piece(32000), kvq::error);
  EXPECT_THROW(ts->token_to_piece(-1), kvq::error);

  auto fg = kvq::gguf_file::open(gpt2);
  auto tg = kvq::tokenizer::from_gguf(*fg);
  EXPECT_EQ(tg->model_name(), "gpt2");
  EXPECT_EQ(tg->pre_name(), "gpt-2");
  EXPECT_EQ(tg->bos(), 50256);
  EXPECT_EQ(tg->eos(), 50256);
  EXPECT_EQ(tg->unk(), -1);
  EXPECT_FALSE(tg->add_bos_default());
  EXPECT_TRUE(tg->is_eog(50256));
  // parse_special: "<|endoftext|>" is one control token only when asked for.
  EXPECT_EQ(tg->encode("a<|endoftext|>b", false, true),
            (std::vector<int32_t>{64, 50256, 65}));
  EXPECT_GT(tg->encode("a<|endoftext|>b", false, false).size(), 3u);
  EXPECT_EQ(tg->encode("Hello", true, false).front(), 50256);

  // phi-3: EOS 32000 <|endoftext|>; <|end|> is end-of-generation; control special tokens get
  // rstrip (llama.cpp sets it by model name), so the space after <|user|> is swallowed.
  auto fp = kvq::gguf_file::open(phi3);
  auto tp = kvq::tokenizer::from_gguf(*fp);
  EXPECT_EQ(tp->eos(), 32000);
  EXPECT_TRUE(tp->is_eog(32007));
  const auto a = tp->encode("<|user|> Hi", false, true);
  const auto b = tp->encode("<|user|>Hi", false, true);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.front(), 32010);
}

// llama-tokenize on stories260K: with BOS, without BOS, without special parsing.
TEST(golden_stories260k, tokenization_json) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(gold, "golden/stories260K/tokenization.json");
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  const auto j = nlohmann::json::parse(read_file(gold));
  int n = 0, pass = 0;
  for (const auto& s : j.at("strings")) {
    const std::string text = s.at("text");
    const std::string name = s.at("name");
    struct mode {
      const char* key;
      bool bos, special;
    };
    for (const mode m : {mode{"with_bos", true, true}, mode{"no_bos", false, true},
                         mode{"no_bos_no_parse_special", false, false}}) {
      if (!s.contains(m.key)) continue;
      const auto want = s.at(m.key).at("ids").get<std::vector<int32_t>>();
      const auto got = tok->encode(text, m.bos && tok->add_bos_default(), m.special);
      EXPECT_EQ(got, want) << name << " " << m.key;
      ++n;
      pass += got == want;
      if (s.at(m.key).contains("pieces")) {
        const auto pieces = s.at(m.key).at("pieces").get<std::vector<std::string>>();
        ASSERT_EQ(pieces.size(), got.size()) << name;
        for (size_t i = 0; i < got.size(); ++i) {
          const std::string& t = tok->token_text(got[i]);
          // llama-tokenize shows byte tokens as <0xNN> and control tokens by their text
          const bool byte_tok = t.size() == 6 && t.rfind("<0x", 0) == 0;
          const bool control = got[i] == tok->bos() || got[i] == tok->eos();
          EXPECT_EQ(byte_tok || control ? t : tok->token_to_piece(got[i]), pieces[i])
              << name << " piece " << i;
        }
        EXPECT_EQ(tok->decode(got), s.at(m.key).at("detokenized").get<std::string>()) << name;
      }
    }
  }
  EXPECT_EQ(n, 24);
  std::printf("[ golden ] stories260K: %d/%d id lists match\n", pass, n);
}

// Whole-file token counts from llama-perplexity (golden/stories260K/README.md): BOS added, no
// special parsing, the whole file as one text.
TEST(golden_stories260k, whole_file_token_counts) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(ts, "data/tinystories-val-794k/tinystories_val.txt");
  KVQ_REQUIRE_DATA(wiki, "data/wikitext-2-raw-test/wiki.test.raw");
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  const std::string a = read_file(ts), b = read_file(wiki);
  const auto ia = tok->encode(a, true, false);
  EXPECT_EQ(ia.size(), 393019u);
  const auto ib = tok->encode(b, true, false);
  EXPECT_EQ(ib.size(), 809247u);
  // round trip of the whole file (BOS renders as "", then the space prefix)
  EXPECT_EQ(tok->decode(ia), " " + a);
  EXPECT_EQ(tok->decode(ib), " " + b);
}

}  // namespace
