// kvq generate / perplexity --device: cpu is the default engine; cuda without CUDA or a GPU is a
// clear "not supported" error (exit 2, nothing on stdout), as is a device name kvq does not know.
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
        std::vector<std::string>{"perplexity", "-m", model, "-f", text, "-c", "64", "--chunks", "1"}}) {
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
