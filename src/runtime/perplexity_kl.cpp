#include "runtime/perplexity_kl.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "kvq/error.h"

namespace kvq::ppl_detail {

namespace {
constexpr char kMagic[8] = {'K', 'V', 'Q', 'K', 'L', 'D', '1', '\n'};
}

int log_softmax(const float* x, int n, float* out) {
  int arg = 0;
  float mx = x[0];
  for (int i = 1; i < n; ++i)
    if (x[i] > mx) { mx = x[i]; arg = i; }
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp((double)x[i] - mx);
  const double lse = std::log(sum);
  for (int i = 0; i < n; ++i) out[i] = (float)((double)x[i] - mx - lse);
  return arg;
}

uint64_t fnv1a64(std::span<const int32_t> ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    const uint32_t u = (uint32_t)id;
    for (int b = 0; b < 4; ++b) {
      h ^= (u >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)v);
  return buf;
}

size_t kl_codec::record_bytes() const {
  return top_k == 0 ? 4 + 4 * (size_t)n_vocab : 4 + 8 * (size_t)top_k + 4;
}

void kl_codec::encode(const float* logp, int obs, uint8_t* rec, std::vector<int>& scratch) const {
  const float lo = logp[obs];
  std::memcpy(rec, &lo, 4);
  if (top_k == 0) {
    std::memcpy(rec + 4, logp, 4 * (size_t)n_vocab);
    return;
  }
  scratch.resize(n_vocab);
  for (int i = 0; i < n_vocab; ++i) scratch[i] = i;
  auto desc = [&](int a, int b) { return logp[a] > logp[b] || (logp[a] == logp[b] && a < b); };
  std::partial_sort(scratch.begin(), scratch.begin() + top_k, scratch.end(), desc);
  double rest = 0;
  for (int i = top_k; i < n_vocab; ++i) rest += std::exp((double)logp[scratch[i]]);
  uint8_t* ids = rec + 4;
  uint8_t* lps = rec + 4 + 4 * (size_t)top_k;
  for (int i = 0; i < top_k; ++i) {
    const int32_t id = scratch[i];
    const float l = logp[id];
    std::memcpy(ids + 4 * i, &id, 4);
    std::memcpy(lps + 4 * i, &l, 4);
  }
  const float lr = rest > 0 ? (float)std::log(rest) : -std::numeric_limits<float>::infinity();
  std::memcpy(rec + 4 + 8 * (size_t)top_k, &lr, 4);
}

kl_token kl_from_record(const kl_codec& c, const uint8_t* rec, const float* lt) {
  kl_token r;
  float lo;
  std::memcpy(&lo, rec, 4);
  r.base_logp_obs = lo;
  double kl = 0;
  if (c.top_k == 0) {
    const uint8_t* lb = rec + 4;
    float best = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < c.n_vocab; ++i) {
      float b;
      std::memcpy(&b, lb + 4 * (size_t)i, 4);
      if (b > best) { best = b; r.base_argmax = i; }
      if (b > -std::numeric_limits<float>::infinity()) kl += std::exp((double)b) * ((double)b - lt[i]);
    }
  } else {
    double top_t = 0;
    for (int i = 0; i < c.top_k; ++i) {
      int32_t id;
      float b;
      std::memcpy(&id, rec + 4 + 4 * (size_t)i, 4);
      std::memcpy(&b, rec + 4 + 4 * (size_t)c.top_k + 4 * (size_t)i, 4);
      if (i == 0) r.base_argmax = id;
      if (id < 0 || id >= c.n_vocab) fail_input("[perplexity] KL base record holds token id " + std::to_string(id) +
                                                 " outside the vocabulary");
      kl += std::exp((double)b) * ((double)b - lt[id]);
      top_t += std::exp((double)lt[id]);
    }
    float lr;
    std::memcpy(&lr, rec + 4 + 8 * (size_t)c.top_k, 4);
    if (lr > -std::numeric_limits<float>::infinity()) {
      const double rest_t = std::max(1.0 - top_t, 1e-30);
      kl += std::exp((double)lr) * ((double)lr - std::log(rest_t));
    }
  }
  r.kld = kl;
  return r;
}

