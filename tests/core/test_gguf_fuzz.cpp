// Robustness: truncations and byte flips of real GGUF files must either parse or raise kvq::error
// ("[gguf] ..."), never crash or throw anything else. Run under -DKVQ_SANITIZE=ON to catch
// out-of-bounds reads that happen not to crash.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "kvq/error.h"
#include "core/matmul_kernels.h"
#include "core/weight_types/traits.h"
#include "kvq/gguf.h"
#include "kvq/matmul.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

struct outcome {
  int ok = 0, err = 0;
};

// Opens `p`; records OK / kvq::error; any other exception fails the test.
void try_open(const std::string& p, outcome& o, const std::string& what) {
  try {
    auto f = gguf_file::open(p);
    // Touch everything the reader exposes: a bad pointer would show up here (or under ASan).
    uint64_t sum = 0;
    for (const auto& t : f->tensors())
      if (t.n_bytes) sum += t.data[0] + t.data[t.n_bytes - 1];
    for (const auto& [k, v] : f->metadata()) sum += k.size() + v.arr_str.size() + v.arr_n;
    (void)sum;
    ++o.ok;
  } catch (const error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[gguf] ", 0), 0u) << what << ": " << e.what();
    ++o.err;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": non-kvq exception: " << e.what();
  }
}

// Size of the header + metadata + tensor-info region: where the first tensor's data starts.
size_t header_region(const std::string& p, size_t file_size) {
  auto f = gguf_file::open(p);
  if (f->tensors().empty()) return file_size;
  const gguf_tensor_info& t = f->tensors().front();
  // data start = file end - (last offset + bytes) is not exact with padding; use pointer math.
  const gguf_tensor_info& last = f->tensors().back();
  const uint8_t* data_start = t.data - t.offset;
  const uint8_t* file_end_guess = last.data + last.n_bytes;
  return file_size - (size_t)(file_end_guess - data_start);
}

class fuzz_file {
 public:
  explicit fuzz_file(const std::string& tag)
      : path_((std::filesystem::temp_directory_path() /
               ("kvq_fuzz_" + std::to_string(::getpid()) + "_" + tag + ".gguf"))
                  .string()) {}
  ~fuzz_file() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }
  void write(const uint8_t* b, size_t n) const {
    std::ofstream f(path_, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b), (std::streamsize)n);
  }

 private:
  std::string path_;
};

void fuzz_truncations(const std::string& src, int every_after, outcome& o) {
  const std::vector<uint8_t> b = read_all(src);
  const size_t hdr = header_region(src, b.size());
  fuzz_file tmp("trunc");
  std::vector<size_t> lens;
  for (size_t n = 0; n < std::min<size_t>(hdr, 1024); ++n) lens.push_back(n);  // every length
  for (size_t n = 1024; n < hdr + 64; n += every_after) lens.push_back(n);     // then strided
  if (hdr < b.size())
    for (int i = 1; i <= 40; ++i) lens.push_back(hdr + (b.size() - hdr) * i / 41);  // data region
  lens.push_back(b.size() - 1);
  // Shrink one copy step by step (longest first): rewriting with O_TRUNC is slow on ext4.
  std::sort(lens.rbegin(), lens.rend());
  lens.erase(std::unique(lens.begin(), lens.end()), lens.end());
  tmp.write(b.data(), b.size());
  for (size_t n : lens) {
    if (n >= b.size()) continue;
    ASSERT_EQ(::truncate(tmp.path().c_str(), (off_t)n), 0);
    outcome one;
    try_open(tmp.path(), one, src + " truncated to " + std::to_string(n));
    o.ok += one.ok;
    o.err += one.err;
    // A truncated file must fail: it cuts the metadata or the last tensor's data.
    EXPECT_EQ(one.ok, 0) << src << " truncated to " << n << " bytes parsed OK";
  }
}

