// Option validation of kvq generate / info found by a new-user trial: every bad value is refused
// with exit code 2 and a message naming the flag; -s -1 means a random seed, as in llama.cpp.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

using test::run_cmd;

TEST(CliOptions, SeedMinusOneIsRandomAndOutOfRangeIsRefused) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  auto gen = [&](const std::string& seed) {
    return run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Once upon a time", "-n", "4", "--temp", "1",
                    "-s", seed, "--json"});
  };
  const auto a = gen("-1"), b = gen("-1"), c = gen("42");
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(c.rc, 0) << c.err;
  const auto sa = nlohmann::json::parse(a.out)["seed"].get<uint64_t>();
  const auto sb = nlohmann::json::parse(b.out)["seed"].get<uint64_t>();
  EXPECT_NE(sa, sb);  // two random seeds (2^-32 chance to collide)
  EXPECT_EQ(nlohmann::json::parse(c.out)["seed"].get<uint64_t>(), 42u);
  // any 64-bit integer, as the server takes a request's seed (it refused 4294967296 and -2); a
  // negative seed is its two's complement, and s + 2^32 is another stream than s
  const auto big = gen("4294967296"), zero = gen("0"), neg = gen("-2"), top = gen("9223372036854775807");
  for (const auto* r : {&big, &zero, &neg, &top}) ASSERT_EQ(r->rc, 0) << r->err;
  EXPECT_EQ(nlohmann::json::parse(big.out)["seed"].get<uint64_t>(), 1ull << 32);
  EXPECT_EQ(nlohmann::json::parse(neg.out)["seed"].get<uint64_t>(), ~0ull - 1);
  EXPECT_EQ(nlohmann::json::parse(top.out)["seed"].get<uint64_t>(), (uint64_t)INT64_MAX);
  EXPECT_EQ(nlohmann::json::parse(gen("4294967296").out)["ids"], nlohmann::json::parse(big.out)["ids"]);  // reproduces
  for (const char* bad : {"9223372036854775808", "-9223372036854775809", "1.5", "x"}) {
    const auto r = gen(bad);
    EXPECT_EQ(r.rc, 2) << bad;
    EXPECT_NE(r.err.find("--seed: must be a 64-bit integer, in [-9223372036854775808, 9223372036854775807], got " +
                         std::string(bad)),
              std::string::npos)
        << r.err;
  }
}

// --temp / --top-p / --min-p that are not finite numbers are refused naming the flag (--temp inf
// sampled uniformly among the top-k, -inf was greedy, 1e40 is inf as a float), before the model loads.
TEST(CliOptions, NonFiniteSamplingValuesAreRefused) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  struct bad {
    const char *flag, *value;
  };
  for (const bad& c :
       {bad{"--temp", "inf"}, bad{"--temp", "-inf"}, bad{"--temp", "nan"}, bad{"--temp", "1e40"}, bad{"--temp", "INF"},
        bad{"--top-p", "inf"}, bad{"--top-p", "nan"}, bad{"--min-p", "nan"}, bad{"--min-p", "-inf"}}) {
    const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "2", c.flag, c.value});
    EXPECT_EQ(r.rc, 2) << c.flag << " " << c.value << ": " << r.err;
    EXPECT_NE(r.err.find(std::string(c.flag) + ": must be a finite number, got " + c.value), std::string::npos)
        << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  const auto ok = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "2", "--temp", "1e30", "--top-p",
                           "0.5", "--min-p", "0", "--json"});
  EXPECT_EQ(ok.rc, 0) << ok.err;
}

