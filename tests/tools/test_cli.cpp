// The kvq command-line tool end to end: llama.cpp golden token ids and generations, JSON output,
// and exit code 2 with a clear message on bad input.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kvq/cpu.h"
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

// --json output stays valid JSON when the text is not valid UTF-8: a prompt in another script
// (tinylit's byte-level vocabulary splits it; its one generated token may end mid-character) and
// raw invalid bytes in the prompt, which come back as U+FFFD in "prompt"; the ids stay exact.
TEST(Cli, GenerateJsonSurvivesInvalidUtf8) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const std::vector<std::vector<std::string>> extra = {{"-p", "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e", "-n", "1", "--temp", "0"},
                                                       {"-p", "ab\xff\xfe cd", "-n", "2", "--temp", "0"}};
  for (const auto& e : extra) {
    std::vector<std::string> argv = {test::kvq_bin(), "generate", "-m", model, "--json", "-t", "1"};
    argv.insert(argv.end(), e.begin(), e.end());
    const auto r = run_cmd(argv);
    ASSERT_EQ(r.rc, 0) << e[1] << ": " << r.err;
    const auto j = nlohmann::json::parse(r.out);  // throws (fails the test) on invalid JSON
    EXPECT_EQ(j["ids"].size(), (size_t)std::stoi(e[3])) << e[1];
    EXPECT_TRUE(j["text"].is_string());
    EXPECT_EQ(j["attn_tier"], isa_name(best_isa())) << "tinylit: head_dim 64, f16 cache";
    if (e[1][0] == 'a') {
      EXPECT_NE(j["prompt"].get<std::string>().find("\xef\xbf\xbd"), std::string::npos) << j["prompt"];
    }
  }
}

TEST(Cli, StreamingTextAndSummary) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0",
                          "-t", "1"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Once upon a time, there was a little girl named Lily.", 0), 0u) << r.out;
  EXPECT_NE(r.err.find("decode"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bytes/token"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[kvq] attention tier scalar\n"), std::string::npos) << r.err;  // head_dim 8
}

// KV bytes per token of the whole model (all layers, K and V) counted by hand from the format
// definitions of docs/formats.md, not from the library: codes of `bits` x head_dim / 8 bytes plus
// one f16 scale (and, asymmetric, one f16 zero point) per group of G elements, per token, kv head
// and layer. G is the default group (32 when head_dim is a multiple of 32, else head_dim); KIVI K
// stores per channel one f16 scale and zero per T = 32 tokens (4 d / T bytes per token), its V is
// q{b}a; certified is its fast tier (K q8 with one f16 error bound per 32 elements (8 when 32 does
// not divide d), V q4 with one per row) plus the host tier's f16 originals of K and V (4 d).
// Returns -1 for a type it does not know.
double hand_kv_bytes_per_token(const std::string& type, int n_layer, int n_kv_head, int d) {
  const double G = d % 32 == 0 ? 32 : d, T = 32;
  auto per_token = [&](int bits, bool asym) { return bits * d / 8.0 + (asym ? 2 : 1) * 2.0 * d / G; };
  auto kivi_k = [&](int bits) { return bits * d / 8.0 + 4.0 * d / T; };
  double side2 = -1;  // K + V bytes per token of one kv head of one layer
  if (type == "f32") side2 = 2 * 4.0 * d;
  else if (type == "f16" || type == "bf16") side2 = 2 * 2.0 * d;
  else if (type == "q8") side2 = 2 * per_token(8, false);
  else if (type == "q4") side2 = 2 * per_token(4, false);
  else if (type == "q3") side2 = 2 * per_token(3, false);
  else if (type == "q2") side2 = 2 * per_token(2, false);
  else if (type == "q8a") side2 = 2 * per_token(8, true);
  else if (type == "q4a") side2 = 2 * per_token(4, true);
  else if (type == "q3a") side2 = 2 * per_token(3, true);
  else if (type == "q2a") side2 = 2 * per_token(2, true);
  else if (type == "q4nl") side2 = 2 * per_token(4, false);  // non-uniform levels: same bytes as q4
  else if (type == "q3nl") side2 = 2 * per_token(3, false);
  else if (type == "q2nl") side2 = 2 * per_token(2, false);
  else if (type == "kivi8") side2 = kivi_k(8) + per_token(8, true);
  else if (type == "kivi4") side2 = kivi_k(4) + per_token(4, true);
  else if (type == "kivi2") side2 = kivi_k(2) + per_token(2, true);
  else if (type == "certified")
    side2 = (per_token(8, false) + 2.0 * d / (d % 32 == 0 ? 32 : d % 8 == 0 ? 8 : d)) + (per_token(4, false) + 2) +
            4.0 * d;
  return side2 < 0 ? -1 : side2 * n_layer * n_kv_head;
}

std::string fmt2(double x) {
  char b[64];
  std::snprintf(b, sizeof b, "%.2f", x);
  return b;
}

