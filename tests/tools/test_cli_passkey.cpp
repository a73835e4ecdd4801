// kvq eval-passkey end to end: the --json object's shape and its agreement with the table, the
// same prompts for the same seed, and bad input (exit 2, a message naming the value or file).
// The Qwen2.5 check (f16 and the recommended 4-bit cache find the key) is Cli.EvalPasskeyQwen.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

using test::run_cmd;

const char* kStories = "models/stories260K/stories260K.gguf";
const char* kText = "data/tinystories-val-794k/tinystories_val.txt";

void expect_shape(const nlohmann::json& j, const std::vector<int>& lengths, const std::vector<double>& depths,
                  int trials) {
  for (const char* k : {"model", "haystack", "haystack_tokens", "lengths", "depths", "trials_per_cell", "seed",
                        "n_answer", "n_batch", "kv_type_k", "kv_type_v", "kv_cache", "kv_bytes_per_token",
                        "kv_bytes_per_token_f16", "accuracy", "seconds", "prefill_tokens_per_s", "cells", "trials"})
    ASSERT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["lengths"].get<std::vector<int>>(), lengths);
  EXPECT_EQ(j["depths"].get<std::vector<double>>(), depths);
  EXPECT_EQ(j["trials_per_cell"], trials);
  ASSERT_EQ(j["cells"].size(), lengths.size() * depths.size());
  ASSERT_EQ(j["trials"].size(), lengths.size() * depths.size() * trials);
  int ok = 0;
  for (size_t i = 0; i < j["cells"].size(); ++i) {
    const auto& c = j["cells"][i];
    EXPECT_EQ(c["length"], lengths[i / depths.size()]);
    EXPECT_EQ(c["depth"], depths[i % depths.size()]);
    EXPECT_EQ(c["n_trials"], trials);
    EXPECT_DOUBLE_EQ(c["accuracy"].get<double>(), c["n_correct"].get<double>() / trials);
    ok += c["n_correct"].get<int>();
  }
  for (const auto& t : j["trials"]) {
    for (const char* k : {"length", "depth", "trial", "key", "answer", "correct", "needle_pos", "n_prompt", "seconds"})
      ASSERT_TRUE(t.contains(k)) << k;
    const std::string key = t["key"], ans = t["answer"];
    EXPECT_EQ(t["correct"].get<bool>(), ans.find(key) != std::string::npos);
    EXPECT_EQ(t["n_prompt"].get<int>(), t["length"].get<int>() - j["n_answer"].get<int>());
  }
  EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), (double)ok / j["trials"].size());
}