// Out-of-range --min-p / --top-p are refused at parse time naming the flag the user typed (exit 2,
// "--min-p: must be in [0, 1], got 2"), not the sampler's internal name "min_p" when it runs; the
// sampler's own edges (min-p 0 and 1, top-p 1 or more: no cut) keep working.
TEST(CliOptions, OutOfRangeSamplingValuesNameTheFlag) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  struct bad {
    const char *flag, *value, *want;
  };
  for (const bad& c :
       {bad{"--min-p", "2", "--min-p: must be in [0, 1], got 2"},
        bad{"--min-p", "-0.1", "--min-p: must be in [0, 1], got -0.1"},
        bad{"--min-p", "1.0001", "--min-p: must be in [0, 1], got 1.0001"},
        bad{"--top-p", "0", "--top-p: must be > 0, got 0"}, bad{"--top-p", "-0.5", "--top-p: must be > 0, got -0.5"}}) {
    const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "2", c.flag, c.value});
    EXPECT_EQ(r.rc, 2) << c.flag << " " << c.value << ": " << r.err;
    EXPECT_NE(r.err.find(c.want), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("min_p"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("top_p"), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  for (const auto& [min_p, top_p] : {std::pair{"1", "2"}, std::pair{"0", "1"}}) {
    const auto ok = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "2", "--min-p", min_p,
                             "--top-p", top_p, "--json"});
    EXPECT_EQ(ok.rc, 0) << min_p << " " << top_p << ": " << ok.err;
  }
}

// --kv-tol and --kv-cert-budget must be finite and >= 0 in every command that takes them (the KV
// flags are shared): inf, nan and negatives exit 2 naming the flag and value, before the model
// loads; on a dense cache they were accepted silently, and inf passed the library's tol check.
TEST(CliOptions, NonFiniteKvTolAndBudgetAreRefusedByEveryCommand) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(text, "data/tinystories-val-794k/tinystories_val.txt");
  const std::string bin = test::kvq_bin();
  const std::vector<std::vector<std::string>> commands = {
      {bin, "generate", "-m", model, "-p", "Hi", "-n", "1"},
      {bin, "perplexity", "-m", model, "-f", text, "-c", "32", "--chunks", "1", "--no-progress"},
      {bin, "kv-error", "-m", model, "-f", text, "-c", "32", "--no-progress"},
      {bin, "bench", "-m", model, "--types", "f16", "--depths", "8", "-n", "1", "-p", "0", "--no-progress"},
      {bin, "eval-passkey", "-m", model, "--no-progress"},
      // a missing model: the flag is refused before it is opened, and a regression exits on the
      // missing file instead of serving (and hanging the test)
      {bin, "server", "-m", model + ".missing", "--port", "0"},
  };
  struct bad {
    const char *value, *want;
  };
  for (const auto& cmd : commands) {
    for (const char* flag : {"--kv-tol", "--kv-cert-budget"}) {
      for (const bad& c :
           {bad{"inf", "must be a finite number, got inf"}, bad{"nan", "must be a finite number, got nan"},
            bad{"-inf", "must be a finite number, got -inf"}, bad{"1e999", "must be a finite number"},
            bad{"-1", "must be >= 0, got -1"}}) {
        std::vector<std::string> argv = cmd;
        argv.insert(argv.end(), {flag, c.value});
        const auto r = run_cmd(argv);
        EXPECT_EQ(r.rc, 2) << cmd[1] << " " << flag << " " << c.value << ": " << r.err;
        EXPECT_NE(r.err.find(std::string(flag) + ": " + c.want), std::string::npos)
            << cmd[1] << " " << flag << " " << c.value << ": " << r.err;
        EXPECT_TRUE(r.out.empty()) << r.out;
      }
    }
  }
  const auto ok = run_cmd({bin, "generate", "-m", model, "-p", "Hi", "-n", "1", "-ctk", "certified", "-ctv",
                           "certified", "--kv-tol", "0", "--kv-cert-budget", "0.7"});
  EXPECT_EQ(ok.rc, 0) << ok.err;
}

// An empty prompt generates from BOS alone, as llama.cpp does (stories260K adds BOS = 1).
TEST(CliOptions, EmptyPromptIsBosAlone) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const auto r = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "", "-n", "8", "--temp", "0", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["prompt_ids"], nlohmann::json::array({1}));
  EXPECT_EQ(j["ids"].size(), 8u);
}