// Every KV type of `kvq info` (JSON and the text table) on two shapes (head_dim 8 with G = 8,
// head_dim 64 with G = 32): bytes/token equals the hand count above, the ratio equals f16 bytes /
// format bytes, dense types allocate bytes/token x n_ctx, and no row carries an error.
TEST(Cli, InfoListsKvTypes) {
  struct shape { const char* rel; int n_layer, n_kv_head, n_head, head_dim; };
  // the hand count pinned to the figures of docs/quality.md: stories260K f16 640, q8 400, q4 240,
  // kivi4 260 (5 layers x 4 kv heads x (K + V)); tinylit f16 3072, q8 1632 (8.5 bits), q4 864, kivi4 960
  struct want { double f16, q8, q4, kivi4; };
  const std::vector<std::pair<shape, want>> models = {
      {{"models/stories260K/stories260K.gguf", 5, 4, 8, 8}, {640, 400, 240, 260}},
      {{"models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf", 6, 2, 8, 64}, {3072, 1632, 864, 960}},
  };
  const std::set<std::string> all_types = {"f32", "f16", "bf16", "q8", "q4", "q3", "q2", "q8a",
                                           "q4a", "q3a", "q2a", "kivi8", "kivi4", "kivi2", "q4nl", "q3nl",
                                           "q2nl", "certified"};
  for (const auto& [sh, w] : models) {
    KVQ_REQUIRE_DATA(model, sh.rel);
    SCOPED_TRACE(sh.rel);
    const double f16 = hand_kv_bytes_per_token("f16", sh.n_layer, sh.n_kv_head, sh.head_dim);
    ASSERT_EQ(f16, w.f16);
    ASSERT_EQ(hand_kv_bytes_per_token("q8", sh.n_layer, sh.n_kv_head, sh.head_dim), w.q8);
    ASSERT_EQ(hand_kv_bytes_per_token("q4", sh.n_layer, sh.n_kv_head, sh.head_dim), w.q4);
    ASSERT_EQ(hand_kv_bytes_per_token("kivi4", sh.n_layer, sh.n_kv_head, sh.head_dim), w.kivi4);

    const auto r = run_cmd({test::kvq_bin(), "info", "-m", model, "--json"});
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["head_dim"], sh.head_dim);
    EXPECT_EQ(j["n_kv_head"], sh.n_kv_head);
    EXPECT_EQ(j["n_head"], sh.n_head);
    EXPECT_EQ(j["n_layer"], sh.n_layer);
    const int64_t n_ctx = j["n_ctx"];
    std::set<std::string> seen;
    for (const auto& row : j["kv_types"]) {
      const std::string t = row["type"];
      EXPECT_TRUE(seen.insert(t).second) << "type listed twice: " << t;
      EXPECT_FALSE(row.contains("error")) << t << ": " << row.value("error", "");
      const double want_bpt = hand_kv_bytes_per_token(t, sh.n_layer, sh.n_kv_head, sh.head_dim);
      if (want_bpt < 0) {
        ADD_FAILURE() << "kvq info lists '" << t << "', which has no hand count here";
        continue;
      }
      if (!row.contains("bytes_per_token")) {
        ADD_FAILURE() << t << ": no bytes_per_token";
        continue;
      }
      EXPECT_EQ(row["bytes_per_token"].get<double>(), want_bpt) << t;
      EXPECT_NEAR(row["ratio_to_f16"].get<double>(), f16 / want_bpt, 1e-12) << t;
      if (t == "f32" || t == "f16" || t == "bf16") {
        EXPECT_EQ(row["bytes_at_n_ctx"].get<int64_t>(), (int64_t)want_bpt * n_ctx) << t;
      }
      // the attention tier (issue 15 item 6: no silent slow path): the SIMD engine takes head dims
      // that are multiples of 16 up to 256 (default groups), the rest run the scalar reference
      const std::string want_tier = t == "certified"                                   ? "scalar (certified reference)"
                                    : sh.head_dim % 16 == 0 && sh.head_dim <= 256 ? isa_name(best_isa())
                                                                                   : "scalar";
      EXPECT_EQ(row.value("attn_tier", ""), want_tier) << t;
    }
    EXPECT_EQ(seen, all_types);

    // the text table prints the same figures to two decimals: "type  bytes/token  ratio x  bytes at n_ctx"
    const auto rt = run_cmd({test::kvq_bin(), "info", "-m", model});
    ASSERT_EQ(rt.rc, 0) << rt.err;
    std::istringstream lines(rt.out.substr(rt.out.find("bytes at n_ctx")));
    std::string line;
    std::getline(lines, line);  // the header
    std::set<std::string> seen_text;
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string t, bpt, ratio;
      f >> t >> bpt >> ratio;
      if (t.empty()) continue;
      seen_text.insert(t);
      const double want_bpt = hand_kv_bytes_per_token(t, sh.n_layer, sh.n_kv_head, sh.head_dim);
      EXPECT_GE(want_bpt, 0) << line;
      EXPECT_EQ(bpt, fmt2(want_bpt)) << line;
      EXPECT_EQ(ratio, fmt2(f16 / want_bpt) + "x") << line;
    }
    EXPECT_EQ(seen_text, all_types);
  }
}

