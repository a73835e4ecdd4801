// kvq generate / perplexity / eval-passkey / bench --device: cpu is the default engine; cuda without CUDA or
// a GPU is a clear "not supported" error (exit 2, nothing on stdout), as is a device name kvq does
// not know and a cache option the GPU does not run (in every build: checked on the host).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvq/cuda.h"
#include "support/data_dir.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

constexpr const char* kTinylit = "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf";

TEST(CliDevice, CudaWithoutGpuIsNotSupported) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is visible: " << cuda::device_name();
  KVQ_REQUIRE_DATA(model, kTinylit);
  KVQ_REQUIRE_DATA(text, "data/tinylit-hd64-gqa4-heldout/heldout.txt");
  for (const auto& args :
       {std::vector<std::string>{"generate", "-m", model, "-p", "Once", "-n", "4"},
        std::vector<std::string>{"perplexity", "-m", model, "-f", text, "-c", "64", "--chunks", "1"},
        std::vector<std::string>{"eval-passkey", "-m", model, "-f", text, "--lengths", "320", "--depths", "50",
                                 "--trials", "1", "--json"},
        std::vector<std::string>{"bench", "--shape", "qwen2.5-0.5b", "--shape-layers", "1"}}) {
    std::vector<std::string> argv{test::kvq_bin()};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--device", "cuda"});
    const test::cmd_result r = test::run_cmd(argv);
    EXPECT_EQ(r.rc, 2) << args[0] << ": " << r.err;
    EXPECT_TRUE(r.err.find("[cuda] not supported: kvq was built without KVQ_BUILD_CUDA") != std::string::npos ||
                r.err.find("[cuda] no GPU visible") != std::string::npos)
        << args[0] << ": " << r.err;
    EXPECT_EQ(r.out, "") << args[0];
  }
}