TEST(CliOptions, BadThreadsAndCertifyOnDenseAreRefused) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const auto t = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "1", "-t", "-1"});
  EXPECT_EQ(t.rc, 2);
  EXPECT_NE(t.err.find("--threads"), std::string::npos) << t.err;
  const auto c = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "1", "--kv-certify"});
  EXPECT_EQ(c.rc, 2);
  EXPECT_NE(c.err.find("--kv-certify"), std::string::npos) << c.err;
  const auto ok = run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Hi", "-n", "1", "--kv-certify", "-ctk",
                           "q8", "-ctv", "q4"});
  EXPECT_EQ(ok.rc, 0) << ok.err;
}

// -t is refused outside [0, 1024] by every command that takes it, with exit code 2 naming --threads
// (perplexity, kv-error and bench took -1 as "all" and any count, where generate, eval-passkey and
// server refused them).
TEST(CliOptions, ThreadsOutOfRangeAreRefusedByEveryCommand) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(text, "data/tinystories-val-794k/tinystories_val.txt");
  const std::string bin = test::kvq_bin();
  const std::vector<std::vector<std::string>> commands = {
      {bin, "perplexity", "-m", model, "-f", text, "-c", "32", "--chunks", "1", "--no-progress"},
      {bin, "kv-error", "-m", model, "-f", text, "-c", "32", "--no-progress"},
      {bin, "bench", "-m", model, "--types", "f16", "--depths", "8", "-n", "1", "-p", "0", "--no-progress"},
      {bin, "generate", "-m", model, "-p", "Hi", "-n", "1"},
  };
  for (const auto& cmd : commands) {
    for (const char* bad : {"-1", "1025"}) {
      std::vector<std::string> argv = cmd;
      argv.insert(argv.end(), {"-t", bad});
      const auto r = run_cmd(argv);
      EXPECT_EQ(r.rc, 2) << cmd[1] << " -t " << bad << ": " << r.err;
      EXPECT_NE(r.err.find("--threads"), std::string::npos) << cmd[1] << " -t " << bad << ": " << r.err;
    }
    std::vector<std::string> argv = cmd;
    argv.insert(argv.end(), {"-t", "1"});
    const auto ok = run_cmd(argv);
    EXPECT_EQ(ok.rc, 0) << cmd[1] << " -t 1: " << ok.err;
  }
}

// `kvq server --api-key ''` (say `--api-key "$KEY"` with KEY unset) is refused at parse time rather
// than serving without authentication, which an empty key means to the server. The template file
// that does not exist fails the start after parsing, so a build that accepts the empty key exits on
// that instead (without listening).
TEST(CliOptions, ServerRefusesAnEmptyApiKey) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  const std::string missing = "/nonexistent-kvq-template.jinja";
  const auto r = run_cmd(
      {test::kvq_bin(), "server", "-m", model, "--port", "0", "--api-key", "", "--chat-template-file", missing});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--api-key"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is empty"), std::string::npos) << r.err;
  const auto k = run_cmd(
      {test::kvq_bin(), "server", "-m", model, "--port", "0", "--api-key", "sekret", "--chat-template-file", missing});
  EXPECT_EQ(k.rc, 2) << k.err;  // a key is accepted: the start fails on the template file
  EXPECT_NE(k.err.find(missing), std::string::npos) << k.err;
}