// Bad input: exit code 2 and a message naming what was wrong; never a crash.
TEST(Cli, BadInputExitsWithCode2) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  struct bad { std::vector<std::string> argv; std::string needle; };
  const std::vector<bad> cases = {
      {{bin, "generate", "-m", "/nonexistent.gguf", "-p", "hi"}, "/nonexistent.gguf"},
      {{bin, "generate", "-m", model, "-p", "hi", "-ctk", "q5_zz"}, "q5_zz"},
      {{bin, "generate", "-m", model, "-p", "hi", "-c", "99999999"}, "context"},
      {{bin, "generate", "-m", model, "-p", "hi", "--top-p", "0"},
       "--top-p: must be > 0, got 0"},  // the flag, not the sampler's name
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

// perplexity and kv-error: a directory is named as one, each tool's messages carry its own op,
// flags are refused before the text is read, and kv-error without TV shows no TV numbers.
TEST(Cli, PerplexityAndKvErrorNewUserErrors) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const std::string bin = test::kvq_bin();
  const std::string dir = ::testing::TempDir() + "kvq_cli_dir_" + std::to_string(::getpid());
  const std::string empty = dir + "/empty.txt";
  std::filesystem::create_directories(dir);
  std::ofstream(empty).close();
  struct bad { std::vector<std::string> argv; std::string needle, absent; };
  const std::vector<bad> cases = {
      {{bin, "perplexity", "-m", model, "-f", dir}, "[perplexity] text file '" + dir + "' is a directory", "empty"},
      {{bin, "kv-error", "-m", model, "-f", dir}, "[kv_error] text file '" + dir + "' is a directory", "perplexity"},
      {{bin, "kv-error", "-m", model, "-f", dir + "/missing.txt"}, "[kv_error] cannot open", "perplexity"},
      {{bin, "kv-error", "-m", model, "-f", empty}, "[kv_error] text file", "perplexity"},
      // flags first: the (empty) text is not even read
      {{bin, "perplexity", "-m", model, "-f", empty, "-c", "3"}, "context size -c 3", "empty"},
      {{bin, "perplexity", "-m", model, "-f", empty, "--chunks", "0"}, "--chunks 0", "empty"},
      {{bin, "perplexity", "-m", model, "-f", empty, "-ctk", "q5_zz"}, "q5_zz", "empty"},
      {{bin, "kv-error", "-m", model, "-f", empty, "-c", "99999"}, "[kv_error] context size -c 99999", "empty"},
  };
  for (const auto& c : cases) {
    const auto r = run_cmd(c.argv);
    EXPECT_EQ(r.rc, 2) << c.argv[1] << " " << c.argv.back() << ": " << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << r.err;
    EXPECT_EQ(r.err.find(c.absent), std::string::npos) << "did not expect '" << c.absent << "' in: " << r.err;
  }
  std::filesystem::remove_all(dir);
}

TEST(Cli, KvErrorNoTvShowsNoTvNumbersAndFullFormatNames) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(text, "data/tinystories-val-794k/tinystories_val.txt");
  const std::string bin = test::kvq_bin();
  const std::vector<std::string> base = {bin, "kv-error", "-m", model, "-f", text, "-c", "32", "-t", "1",
                                         "--no-progress", "-ctk", "kivi4", "-ctv", "q4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return run_cmd(a);
  };
  const auto js = with({"--json"});
  ASSERT_EQ(js.rc, 0) << js.err;
  const auto j = nlohmann::json::parse(js.out);
  ASSERT_EQ(j["formats"].size(), 1u);
  EXPECT_TRUE(j["tv"].get<bool>());
  EXPECT_GT(j["formats"][0]["mean_tv"].get<double>(), 0.0);
  const std::string describe = j["formats"][0]["describe"];
  ASSERT_GT(describe.size(), 34u);  // longer than the old fixed column

  const auto nj = with({"--json", "--no-tv"});
  ASSERT_EQ(nj.rc, 0) << nj.err;
  const auto n = nlohmann::json::parse(nj.out);
  EXPECT_FALSE(n["tv"].get<bool>());
  EXPECT_FALSE(n["formats"][0].contains("mean_tv"));  // absent, not 0
  EXPECT_FALSE(n["formats"][0]["worst"][0].contains("tv"));
  EXPECT_EQ(n["formats"][0]["mean_rel_err"], j["formats"][0]["mean_rel_err"]);

  const auto table = with({"--no-tv"});
  ASSERT_EQ(table.rc, 0) << table.err;
  EXPECT_NE(table.out.find(describe), std::string::npos) << table.out;  // the whole name
  EXPECT_EQ(table.out.find("0.000e+00"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("not computed"), std::string::npos) << table.out;
  const auto full = with({});
  ASSERT_EQ(full.rc, 0) << full.err;
  EXPECT_NE(full.out.find(describe), std::string::npos) << full.out;
}

}  // namespace
}  // namespace kvq