TEST(Cli, EvalPasskeyJsonShapeAndDeterminism) {
  KVQ_REQUIRE_DATA(model, kStories);
  KVQ_REQUIRE_DATA(text, kText);
  const std::string bin = test::kvq_bin();
  const std::vector<std::string> base = {bin, "eval-passkey", "-m", model, "-f", text, "--lengths", "320,512",
                                         "--depths", "0,50,100", "--trials", "2", "-t", "1", "-b", "64", "--no-progress"};
  auto argv = base;
  argv.push_back("--json");
  const auto a = run_cmd(argv);
  ASSERT_EQ(a.rc, 0) << a.err;
  const auto ja = nlohmann::json::parse(a.out);
  expect_shape(ja, {320, 512}, {0, 50, 100}, 2);
  EXPECT_EQ(ja["kv_type_k"], "f16");
  const auto b = run_cmd(argv);  // same seed: same keys and answers
  ASSERT_EQ(b.rc, 0) << b.err;
  const auto jb = nlohmann::json::parse(b.out);
  for (size_t i = 0; i < ja["trials"].size(); ++i) {
    EXPECT_EQ(ja["trials"][i]["key"], jb["trials"][i]["key"]);
    EXPECT_EQ(ja["trials"][i]["answer"], jb["trials"][i]["answer"]);
    EXPECT_EQ(ja["trials"][i]["needle_pos"], jb["trials"][i]["needle_pos"]);
  }
  argv.insert(argv.end(), {"-s", "7", "-ctk", "q8", "-ctv", "q4"});  // another seed, another cache
  const auto c = run_cmd(argv);
  ASSERT_EQ(c.rc, 0) << c.err;
  const auto jc = nlohmann::json::parse(c.out);
  expect_shape(jc, {320, 512}, {0, 50, 100}, 2);
  EXPECT_EQ(jc["kv_type_k"], "q8");
  EXPECT_EQ(jc["kv_type_v"], "q4");
  int differ = 0;
  for (size_t i = 0; i < ja["trials"].size(); ++i) differ += ja["trials"][i]["key"] != jc["trials"][i]["key"];
  EXPECT_GE(differ, 10);  // of 12
  // the table: one row per length, the overall accuracy of the JSON
  const auto t = run_cmd(base);
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("passkey accuracy %"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("\n     320 "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("\n     512 "), std::string::npos) << t.out;
  char overall[64];
  std::snprintf(overall, sizeof overall, "overall %.1f %% of 12 prompts", 100 * ja["accuracy"].get<double>());
  EXPECT_NE(t.out.find(overall), std::string::npos) << t.out;
}

// The real task at CI size: Qwen2.5-Coder-0.5B, 1024-token prompts of wikitext-2 with the key at
// depths 0, 50 and 100 %. The f16 cache finds every key (verified before this test was written, and
// at 4096 tokens in docs/quality.md); the recommended 4-bit cache (-ctk kivi4 -ctv q4a --kv-sink 4)
// runs the same prompts (same keys) and finds them too. About 6,000 prefill tokens in all.
TEST(Cli, EvalPasskeyQwen) {
  KVQ_REQUIRE_MODEL(model, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
  KVQ_REQUIRE_DATA(text, "data/wikitext-2-raw-test/wiki.test.raw");
  const std::vector<std::string> base = {test::kvq_bin(), "eval-passkey", "-m", model, "-f", text, "--lengths", "1024",
                                         "--depths", "0,50,100", "--trials", "1", "-t", "2", "--json", "--no-progress"};
  const auto f = run_cmd(base);
  ASSERT_EQ(f.rc, 0) << f.err;
  const auto jf = nlohmann::json::parse(f.out);
  expect_shape(jf, {1024}, {0, 50, 100}, 1);
  EXPECT_EQ(jf["kv_cache"], "K f16 / V f16 (dense)");
  for (const auto& t : jf["trials"]) EXPECT_TRUE(t["correct"].get<bool>()) << t.dump();
  auto argv = base;
  argv.insert(argv.end(), {"-ctk", "kivi4", "-ctv", "q4a", "--kv-sink", "4"});
  const auto q = run_cmd(argv);
  ASSERT_EQ(q.rc, 0) << q.err;
  const auto jq = nlohmann::json::parse(q.out);
  expect_shape(jq, {1024}, {0, 50, 100}, 1);
  EXPECT_EQ(jq["kv_type_k"], "kivi4");
  EXPECT_LT(jq["kv_bytes_per_token"].get<double>(), 0.35 * jf["kv_bytes_per_token"].get<double>());
  for (size_t i = 0; i < jf["trials"].size(); ++i) {
    EXPECT_EQ(jq["trials"][i]["key"], jf["trials"][i]["key"]);  // the same prompts
    EXPECT_TRUE(jq["trials"][i]["correct"].get<bool>()) << jq["trials"][i].dump();
  }
}

TEST(Cli, EvalPasskeyBadInput) {
  KVQ_REQUIRE_DATA(model, kStories);
  KVQ_REQUIRE_DATA(text, kText);
  const std::string bin = test::kvq_bin();
  const std::string dir = ::testing::TempDir() + "kvq_cli_passkey_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string small = dir + "/small.txt";
  std::ofstream(small) << "Once upon a time there was a cat. It sat on a mat. The end.\n";
  struct bad { std::vector<std::string> argv; std::string needle; };
  const std::vector<bad> cases = {
      {{bin, "eval-passkey", "-m", model, "-f", text, "--lengths", "1500", "-c", "1024"},
       "[eval_passkey] length 1500 exceeds the context size -c 1024"},
      {{bin, "eval-passkey", "-m", model, "-f", text, "--lengths", "64k"},
       "[eval_passkey] length 65536 exceeds the model's training context"},
      {{bin, "eval-passkey", "-m", model, "-f", small, "--lengths", "512"}, "haystack '" + small + "' has "},
      {{bin, "eval-passkey", "-m", model, "-f", text, "--depths", "0,150"}, "depth 150 % is outside [0, 100]"},
      {{bin, "eval-passkey", "-m", model, "-f", text, "--depths", "0,half"}, "--depths: 'half' is not a number"},
      {{bin, "eval-passkey", "-m", model, "-f", text, "--lengths", "4q"}, "--lengths: '4q' is not an integer"},
      {{bin, "eval-passkey", "-m", model, "-f", dir + "/missing.txt", "--lengths", "256"}, "missing.txt"},
      {{bin, "eval-passkey", "-m", model, "-f", text, "-ctk", "q5_zz"}, "q5_zz"},
  };
  for (const auto& c : cases) {
    const auto r = run_cmd(c.argv);
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << r.err;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvq
