// Test helpers: locate the shared data (KVQ_DATA_DIR, default ../shared) and skip cleanly.
#pragma once
#include <gtest/gtest.h>

#include <string>

namespace kvq::test {

// Directory holding models/, data/, golden/ (KVQ_DATA_DIR or ../shared relative to the source tree).
std::string data_dir();
// Full path of `rel` under data_dir(), or "" when it does not exist.
std::string data_path(const std::string& rel);
// Path of the built kvq CLI binary.
std::string kvq_bin();

}  // namespace kvq::test

// Skips the current test with a clear message when the shared file is absent.
#define KVQ_REQUIRE_DATA(var, rel)                                                             \
  std::string var = ::kvq::test::data_path(rel);                                               \
  if (var.empty()) GTEST_SKIP() << "shared data '" << (rel) << "' not found under "            \
                                << ::kvq::test::data_dir() << " (set KVQ_DATA_DIR)"