// kvq server --device cuda without CUDA or a GPU: the same error and exit code as the other
// commands, before binding a port; --cuda-graphs without --device cuda is refused too.
TEST(CliDevice, ServerCudaWithoutGpuIsNotSupported) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is visible: " << cuda::device_name();
  KVQ_REQUIRE_DATA(model, kTinylit);
  const test::cmd_result r = test::run_cmd({test::kvq_bin(), "server", "-m", model, "--port", "0", "--device", "cuda"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_TRUE(r.err.find("[cuda] not supported: kvq was built without KVQ_BUILD_CUDA") != std::string::npos ||
              r.err.find("[cuda] no GPU visible") != std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("listening"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  const test::cmd_result g = test::run_cmd({test::kvq_bin(), "server", "-m", model, "--port", "0", "--cuda-graphs"});
  EXPECT_EQ(g.rc, 2) << g.err;
  EXPECT_NE(g.err.find("--cuda-graphs is an option of --device cuda"), std::string::npos) << g.err;
}

// kvq server --device cuda refuses at start-up, by name and whatever the build (check_supported
// runs on the host before the GPU is asked for), the formats the GPU does not run: KIVI but kivi4, exact
// recent windows, windows on an f16 cache, the V channel scale, certified attention.
TEST(CliDevice, ServerCudaRefusesCpuOnlyCaches) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  struct bad {
    std::vector<std::string> kv;
    std::string needle;
  };
  const std::vector<bad> cases = {
      {{"-ctk", "kivi2", "-ctv", "kivi2"}, "other KIVI types have no GPU kernels"},  // kivi4 / q4a, kivi4 run
      {{"-ctk", "q4", "-ctv", "q4", "--kv-exact-recent", "32"}, "exact recent windows (--kv-exact-recent 32) are not"},
      {{"--kv-sink", "4"}, "exact windows (--kv-sink 4, --kv-exact-recent 0) on an f16 cache"},
      {{"-ctk", "q4", "-ctv", "q4", "--kv-channel-scale"}, "the V channel scale (--kv-channel-scale)"},
      {{"-ctk", "q4", "-ctv", "q4", "--kv-certify"}, "certified attention is CPU only"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{test::kvq_bin(), "server", "-m", model, "--port", "0", "--device", "cuda"};
    argv.insert(argv.end(), c.kv.begin(), c.kv.end());
    const test::cmd_result r = test::run_cmd(argv);
    EXPECT_EQ(r.rc, 2) << c.needle << ": " << r.err;
    EXPECT_NE(r.err.find("[cuda model] "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << r.err;
    EXPECT_EQ(r.out, "") << c.needle;
  }
}

// eval-passkey --device cuda refuses, before any work and whatever the build, the cache options the
// GPU runner does not run (KIVI other than kivi4 / q4a, the other CPU-only types, mixed K / V types, a sink beyond the
// GPU's limit, exact recent windows, the V channel scale), naming the option, as generate and perplexity do
// (cuda::check_supported).
TEST(CliDevice, EvalPasskeyCudaRefusesCpuOnlyCaches) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  KVQ_REQUIRE_DATA(text, "data/tinylit-hd64-gqa4-heldout/heldout.txt");
  struct bad {
    std::vector<std::string> kv;
    std::string needle;
  };
  const std::vector<bad> cases = {
      {{"-ctk", "q3", "-ctv", "q3"}, "cache type 'q3' has no GPU kernels (supported: f16, q8, q4)"},
      {{"-ctk", "kivi4", "-ctv", "q4", "--kv-sink", "4"}, "the GPU's KIVI cache is -ctk kivi4 with -ctv q4a or kivi4"},
      {{"-ctk", "kivi4", "-ctv", "q4a", "--kv-kivi-group", "64"}, "--kv-kivi-group 64"},
      {{"-ctk", "q4", "-ctv", "q4", "--kv-sink", "2000"}, "--kv-sink 2000: the GPU keeps at most 1024"},
      {{"-ctk", "q8", "-ctv", "q8", "--kv-exact-recent", "128"}, "--kv-exact-recent 128) are not supported on the GPU"},
      {{"-ctk", "q4", "-ctv", "q4", "--kv-channel-scale"}, "--kv-channel-scale"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{test::kvq_bin(), "eval-passkey", "-m",       model,    "-f",   text, "--lengths",
                                  "320",          "--depths",     "50",       "--trials", "1",    "--json", "--device",
                                  "cuda"};
    argv.insert(argv.end(), c.kv.begin(), c.kv.end());
    const test::cmd_result r = test::run_cmd(argv);
    EXPECT_EQ(r.rc, 2) << c.needle << ": " << r.err;
    EXPECT_NE(r.err.find("[cuda model] " ), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << r.err;
    EXPECT_EQ(r.out, "") << c.needle;
  }
}

// --device cpu is eval-passkey's default engine: the same prompts (keys, needle positions) and the
// same greedy answers as without the flag, and "device": "cpu" in the JSON.
TEST(CliDevice, EvalPasskeyCpuDefault) {
  KVQ_REQUIRE_DATA(model, "models/stories260K/stories260K.gguf");
  KVQ_REQUIRE_DATA(text, "data/tinystories-val-794k/tinystories_val.txt");
  const std::vector<std::string> base{test::kvq_bin(), "eval-passkey", "-m",       model, "-f",  text,
                                      "--lengths",     "320,512",      "--depths", "0,50,100", "--trials", "1",
                                      "-t",            "1",            "-b",       "64",  "--json", "--no-progress",
                                      "-ctk",          "q8",           "-ctv",     "q4"};
  std::vector<std::string> with = base;
  with.insert(with.end(), {"--device", "cpu"});
  const test::cmd_result a = test::run_cmd(base), b = test::run_cmd(with);
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(b.rc, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja.at("device"), "cpu");
  EXPECT_EQ(jb.at("device"), "cpu");
  EXPECT_EQ(ja.at("kv_cache"), jb.at("kv_cache"));
  ASSERT_EQ(ja.at("trials").size(), 6u);
  ASSERT_EQ(jb.at("trials").size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    for (const char* k : {"length", "depth", "key", "needle_pos", "n_prompt", "answer", "correct"})
      EXPECT_EQ(ja["trials"][i][k], jb["trials"][i][k]) << "trial " << i << " " << k;
}

TEST(CliDevice, UnknownDeviceAndCpuDefault) {
  KVQ_REQUIRE_DATA(model, kTinylit);
  test::cmd_result r =
      test::run_cmd({test::kvq_bin(), "generate", "-m", model, "-p", "Once", "-n", "2", "--device", "tpu"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("[device] unknown device 'tpu' (supported: cpu, cuda)"), std::string::npos) << r.err;
  // --device cpu is the default engine: the same greedy ids as without the flag
  const std::vector<std::string> base{test::kvq_bin(), "generate", "-m",    model, "-p", "Once", "-n", "8",
                                      "--temp",        "0",        "--json"};
  std::vector<std::string> with = base;
  with.insert(with.end(), {"--device", "cpu"});
  const test::cmd_result a = test::run_cmd(base), b = test::run_cmd(with);
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(b.rc, 0) << b.err;
  const auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(ja.at("ids"), jb.at("ids"));
  EXPECT_EQ(jb.at("ids").size(), 8u);
  EXPECT_EQ(ja.at("kv_cache"), jb.at("kv_cache"));
}

}  // namespace
}  // namespace kvq
