// Weight-type traits: every row's reference dequantizer bit-exact against the gguf Python package
// (gguf.quants.dequantize, run by tests/core/gguf_dequant_ref.py) on random blocks and on every
// tensor of the real model files; block sizes against the GGUF type table.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "core/weight_types/act_quant_simd.h"
#include "core/weight_types/traits.h"
#include "kvq/f16.h"
#include "kvq/gguf.h"
#include "core/random_blocks.h"
#include "support/run_cmd.h"

namespace kvq {
namespace {

const ggml_type k_quant_types[] = {ggml_type::q4_0, ggml_type::q4_1, ggml_type::q5_0, ggml_type::q5_1,
                                   ggml_type::q8_0, ggml_type::iq4_nl, ggml_type::q2_k, ggml_type::q3_k,
                                   ggml_type::q4_k, ggml_type::q5_k, ggml_type::q6_k, ggml_type::iq4_xs};

// python3 from KVQ_PYTHON or PATH; "" when there is none.
std::string python() {
  if (const char* p = std::getenv("KVQ_PYTHON"); p && *p) return p;
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/bin");
  for (std::string dir; std::getline(ss, dir, ':');)
    if (!dir.empty() && ::access((dir + "/python3").c_str(), X_OK) == 0) return dir + "/python3";
  return "";
}

std::string script() { return std::string(KVQ_SOURCE_DIR) + "/tests/core/gguf_dequant_ref.py"; }

// Runs the reference script; skips the test (message from the script) when numpy / gguf are absent.
#define KVQ_RUN_REF(result, ...)                                                                  \
  const std::string py_ = python();                                                             \
  if (py_.empty()) GTEST_SKIP() << "python3 not found (set KVQ_PYTHON); needs numpy and gguf";  \
  const test::cmd_result result = test::run_cmd({py_, script(), __VA_ARGS__});                  \
  if (result.rc == 77) GTEST_SKIP() << result.err;                                              \
  ASSERT_EQ(result.rc, 0) << result.err

std::string tmp_path(const std::string& tag) {
  return (std::filesystem::temp_directory_path() /
          ("kvq_wt_" + std::to_string(::getpid()) + "_" + tag))
      .string();
}

uint64_t hash_values(const float* v, int64_t n, uint64_t start) {
  uint64_t h = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], 4);
    h += (uint64_t)bits * (2 * (start + (uint64_t)i) + 1);
  }
  return h;
}

TEST(weight_types, traits_match_gguf_table) {
  for (ggml_type t : k_quant_types) {
    const weight_type_traits* tr = find_weight_traits(t);
    ASSERT_NE(tr, nullptr) << ggml_type_name(t);
    EXPECT_EQ(tr->type, t);
    EXPECT_EQ(tr->blk, ggml_storage_block_elems(t)) << ggml_type_name(t);
    EXPECT_EQ(tr->bytes, ggml_storage_block_bytes(t)) << ggml_type_name(t);
    EXPECT_EQ(ggml_block_elems(t), tr->blk);
    EXPECT_NE(tr->vec_dot[(int)isa::scalar], nullptr);
    EXPECT_EQ(tr->blk % act_block_elems(tr->vec_dot_type), 0) << ggml_type_name(t);
    for (int i = 0; i < (int)isa::count; ++i) EXPECT_NE(tr->rows[i], nullptr);
  }
  for (ggml_type t : {ggml_type::iq2_xxs, ggml_type::q8_k, ggml_type::tq1_0, (ggml_type)4, (ggml_type)1000})
    EXPECT_EQ(find_weight_traits(t), nullptr) << (unsigned)t;
}

TEST(weight_types, random_blocks_bit_exact_with_gguf_py) {
  std::vector<ggml_type> types(std::begin(k_quant_types), std::end(k_quant_types));
  types.insert(types.end(), {ggml_type::f16, ggml_type::bf16, ggml_type::f32});
  for (ggml_type t : types) {
    const weight_type_traits* tr = find_weight_traits(t);
    const int n_blocks = tr->blk == 1 ? 4096 : 96;
    std::vector<uint8_t> b = test::random_blocks(t, n_blocks, 17 + (uint32_t)t);
    if (tr->blk == 1)  // f32 / f16 / bf16: no NaN patterns (exponent all ones -> top bit of mantissa cleared)
      for (size_t i = 0; i + tr->bytes <= b.size(); i += tr->bytes) b[i + tr->bytes - 1] &= 0xBF;
    const std::string in = tmp_path("in"), out = tmp_path("out");
    std::ofstream(in, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), (std::streamsize)b.size());
    KVQ_RUN_REF(r, "blocks", ggml_type_name(t), in, out);
    std::ifstream f(out, std::ios::binary);
    std::vector<float> ref((size_t)(n_blocks * tr->blk));
    f.read(reinterpret_cast<char*>(ref.data()), (std::streamsize)(ref.size() * 4));
    ASSERT_EQ(f.gcount(), (std::streamsize)(ref.size() * 4)) << ggml_type_name(t);
    std::filesystem::remove(in);
    std::filesystem::remove(out);
    std::vector<float> got(ref.size());
    tr->to_float(b.data(), got.data(), (int64_t)got.size());
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &ref[i], 4) != 0 && ++bad <= 3)
        ADD_FAILURE() << ggml_type_name(t) << " element " << i << " (block " << i / tr->blk << "): kvq "
                      << got[i] << " gguf-py " << ref[i];
    EXPECT_EQ(bad, 0) << ggml_type_name(t);
  }
}