TEST(CliOptions, InfoRefusesBadKvOptionsAndNamesItself) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const auto g = run_cmd({test::kvq_bin(), "info", "-m", model, "--kv-group", "48"});
  EXPECT_EQ(g.rc, 2) << g.out;
  EXPECT_NE(g.err.find("group_size 48"), std::string::npos) << g.err;
  const auto c = run_cmd({test::kvq_bin(), "info", "-m", model, "-c", "99999"});
  EXPECT_EQ(c.rc, 2);
  EXPECT_NE(c.err.find("[info] context size -c 99999"), std::string::npos) << c.err;
  const auto j = run_cmd({test::kvq_bin(), "info", "-m", model, "--json"});
  ASSERT_EQ(j.rc, 0) << j.err;
  const auto rows = nlohmann::json::parse(j.out)["kv_types"];
  ASSERT_FALSE(rows.empty());
  for (const auto& r : rows) {
    ASSERT_TRUE(r.contains("bytes_at_n_ctx")) << r.dump();
    EXPECT_TRUE(r["bytes_at_n_ctx"].is_number_integer()) << r.dump();
  }
  // with exact windows, bytes at n_ctx is the allocation: tinylit (6 layers x 2 kv heads, head_dim
  // 64), q4 g32 rows of 32 code bytes + 2 f16 scales, sink 4 + exact recent 128 rows of f16 (128
  // bytes), compressed body 1024 - 4 - 128 rows; K and V. Every layer is global: all of it is in
  // bytes_global_layers. The deprecated --kv-recent is the same option.
  for (const char* flag : {"--kv-exact-recent", "--kv-recent"}) {
    const auto w = run_cmd({test::kvq_bin(), "info", "-m", model, "--json", "-c", "1024", "--kv-sink", "4", flag, "128"});
    ASSERT_EQ(w.rc, 0) << w.err;
    bool seen = false;
    const auto wj = nlohmann::json::parse(w.out);
    EXPECT_EQ(wj["n_global_layers"].get<int>(), 6);
    EXPECT_EQ(wj["n_window_layers"].get<int>(), 0);
    for (const auto& r : wj["kv_types"])
      if (r["type"] == "q4") {
        seen = true;
        // + K's per-channel μ and λ (f32, per layer, kv head and channel: on by default for per-token K)
        // and the staging rows of its 256 calibration positions (4 bytes an element, K and V, per layer
        // and kv head) with their references (f32 per channel, K and V, per layer and kv head)
        const int64_t total = (int64_t)2 * 6 * 2 * (892 * (32 + 4) + 132 * 128) + (int64_t)2 * 6 * 2 * 64 * 4 +
                              (int64_t)2 * 6 * 2 * 256 * 64 * 4 + (int64_t)2 * 6 * 2 * 64 * 4;
        EXPECT_EQ(r["bytes_at_n_ctx"].get<int64_t>(), total) << flag << " " << r.dump();
        EXPECT_EQ(r["bytes_global_layers"].get<int64_t>(), total) << r.dump();
        EXPECT_EQ(r["bytes_window_layers"].get<int64_t>(), 0) << r.dump();
        EXPECT_DOUBLE_EQ(r["bytes_per_token"].get<double>(), 2.0 * 6 * 2 * (32 + 4));
      }
    EXPECT_TRUE(seen) << flag;
  }
}

