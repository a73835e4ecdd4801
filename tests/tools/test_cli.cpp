// The kvq command-line tool end to end: llama.cpp golden token ids and generations, JSON output,
// and exit code 2 with a clear message on bad input.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

using test::run_cmd;

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

std::string unhex(const std::string& h) {
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) s.push_back((char)std::stoi(h.substr(i, 2), nullptr, 16));
  return s;
}

TEST(Cli, TokenizeMatchesLlamaCpp) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(golden, "golden/stories260K/tokenization.json");
  const auto g = read_json(golden);
  int n = 0;
  for (const auto& s : g["strings"]) {
    const std::string text = unhex(s["utf8_hex"]);
    if (text.empty() || text.find('\0') != std::string::npos) continue;
    struct variant { const char* key; std::vector<std::string> flags; };
    for (const variant& v : {variant{"with_bos", {}}, variant{"no_bos", {"--no-bos"}},
                             variant{"no_bos_no_parse_special", {"--no-bos", "--no-parse-special"}}}) {
      if (!s.contains(v.key) || s[v.key]["rc"] != 0) continue;
      std::vector<std::string> argv = {test::kvq_bin(), "tokenize", "-m", model, "-p", text};
      argv.insert(argv.end(), v.flags.begin(), v.flags.end());
      const auto r = run_cmd(argv);
      ASSERT_EQ(r.rc, 0) << r.err;
      EXPECT_EQ(nlohmann::json::parse(r.out).get<std::vector<int>>(), s[v.key]["ids"].get<std::vector<int>>())
          << s["name"] << " " << v.key;
      ++n;
    }
  }
  EXPECT_GE(n, 10);
}

TEST(Cli, GenerateJsonMatchesLlamaCppGreedy) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(golden, "golden/stories260K/generation.json");
  const auto g = read_json(golden);
  for (const auto& run : g["runs"]) {
    if (run["id"] != "p2_f16_fa-on") continue;
    const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", run["prompt"], "-n", "64", "--temp", "0",
                            "-c", "512", "-ctk", "f16", "-ctv", "f16", "-t", "2", "--json"});
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["ids"].get<std::vector<int>>(), run["generated_token_ids"].get<std::vector<int>>());
    EXPECT_EQ(j["prompt_ids"].get<std::vector<int>>(), run["prompt_token_ids"].get<std::vector<int>>());
    EXPECT_EQ(j["n_generated"], 64);
    // stories260K: 5 layers x 4 kv heads x 8 head_dim x (K + V) x 2 bytes
    EXPECT_EQ(j["kv_bytes_per_token"], 5 * 4 * 8 * 2 * 2);
    EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0.0);
    return;
  }
  FAIL() << "golden run p2_f16_fa-on not found";
}

TEST(Cli, StreamingTextAndSummary) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0",
                          "-t", "1"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Once upon a time, there was a little girl named Lily.", 0), 0u) << r.out;
  EXPECT_NE(r.err.find("decode"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bytes/token"), std::string::npos) << r.err;
}

TEST(Cli, InfoListsKvTypes) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const auto r = run_cmd({test::kvq_bin(), "info", "-m", model, "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["head_dim"], 64);
  EXPECT_EQ(j["n_kv_head"], 2);
  EXPECT_EQ(j["n_head"], 8);
  bool saw_f16 = false;
  for (const auto& row : j["kv_types"])
    if (row["type"] == "f16") {
      saw_f16 = true;
      EXPECT_EQ(row["bytes_per_token"], 6 * 2 * 64 * 2 * 2);
      EXPECT_EQ(row["ratio_to_f16"], 1.0);
    }
  EXPECT_TRUE(saw_f16);
}

// Bad input: exit code 2 and a message naming what was wrong; never a crash.
TEST(Cli, BadInputExitsWithCode2) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  struct bad { std::vector<std::string> argv; std::string needle; };
  const std::vector<bad> cases = {
      {{bin, "generate", "-m", "/nonexistent.gguf", "-p", "hi"}, "/nonexistent.gguf"},
      {{bin, "generate", "-m", model, "-p", ""}, "empty"},
      {{bin, "generate", "-m", model, "-p", "hi", "-ctk", "q5_zz"}, "q5_zz"},
      {{bin, "generate", "-m", model, "-p", "hi", "-c", "99999999"}, "context"},
      {{bin, "generate", "-m", model, "-p", "hi", "--top-p", "0"}, "top_p"},
      {{bin, "generate", "-m", model}, "prompt"},
      {{bin, "frobnicate"}, "frobnicate"},
      {{bin, "tokenize", "-m", model}, "prompt"},
      {{bin, "info", "-m", "/etc/passwd"}, "/etc/passwd"},
  };
  for (const auto& c : cases) {
    const auto r = run_cmd(c.argv);
    EXPECT_EQ(r.rc, 2) << c.argv[1] << " ... " << r.err;
    EXPECT_NE((r.err + r.out).find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << r.err;
  }
}

}  // namespace
}  // namespace kvq
