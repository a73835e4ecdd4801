#include "support/data_dir.h"

#include <cstdlib>
#include <filesystem>

namespace kvq::test {

std::string data_dir() {
  if (const char* env = std::getenv("KVQ_DATA_DIR"); env && *env) return env;
  return std::string(KVQ_SOURCE_DIR) + "/../shared";
}

std::string data_path(const std::string& rel) {
  const std::string p = data_dir() + "/" + rel;
  return std::filesystem::exists(p) ? p : std::string();
}

std::string model_dir() {
  if (const char* env = std::getenv("KVQ_MODEL_DIR"); env && *env) return env;
  return std::string(KVQ_SOURCE_DIR) + "/models";
}

std::string kvq_bin() {
  if (const char* env = std::getenv("KVQ_BIN"); env && *env) return env;
  return std::string(KVQ_BINARY_DIR) + "/kvq";
}

}  // namespace kvq::test