// kvq bench --types takes K/V pairs and per-entry exact windows (the README's recommended
// `-ctk kivi4 -ctv q4a --kv-sink 4` beside plain formats in one run, issue 14 point 5); a plain
// per-token entry gets the auto windows (sink 4, recent 32), +sink0+recent0 the body alone.
TEST(CliOptions, BenchTypesTakeKvPairsAndSink) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  const int depth = 32;
  const auto r = run_cmd({test::kvq_bin(), "bench", "-m", model, "--types",
                          "f16,kivi4/q4a+sink4,q4+sink0+recent0,q4+sink4+recent0,q4,q4+recent8", "--depths",
                          std::to_string(depth), "-n", "1", "-p", "0", "-t", "1", "--no-progress", "--json",
                          "--kv-channel-calib", "8"});  // (at 256 a depth of 32 stays in the exact staging rows)
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto rows = nlohmann::json::parse(r.out)["rows"];
  ASSERT_EQ(rows.size(), 6u) << r.out;
  EXPECT_EQ(rows[1]["type_k"], "kivi4");
  EXPECT_EQ(rows[1]["type_v"], "q4a");
  EXPECT_EQ(rows[1]["sink"], 4);
  EXPECT_EQ(rows[1]["exact_recent"], 0);  // KIVI: no auto windows (its residual is its recent window)
  EXPECT_EQ(rows[2]["type_k"], "q4");
  EXPECT_EQ(rows[2]["type_v"], "q4");
  EXPECT_EQ(rows[2]["sink"], 0);
  EXPECT_EQ(rows[2]["exact_recent"], 0);
  EXPECT_EQ(rows[3]["sink"], 4);
  EXPECT_EQ(rows[3]["exact_recent"], 0);
  EXPECT_EQ(rows[4]["sink"], 4);            // auto
  EXPECT_EQ(rows[4]["exact_recent"], 32);   // auto
  EXPECT_EQ(rows[5]["sink"], 4);            // auto sink, explicit recent
  EXPECT_EQ(rows[5]["exact_recent"], 8);
  // The sink reaches the cache: at depth 32 its 4 first rows are f16 (64 x 2 bytes) instead of q4
  // (32 code bytes + 2 f16 group scales), for K and V, 6 layers x 2 kv heads (tinylit).
  const int64_t sink_extra = (int64_t)2 * 6 * 2 * 4 * (128 - (32 + 4));
  EXPECT_EQ(rows[3]["kv_bytes_used"].get<int64_t>() - rows[2]["kv_bytes_used"].get<int64_t>(), sink_extra)
      << rows[2].dump() << "\n" << rows[3].dump();
  // The text table names each entry by its windows.
  const auto t = run_cmd({test::kvq_bin(), "bench", "-m", model, "--types", "kivi4/q4a+sink4,q4", "--depths", "0",
                          "-n", "1", "-p", "0", "-t", "1", "--no-progress"});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("| kivi4/q4a+sink4 "), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("| q4+sink4+recent32 "), std::string::npos) << t.out;
  for (const std::string bad : {"q4+sinkx", "q4+sink", "q4+rot4", "q4+sink-1", "q4/q4/q4", "q4/zz", "q4+recent",
                                "q4+sink4+", "q4+recent-2"}) {
    const auto b = run_cmd({test::kvq_bin(), "bench", "-m", model, "--types", bad, "--depths", "0", "-n", "1", "-p",
                            "0", "--no-progress"});
    EXPECT_EQ(b.rc, 2) << bad;
    EXPECT_NE(b.err.find("[bench] KV format '" + bad + "'"), std::string::npos) << b.err;
  }
}

// --kv-sink / --kv-exact-recent default to auto (kv_auto_windows): kvq info's bytes at n_ctx of each
// type equal those of the explicit windows the rule names (4 / 32 for per-token types, 0 / 0 for the
// rest), and `--kv-sink 0 --kv-exact-recent 0` gives the body alone; a bad value is refused.
TEST(CliOptions, KvWindowsDefaultToAuto) {
  KVQ_REQUIRE_DATA(model, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  auto info = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {test::kvq_bin(), "info", "-m", model, "--json", "-c", "1024"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run_cmd(argv);
    EXPECT_EQ(r.rc, 0) << r.err;
    std::map<std::string, int64_t> bytes;
    const auto j = nlohmann::json::parse(r.out);
    for (const auto& row : j["kv_types"])  // certified refuses explicit windows
      if (row.contains("bytes_at_n_ctx")) bytes[row["type"].get<std::string>()] = row["bytes_at_n_ctx"].get<int64_t>();
    return bytes;
  };
  const auto dflt = info({}), on = info({"--kv-sink", "4", "--kv-exact-recent", "32"}),
             off = info({"--kv-sink", "0", "--kv-exact-recent", "0"});
  for (const char* t : {"q8", "q4", "q3", "q2", "q8a", "q4a", "q3a", "q2a", "q4nl", "q3nl", "q2nl"}) {
    EXPECT_EQ(dflt.at(t), on.at(t)) << t;
    EXPECT_GT(dflt.at(t), off.at(t)) << t;
  }
  for (const char* t : {"f16", "kivi4", "kivi2"}) EXPECT_EQ(dflt.at(t), off.at(t)) << t;
  for (const char* bad : {"x", "-1", "4.5", ""}) {
    const auto b = run_cmd({test::kvq_bin(), "info", "-m", model, "--kv-sink", bad});
    EXPECT_EQ(b.rc, 2) << bad;
    EXPECT_NE(b.err.find("--kv-sink '" + std::string(bad) + "' must be auto or a number"), std::string::npos) << b.err;
  }
}

}  // namespace
}  // namespace kvq