void fuzz_flips(const std::string& src, int n_flips, uint32_t seed, outcome& o) {
  std::vector<uint8_t> b = read_all(src);
  const size_t hdr = header_region(src, b.size());
  fuzz_file tmp("flip");
  tmp.write(b.data(), b.size());
  const int fd = ::open(tmp.path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  std::mt19937 rng(seed);
  for (int i = 0; i < n_flips; ++i) {
    // Mostly single bytes; sometimes a run of 8 (a whole u64 count/offset/length).
    const size_t at = rng() % hdr;
    const size_t len = (i % 4 == 3) ? std::min<size_t>(8, hdr - at) : 1;
    std::vector<uint8_t> mod(b.begin() + at, b.begin() + at + len);
    for (uint8_t& x : mod) {
      const uint32_t kind = rng() % 3;
      x = kind == 0 ? (uint8_t)(x ^ (1u << (rng() % 8))) : kind == 1 ? (uint8_t)0xff : (uint8_t)rng();
    }
    ASSERT_EQ(::pwrite(fd, mod.data(), len, (off_t)at), (ssize_t)len);
    try_open(tmp.path(), o, src + " flip #" + std::to_string(i) + " at " + std::to_string(at));
    ASSERT_EQ(::pwrite(fd, b.data() + at, len, (off_t)at), (ssize_t)len);  // restore
  }
  ::close(fd);
}

TEST(gguf_fuzz, stories260k_truncations) {
  KVQ_REQUIRE_DATA(path, "models/stories260K/stories260K.gguf");
  outcome o;
  fuzz_truncations(path, 7, o);
  std::printf("stories260K truncations: %d parsed, %d rejected\n", o.ok, o.err);
  EXPECT_GT(o.err, 2000);
}

TEST(gguf_fuzz, stories260k_byte_flips) {
  KVQ_REQUIRE_DATA(path, "models/stories260K/stories260K.gguf");
  outcome o;
  fuzz_flips(path, 600, 12345, o);
  std::printf("stories260K byte flips: %d parsed, %d rejected\n", o.ok, o.err);
  EXPECT_EQ(o.ok + o.err, 600);
  EXPECT_GT(o.err, 0);
}

TEST(gguf_fuzz, vocab_file_flips_and_truncations) {
  KVQ_REQUIRE_DATA(path, "golden/tokenizers/ggml-vocab-llama-spm.gguf");
  outcome o;
  fuzz_flips(path, 150, 777, o);
  outcome t;
  fuzz_truncations(path, 3001, t);
  std::printf("llama-spm vocab: flips %d parsed / %d rejected; truncations %d parsed / %d rejected\n",
              o.ok, o.err, t.ok, t.err);
  EXPECT_EQ(o.ok + o.err, 150);
  EXPECT_EQ(t.ok, 0);  // no tensors: every truncation cuts a string or array
}

// The block decoders on arbitrary bytes (f16 scales that are NaN / Inf / subnormal included): every
// to_float and every tier's dot reads exactly its row (ASan builds check) and, when the row's f16
// fields are finite, returns finite values.
TEST(gguf_fuzz, weight_block_decoders_random_bytes) {
  std::mt19937 rng(4242);
  for (uint32_t id = 0; id < 40; ++id) {
    const weight_type_traits* tr = find_weight_traits((ggml_type)id);
    if (tr == nullptr || tr->vec_dot_type == act_type::f32) continue;
    const int64_t n = 2 * tr->blk;  // two blocks per row
    const act_type at = tr->vec_dot_type;
    std::vector<float> x((size_t)n), y((size_t)n);
    for (auto& v : x) v = std::ldexp((float)((int)(rng() % 2001) - 1000), -10);
    std::vector<uint8_t> xq((size_t)(n / act_block_elems(at) * act_block_bytes(at)));
    quantize_act(at, x.data(), n, xq.data());
    for (int trial = 0; trial < 200; ++trial) {
      // Heap copy of exactly one row, so an overrun is an ASan error.
      std::vector<uint8_t> row((size_t)(2 * tr->bytes));
      for (auto& b : row) b = (uint8_t)rng();
      tr->to_float(row.data(), y.data(), n);
      bool finite_in = true;
      for (float v : y) finite_in = finite_in && std::isfinite(v);
      for (int t = 0; t < (int)isa::count; ++t) {
        if (t > (int)best_isa()) break;
        const float d = tr->vec_dot[t](n, row.data(), xq.data());
        if (finite_in) {
          EXPECT_TRUE(std::isfinite(d)) << ggml_type_name(tr->type) << " tier " << t;
        }
      }
    }
  }
}

// make_weight_view on random tensor descriptions: a view whose rows cover exactly the bytes, or a
// kvq::error starting with "[matmul]"; never anything else.
TEST(gguf_fuzz, make_weight_view_random_descriptions) {
  std::mt19937 rng(99);
  std::vector<uint8_t> buf(1 << 16);
  int ok = 0, err = 0;
  for (int i = 0; i < 20000; ++i) {
    gguf_tensor_info t;
    t.name = "fuzz";
    t.type = (ggml_type)(rng() % 45);
    const int n_dims = (int)(rng() % 4);
    for (int d = 0; d < n_dims; ++d) t.ne.push_back((int64_t)(rng() % 4 == 0 ? rng() % 600 : 256 * (rng() % 3)) - (rng() % 50 == 0));
    const int64_t blk = ggml_storage_block_elems(t.type);
    uint64_t nb = 0;
    if (blk > 0 && !t.ne.empty()) {
      nb = (uint64_t)ggml_storage_block_bytes(t.type);
      for (int64_t d : t.ne) nb *= (uint64_t)std::max<int64_t>(d, 0);
      nb /= (uint64_t)blk;
    }
    t.n_bytes = rng() % 3 == 0 ? rng() % 4096 : std::min<uint64_t>(nb, buf.size());
    t.data = rng() % 20 == 0 ? nullptr : buf.data();
    try {
      const weight_view w = make_weight_view(t);
      EXPECT_EQ((uint64_t)w.row_bytes * (uint64_t)w.n_out, t.n_bytes);
      EXPECT_EQ(w.n_in % ggml_block_elems(w.type), 0);
      EXPECT_NE(w.data, nullptr);
      ++ok;
    } catch (const error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("[matmul] ", 0), 0u) << e.what();
      ++err;
    }
  }
  std::printf("make_weight_view: %d views, %d rejected\n", ok, err);
  EXPECT_GT(ok, 100);
  EXPECT_GT(err, 100);
}

}  // namespace
}  // namespace kvq
