// Private pieces of kvq perplexity: per-token log-softmax, the KL base record codec and the
// base file reader/writer (format documented in include/kvq/perplexity.h).
#pragma once
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq::ppl_detail {

// Log-softmax of one row: out[n] = x - max - log(sum exp(x - max)), accumulated in double.
// Returns the argmax (first on ties).
int log_softmax(const float* x, int n, float* out);

// FNV-1a 64 over the little-endian bytes of the ids.
uint64_t fnv1a64(std::span<const int32_t> ids);
std::string hex64(uint64_t v);

// One base record per scored token (see perplexity.h). top_k == 0: full vocabulary.
struct kl_codec {
  int n_vocab = 0;
  int top_k = 0;
  size_t record_bytes() const;
  // logp[n_vocab]: log-softmax of the base; obs: observed next token. scratch: >= n_vocab ints.
  void encode(const float* logp, int obs, uint8_t* rec, std::vector<int>& scratch) const;
};

// KL(base || test) of one token from a base record and the test log-softmax logp_test[n_vocab].
struct kl_token {
  double kld = 0;
  int base_argmax = 0;
  double base_logp_obs = 0;
};
kl_token kl_from_record(const kl_codec& c, const uint8_t* rec, const float* logp_test);

// The header as a KL base file stores it (JSON text; bytes that are not valid UTF-8, e.g. in a
// GGUF model name, become U+FFFD).
std::string kl_header_text(const nlohmann::json& header);

// Streaming writer: records go to "<path>.tmp.<pid>"; commit() renames it over `path`. Destroying
// an uncommitted writer removes the temp file, so a failed run leaves nothing behind.
class kl_file_writer {
 public:
  kl_file_writer(const std::string& path, const nlohmann::json& header);
  ~kl_file_writer();
  void write(const uint8_t* data, size_t n);
  void commit();
  uint64_t bytes() const { return bytes_; }  // written so far: magic, header and records

 private:
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
  uint64_t bytes_ = 0;
};

// Reader: parses and checks the header and the file size up front.
class kl_file_reader {
 public:
  explicit kl_file_reader(const std::string& path);
  ~kl_file_reader();
  const nlohmann::json& header() const { return header_; }
  const std::string& path() const { return path_; }
  void read(uint8_t* data, size_t n);  // next n bytes of records
  uint64_t remaining_bytes();          // bytes after the current position

 private:
  void read_header();
  std::string path_;
  std::FILE* f_ = nullptr;
  nlohmann::json header_;
};

// Sorted-sample quantile with linear interpolation (q in [0, 1]); values must be sorted.
double quantile_sorted(const std::vector<float>& v, double q);

}  // namespace kvq::ppl_detail
