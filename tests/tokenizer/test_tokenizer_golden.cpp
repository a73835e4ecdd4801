// Tokenizer against real vocabularies: llama.cpp's own tokenizer test vectors
// (golden/tokenizers/*.gguf.inp/.out, and the Qwen2 vectors on the Qwen2.5-Coder vocabulary),
// llama-tokenize output on stories260K (golden/stories260K/tokenization.json) and on the golden
// prompts of the real models (Qwen2.5-Coder-0.5B, Gemma 3 270M: KVQ_MODEL_DIR), plus round trips
// and whole-file token counts.
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
vectors load_vectors(const std::string& inp_path, const std::string& out_path) {
  vectors v;
  const std::string inp = read_file(inp_path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  for (size_t pos = 0; pos < inp.size();) {
    const size_t e = inp.find(sep, pos);
    if (e == std::string::npos) break;
    v.texts.push_back(inp.substr(pos, e - pos));
    pos = e + sep.size();
  }
  std::istringstream out(read_file(out_path));
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
  const vectors v = load_vectors(path + ".inp", path + ".out");
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
  for (const std::string& s : load_vectors(path + ".inp", path + ".out").texts) {
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
  // special = true (llama-tokenize --show-pieces): control and unknown tokens give their text
  EXPECT_EQ(ts->token_to_piece(1, true), "<s>");
  EXPECT_EQ(ts->token_to_piece(0, true), "<unk>");
  EXPECT_EQ(ts->token_to_piece(13, true), "\n");
  EXPECT_THROW(ts->token_to_piece(32000, true), kvq::error);
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

// ---- real models (scripts/fetch-models.sh; skipped when absent) ----

constexpr const char* kQwenFile = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
constexpr const char* kGemmaFile = "gemma-3-270m-q4_k_m.gguf";
constexpr const char* kQwenGolden = "golden/qwen2.5-coder-0.5b-instruct-q4_k_m";
constexpr const char* kGemmaGolden = "golden/gemma-3-270m-q4_k_m";

// llama.cpp's Qwen2 vocabulary test vectors (46 strings), checked by the golden's author with
// llama-tokenize on this model's vocabulary: all must match.
TEST(golden_real_models, qwen25_matches_llama_cpp_qwen2_vectors) {
  KVQ_REQUIRE_MODEL(model, kQwenFile);
  KVQ_REQUIRE_DATA(inp, std::string(kQwenGolden) + "/tokenizer-qwen2.inp");
  KVQ_REQUIRE_DATA(out, std::string(kQwenGolden) + "/tokenizer-qwen2.out");
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  EXPECT_EQ(tok->model_name(), "gpt2");
  EXPECT_EQ(tok->pre_name(), "qwen2");
  const vectors v = load_vectors(inp, out);
  ASSERT_EQ(v.texts.size(), 46u);
  ASSERT_GE(v.ids.size(), v.texts.size());
  int pass = 0;
  for (size_t i = 0; i < v.texts.size(); ++i) {
    const auto got = tok->encode(v.texts[i], /*add_bos=*/false, /*parse_special=*/false);
    EXPECT_EQ(got, v.ids[i]) << "qwen2 vector " << i << ": '" << v.texts[i] << "'";
    pass += got == v.ids[i];
  }
  std::printf("[ golden ] qwen2 vectors on %s: %d/%zu match\n", kQwenFile, pass, v.texts.size());
}

// Every golden prompt tokenizes to the ids llama.cpp evaluated (generation.json; for Qwen also
// generation.json's tokenization block, with and without BOS).
void check_golden_prompts(const std::string& model, const std::string& gen_json, size_t n_vocab, bool add_bos) {
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  EXPECT_EQ(tok->n_vocab(), (int32_t)n_vocab);
  EXPECT_EQ(tok->add_bos_default(), add_bos);
  const auto j = nlohmann::json::parse(read_file(gen_json));
  int n = 0;
  for (const auto& run : j.at("runs")) {
    const auto want = run.at("prompt_token_ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok->encode(run.at("prompt").get<std::string>(), tok->add_bos_default(), true), want) << run.at("id");
    ++n;
  }
  EXPECT_EQ(n, 9);
  if (!j.contains("tokenization")) return;
  for (const auto& p : j.at("tokenization").at("prompts")) {
    const std::string text = p.at("text");
    EXPECT_EQ(tok->encode(text, tok->add_bos_default(), true), p.at("ids_default").get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(tok->encode(text, false, true), p.at("ids_no_bos").get<std::vector<int32_t>>()) << text;
    const auto pieces = p.at("pieces").get<std::vector<std::string>>();
    const auto ids = p.at("ids_no_bos").get<std::vector<int32_t>>();
    ASSERT_EQ(pieces.size(), ids.size()) << text;
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(tok->token_to_piece(ids[i]), pieces[i]) << text << " piece " << i;
    EXPECT_EQ(tok->decode(ids), text);
  }
}

TEST(golden_real_models, qwen25_prompt_ids) {
  KVQ_REQUIRE_MODEL(model, kQwenFile);
  KVQ_REQUIRE_DATA(gen, std::string(kQwenGolden) + "/generation.json");
  check_golden_prompts(model, gen, 151936, false);
}

// Gemma 3: SentencePiece with 262,144 pieces, byte fallback, BOS 2 added, no space prefix.
TEST(golden_real_models, gemma3_prompt_ids_and_vocabulary) {
  KVQ_REQUIRE_MODEL(model, kGemmaFile);
  KVQ_REQUIRE_DATA(gen, std::string(kGemmaGolden) + "/generation.json");
  check_golden_prompts(model, gen, 262144, true);
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  EXPECT_EQ(tok->model_name(), "llama");
  EXPECT_EQ(tok->bos(), 2);
  EXPECT_EQ(tok->eos(), 1);
  EXPECT_TRUE(tok->is_eog(1));
  // Generated text: llama.cpp printed the prompt and then the generated pieces.
  const auto j = nlohmann::json::parse(read_file(gen));
  for (const auto& run : j.at("runs")) {
    const std::string text = run.at("prompt").get<std::string>() +
                             tok->decode(run.at("generated_token_ids").get<std::vector<int32_t>>());
    const std::string tail = run.at("stdout_text_tail");
    EXPECT_TRUE(text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0)
        << run.at("id") << ": '" << text << "' does not end with llama.cpp's '" << tail << "'";
  }
}

// Byte fallback: text outside the 262K pieces (control bytes, invalid UTF-8) becomes <0xNN> tokens
// and decodes back to the same bytes; wikitext-2 round-trips whole.
TEST(golden_real_models, gemma3_byte_fallback_and_round_trip) {
  KVQ_REQUIRE_MODEL(model, kGemmaFile);
  KVQ_REQUIRE_DATA(wiki, "data/wikitext-2-raw-test/wiki.test.raw");
  auto f = kvq::gguf_file::open(model);
  auto tok = kvq::tokenizer::from_gguf(*f);
  const std::string odd = std::string("a\x01b\xff", 4);
  const auto ids = tok->encode(odd, false, false);
  int n_bytes = 0;
  for (int32_t id : ids) n_bytes += tok->token_text(id).rfind("<0x", 0) == 0;
  EXPECT_GE(n_bytes, 2) << "expected <0x01> and <0xFF> byte tokens";
  EXPECT_EQ(tok->decode(ids), odd);
  const std::string text = read_file(wiki);
  EXPECT_EQ(tok->decode(tok->encode(text, false, false)), text);
}

}  // namespace