std::string model_dir() {
  if (const char* d = std::getenv("KVQ_MODEL_DIR"); d && *d) return d;
  return std::string(KVQ_SOURCE_DIR) + "/models";
}

// Every tensor of a real file: the hash of kvq's to_float values equals gguf-py's.
void check_model(const std::string& file) {
  const std::string path = model_dir() + "/" + file;
  if (!std::filesystem::exists(path))
    GTEST_SKIP() << "model '" << path << "' not found (scripts/fetch-models.sh; or set KVQ_MODEL_DIR)";
  const std::string out = tmp_path("model.txt");
  KVQ_RUN_REF(r, "model", path, out);
  std::map<std::string, std::pair<std::string, uint64_t>> ref;  // name -> (type, hash)
  {
    std::ifstream f(out);
    std::string name, type;
    int64_t n;
    uint64_t h;
    while (f >> name >> type >> n >> h) ref[name] = {type, h};
  }
  std::filesystem::remove(out);
  auto g = gguf_file::open(path);
  ASSERT_EQ(ref.size(), g->tensors().size());
  std::map<std::string, int> per_type;
  std::vector<float> buf;
  for (const gguf_tensor_info& t : g->tensors()) {
    const weight_type_traits* tr = find_weight_traits(t.type);
    ASSERT_NE(tr, nullptr) << t.name << " " << ggml_type_name(t.type);
    ASSERT_TRUE(ref.count(t.name)) << t.name;
    EXPECT_EQ(ref[t.name].first, ggml_type_name(t.type)) << t.name;
    const int64_t n = t.n_elements(), chunk = tr->blk * 4096;
    uint64_t h = 0;
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t m = std::min(chunk, n - i);
      buf.resize((size_t)m);
      tr->to_float(t.data + i / tr->blk * tr->bytes, buf.data(), m);
      h += hash_values(buf.data(), m, (uint64_t)i);
    }
    EXPECT_EQ(h, ref[t.name].second) << t.name << " (" << ggml_type_name(t.type) << ")";
    ++per_type[ggml_type_name(t.type)];
  }
  for (const auto& [type, count] : per_type) std::printf("  %s: %d tensors bit-exact\n", type.c_str(), count);
}

TEST(weight_types, qwen2_5_every_tensor_bit_exact_with_gguf_py) {
  check_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

TEST(weight_types, gemma3_every_tensor_bit_exact_with_gguf_py) { check_model("gemma-3-270m-q4_k_m.gguf"); }

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// Every tier's dot equals the scalar reference bit for bit (each tier computes a super-block's or
// block's integer sums exactly and scales them as the reference does), on odd block counts.
TEST(weight_types, dot_tiers_bit_exact_with_reference) {
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (ggml_type t : k_quant_types) {
    const weight_type_traits* tr = find_weight_traits(t);
    for (int64_t nb : {1, 3, 7}) {
      const int64_t n = nb * tr->blk;
      const std::vector<uint8_t> w = test::random_blocks(t, nb, (uint32_t)(n + (int)t));
      std::vector<float> x((size_t)n);
      for (auto& v : x) v = g(rng);
      x[0] = 40.0f;  // one outlier per row
      std::vector<uint8_t> xq((size_t)(n / act_block_elems(tr->vec_dot_type) * act_block_bytes(tr->vec_dot_type)));
      quantize_act(tr->vec_dot_type, x.data(), n, xq.data());
      const float ref = tr->vec_dot[(int)isa::scalar](n, w.data(), xq.data());
      ASSERT_TRUE(std::isfinite(ref)) << ggml_type_name(t);
      for (int tier = 1; tier <= (int)best_isa(); ++tier) {
        const float got = tr->vec_dot[tier](n, w.data(), xq.data());
        EXPECT_EQ(std::memcmp(&got, &ref, 4), 0) << ggml_type_name(t) << " " << isa_name((isa)tier) << " blocks "
                                                 << nb << ": " << got << " vs reference " << ref;
      }
    }
  }
}

// The AVX2 activation quantizer writes quantize_act's bytes: q8_0 and q8_k blocks of Gaussian values
// with outliers, an all-zero block (scale 0), values at exact .5 quantization steps (ties to even),
// and a block whose maximum is negative.
TEST(weight_types, act_quant_avx2_bit_exact_with_scalar) {
  if (best_isa() < isa::avx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int64_t n = 5 * qk_k;
  std::vector<float> x((size_t)n);
  for (auto& v : x) v = g(rng);
  for (int64_t i = 0; i < 64; ++i) x[(size_t)i] = 0.0f;  // q8_0 blocks 0-1 and half a q8_k block
  for (int64_t i = 256; i < 512; ++i) x[(size_t)i] = 0.0f;  // q8_k block 1
  for (int64_t i = 512; i < 768; ++i) x[(size_t)i] = (float)(i % 254 - 127) + 0.5f;  // x * 127 / amax: ties
  x[512] = 127.0f;
  for (int64_t i = 768; i < 1024; ++i) x[(size_t)i] = -std::fabs(x[(size_t)i]) * 30.0f;
  x[1100] = 3e4f;
  for (act_type t : {act_type::q8_0, act_type::q8_1, act_type::q8_k}) {
    const size_t bytes = (size_t)(n / act_block_elems(t) * act_block_bytes(t));
    std::vector<uint8_t> ref(bytes), got(bytes, 0xAB);
    quantize_act(t, x.data(), n, ref.data());
    quantize_act_avx2(t, x.data(), n, got.data());
    EXPECT_EQ(std::memcmp(ref.data(), got.data(), bytes), 0) << "act_type " << (int)t;
  }
}

}  // namespace
}  // namespace kvq
