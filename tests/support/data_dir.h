// Test helpers: locate the shared data (KVQ_DATA_DIR, default ../shared) and skip cleanly.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace kvq::test {

// Directory holding models/, data/, golden/ (KVQ_DATA_DIR or ../shared relative to the source tree).
std::string data_dir();
// Full path of `rel` under data_dir(), or "" when it does not exist.
std::string data_path(const std::string& rel);
// Directory of the real GGUF models fetched by scripts/fetch-models.sh (KVQ_MODEL_DIR, default
// <source dir>/models).
std::string model_dir();
// Path of the built kvq CLI binary.
std::string kvq_bin();

}  // namespace kvq::test

// Skips the current test with a clear message when the shared file is absent.
#define KVQ_REQUIRE_DATA(var, rel)                                                             \
  std::string var = ::kvq::test::data_path(rel);                                               \
  if (var.empty()) GTEST_SKIP() << "shared data '" << (rel) << "' not found under "            \
                                << ::kvq::test::data_dir() << " (set KVQ_DATA_DIR)"

// Skips the current test with a message naming the file when the real model `file` is absent from
// model_dir().
#define KVQ_REQUIRE_MODEL(var, file)                                                           \
  std::string var = ::kvq::test::model_dir() + "/" + (file);                                   \
  if (!std::filesystem::exists(var)) GTEST_SKIP() << "model '" << (file) << "' not found in "  \
                                                  << ::kvq::test::model_dir()                  \
                                                  << " (run scripts/fetch-models.sh or set KVQ_MODEL_DIR)"