std::string kl_header_text(const nlohmann::json& header) {
  return header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

kl_file_writer::kl_file_writer(const std::string& path, const nlohmann::json& header)
    : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())) {
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) fail(errc::io, "[perplexity] cannot open '" + tmp_ + "' for writing the KL base file: " + std::strerror(errno));
  const std::string h = kl_header_text(header);
  const uint32_t n = (uint32_t)h.size();
  write(reinterpret_cast<const uint8_t*>(kMagic), 8);
  write(reinterpret_cast<const uint8_t*>(&n), 4);
  write(reinterpret_cast<const uint8_t*>(h.data()), h.size());
}

kl_file_writer::~kl_file_writer() {
  if (f_) {
    std::fclose(f_);
    std::remove(tmp_.c_str());
  }
}

void kl_file_writer::write(const uint8_t* data, size_t n) {
  if (std::fwrite(data, 1, n, f_) != n)
    fail(errc::io, "[perplexity] write to '" + tmp_ + "' failed (disk full?)");
  bytes_ += n;
}

void kl_file_writer::commit() {
  const bool ok = std::fflush(f_) == 0;
  std::fclose(f_);
  f_ = nullptr;
  if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::remove(tmp_.c_str());
    fail(errc::io, "[perplexity] cannot write the KL base file '" + path_ + "'");
  }
}

kl_file_reader::kl_file_reader(const std::string& path) : path_(path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail_input("[perplexity] KL base file '" + path + "' is a directory, not a file");
  f_ = std::fopen(path.c_str(), "rb");
  if (!f_) fail(errc::io, "[perplexity] cannot open the KL base file '" + path + "': " + std::strerror(errno));
  try {
    read_header();
  } catch (...) {
    std::fclose(f_);  // the destructor does not run when the constructor throws
    f_ = nullptr;
    throw;
  }
}

void kl_file_reader::read_header() {
  const std::string& path = path_;
  char magic[8];
  uint32_t n = 0;
  if (std::fread(magic, 1, 8, f_) != 8 || std::memcmp(magic, kMagic, 8) != 0)
    fail_input("[perplexity] '" + path + "' is not a kvq KL base file (bad magic; write one with --kl-base)");
  if (std::fread(&n, 4, 1, f_) != 1 || n == 0 || n > (1u << 20))
    fail_input("[perplexity] '" + path + "': bad header length " + std::to_string(n));
  std::string h(n, '\0');
  if (std::fread(h.data(), 1, n, f_) != n) fail_input("[perplexity] '" + path + "': truncated header");
  try {
    header_ = nlohmann::json::parse(h);
  } catch (const std::exception& e) {
    fail_input("[perplexity] '" + path + "': header is not valid JSON: " + e.what());
  }
  if (!header_.is_object() || header_.value("format", "") != "kvq-kld" || header_.value("version", 0) != 1)
    fail_input("[perplexity] '" + path + "': header format is not kvq-kld version 1");
}

kl_file_reader::~kl_file_reader() {
  if (f_) std::fclose(f_);
}

uint64_t kl_file_reader::remaining_bytes() {
  const long here = std::ftell(f_);
  std::fseek(f_, 0, SEEK_END);
  const long end = std::ftell(f_);
  std::fseek(f_, here, SEEK_SET);
  return here >= 0 && end >= here ? (uint64_t)(end - here) : 0;
}

void kl_file_reader::read(uint8_t* data, size_t n) {
  if (std::fread(data, 1, n, f_) != n) fail_input("[perplexity] '" + path_ + "': truncated records");
}

double quantile_sorted(const std::vector<float>& v, double q) {
  if (v.empty()) return 0;
  const double x = q * (double)(v.size() - 1);
  const size_t i = (size_t)x;
  if (i + 1 >= v.size()) return v.back();
  const double f = x - (double)i;
  return (1 - f) * v[i] + f * v[i + 1];
}

}  // namespace kvq::ppl_detail
