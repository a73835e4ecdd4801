// Output defects of the kvq CLI found by a new-user trial: kvq info shows the sliding window, the
// layer kinds with their RoPE bases, what bytes/token counts and the weight tensor types; the
// bench table's KV column fits its widest label; tokenize --pieces prints control tokens by their
// text (as llama-tokenize --show-pieces); an unreadable text file names the OS reason.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/gguf.h"
#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

using test::run_cmd;

// The weight tensor types of a GGUF, counted from its tensor list.
std::map<std::string, int> tensor_type_counts(const std::string& path) {
  auto f = gguf_file::open(path);
  std::map<std::string, int> n;
  for (const auto& t : f->tensors()) n[ggml_type_name(t.type)] += 1;
  return n;
}

// Gemma 3 270M: 18 layers, every 6th global (layers 5, 11, 17: 3 global, 15 sliding, llama.cpp's
// gemma3 pattern 6), one kv head of head_dim 256. Hand counts: f16 bytes/token of the 3 global
// layers = 3 x 1 x 256 x 2 bytes x (K + V) = 3072; each sliding layer holds a ring of
// min(n_ctx, window - 1 + n_ubatch) = min(4096, 512 - 1 + 512) = 1023 positions (docs/formats.md),
// 15 x 1023 x 256 x 2 x 2 = 15713280 bytes at any n_ctx >= 1023.
TEST(CliTrial, InfoShowsSlidingLayersRopeBasesAndTensorTypes) {
  KVQ_REQUIRE_MODEL(model, "gemma-3-270m-q4_k_m.gguf");
  auto f = gguf_file::open(model);
  const int64_t window = f->get_int("gemma3.attention.sliding_window");
  ASSERT_EQ(window, 512);
  const double base_global = f->get_float("gemma3.rope.freq_base");
  // the sliding layers' base: gemma3.rope.freq_base_swa, 10000 when absent (llama.cpp's gemma3)
  const double base_sliding = f->try_float("gemma3.rope.freq_base_swa").value_or(10000.0);

  const auto r = run_cmd({test::kvq_bin(), "info", "-m", model, "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["sliding_window"], window);
  ASSERT_EQ(j["layer_kinds"].size(), 2u) << j["layer_kinds"].dump();
  EXPECT_EQ(j["layer_kinds"][0]["kind"], "global");
  EXPECT_EQ(j["layer_kinds"][0]["n_layers"], 3);
  EXPECT_EQ(j["layer_kinds"][0]["rope_freq_base"], nlohmann::json::array({base_global}));
  EXPECT_EQ(j["layer_kinds"][1]["kind"], "sliding");
  EXPECT_EQ(j["layer_kinds"][1]["n_layers"], 15);
  EXPECT_EQ(j["layer_kinds"][1]["window"], nlohmann::json::array({window}));
  EXPECT_EQ(j["layer_kinds"][1]["rope_freq_base"], nlohmann::json::array({base_sliding}));
  EXPECT_EQ(j["bytes_per_token_layers"], "global");
  EXPECT_EQ(j["n_ctx"], 4096);
  bool seen_f16 = false;
  for (const auto& row : j["kv_types"]) {
    if (row["type"] != "f16") continue;
    seen_f16 = true;
    EXPECT_EQ(row["bytes_per_token"].get<double>(), 3072.0);
    EXPECT_EQ(row["bytes_global_layers"].get<int64_t>(), 3072 * 4096);
    EXPECT_EQ(row["bytes_window_layers"].get<int64_t>(), 15 * 1023 * 256 * 2 * 2);
  }
  EXPECT_TRUE(seen_f16);
  const auto types = tensor_type_counts(model);
  EXPECT_EQ((j["tensor_types"].get<std::map<std::string, int>>()), types);

  // the text lists the same, and labels bytes/token as the global layers'
  const auto t = run_cmd({test::kvq_bin(), "info", "-m", model});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("layers       3 global (RoPE base 1000000), 15 sliding-window (window 512 tokens, RoPE base 10000)"),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("bytes/token counts the 3 global layers only"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("B/token global"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("sliding (fixed)"), std::string::npos) << t.out;
  for (const auto& [name, n] : types)
    EXPECT_NE(t.out.find(name + ": " + std::to_string(n)), std::string::npos) << name << "\n" << t.out;
}

// A model without sliding layers: one kind, no window, the tensor types of its GGUF.
TEST(CliTrial, InfoWithoutSlidingLayers) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const auto r = run_cmd({test::kvq_bin(), "info", "-m", model, "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["sliding_window"], 0);
  ASSERT_EQ(j["layer_kinds"].size(), 1u) << j["layer_kinds"].dump();
  EXPECT_EQ(j["layer_kinds"][0]["kind"], "global");
  EXPECT_EQ(j["layer_kinds"][0]["n_layers"], j["n_layer"]);
  EXPECT_EQ((j["tensor_types"].get<std::map<std::string, int>>()), tensor_type_counts(model));
  const auto t = run_cmd({test::kvq_bin(), "info", "-m", model});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_EQ(t.out.find("sliding"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find(" bytes/token "), std::string::npos) << t.out;
}

// Every line of the bench table has its '|' at the same columns, labels wider than 11 included.
TEST(CliTrial, BenchTableColumnsFitTheWidestLabel) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const auto r = run_cmd({test::kvq_bin(), "bench", "-m", model, "--types", "f16,kivi4/q4a+sink4", "--depths", "0",
                          "-n", "1", "-p", "0", "-t", "1", "--no-progress"});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::istringstream in(r.out);
  std::string line, first;
  int n = 0;
  auto bars = [](const std::string& s) {
    std::vector<size_t> at;
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i] == '|') at.push_back(i);
    return at;
  };
  while (std::getline(in, line)) {
    if (line.empty() || line[0] != '|') continue;
    if (first.empty()) first = line;
    EXPECT_EQ(bars(line), bars(first)) << line << "\n" << first;
    ++n;
  }
  EXPECT_EQ(n, 4) << r.out;  // header, rule, 2 rows
  EXPECT_NE(r.out.find("| kivi4/q4a+sink4 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| f16             |"), std::string::npos) << r.out;
}

// Control tokens print their vocabulary text (tokenizer.ggml.tokens), normal ones their piece.
TEST(CliTrial, TokenizePiecesShowControlTokens) {
  KVQ_REQUIRE_DATA(stories, "models/stories260K/stories260K.gguf");
  struct c { std::string model, prompt, line; };
  std::vector<c> cases;
  {
    auto f = gguf_file::open(stories);
    const std::string bos = f->find("tokenizer.ggml.tokens")->arr_str.at(f->get_int("tokenizer.ggml.bos_token_id"));
    ASSERT_EQ(bos, "<s>");
    cases.push_back({stories, "hi", "     1 -> '" + bos + "'"});
  }
  const std::string gemma = test::model_dir() + "/gemma-3-270m-q4_k_m.gguf";
  if (std::filesystem::exists(gemma)) {
    auto f = gguf_file::open(gemma);
    const std::string sot = f->find("tokenizer.ggml.tokens")->arr_str.at(105);
    ASSERT_EQ(sot, "<start_of_turn>");
    cases.push_back({gemma, "<start_of_turn>user", "   105 -> '" + sot + "'"});
    cases.push_back({gemma, "<start_of_turn>user", "     2 -> '<bos>'"});
  }
  for (const auto& k : cases) {
    const auto r = run_cmd({test::kvq_bin(), "tokenize", "-m", k.model, "-p", k.prompt, "--pieces"});
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.out.find(k.line + "\n"), std::string::npos) << k.line << "\n" << r.out;
    EXPECT_EQ(r.out.find("''"), std::string::npos) << r.out;
  }
}

// A missing text file names the OS reason (strerror(ENOENT)), as a missing model file does.
TEST(CliTrial, MissingTextFileNamesTheReason) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const std::string reason = std::strerror(ENOENT);
  const std::string bin = test::kvq_bin(), path = "/nonexistent-kvq-trial.txt";
  for (const std::vector<std::string>& argv :
       {std::vector<std::string>{bin, "perplexity", "-m", model, "-f", path},
        std::vector<std::string>{bin, "eval-passkey", "-m", model, "-f", path, "--lengths", "1k"},
        std::vector<std::string>{bin, "kv-error", "-m", model, "-f", path},
        std::vector<std::string>{bin, "bench", "-m", model, "-f", path, "--depths", "0", "-n", "1", "-p", "0",
                                 "--no-progress"}}) {
    const auto r = run_cmd(argv);
    EXPECT_EQ(r.rc, 2) << argv[1] << ": " << r.err;
    EXPECT_NE(r.err.find("'" + path + "': " + reason), std::string::npos) << argv[1] << ": " << r.err;
  }
  const auto m = run_cmd({bin, "perplexity", "-m", "/nonexistent-kvq-trial.gguf", "-f", path});
  EXPECT_NE(m.err.find(reason), std::string::npos) << m.err;
}

}  // namespace
}  // namespace kvq
