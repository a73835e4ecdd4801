// matmul tiers against matmul_ref (float64) with per-type error bounds, odd shapes, n_tokens
// {1, 3, 17}, both ISA tiers, 1 and 2 threads; weight_row_to_f32 and make_weight_view errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/matmul_kernels.h"
#include <fmt/format.h>

#include "core/random_blocks.h"
#include "core/weight_types/blocks_legacy.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "kvq/matmul.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

// A weight held in memory with a gguf_tensor_info pointing at it.
struct test_weight {
  std::vector<uint8_t> bytes;
  gguf_tensor_info info;
  weight_view view() { return make_weight_view(info); }
};

test_weight random_weight(ggml_type type, int64_t n_in, int64_t n_out, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  test_weight tw;
  const int64_t n = n_in * n_out;
  switch (type) {
    case ggml_type::f32:
      tw.bytes.resize(n * 4);
      for (int64_t i = 0; i < n; ++i) {
        const float v = g(rng);
        std::memcpy(&tw.bytes[i * 4], &v, 4);
      }
      break;
    case ggml_type::f16:
    case ggml_type::bf16:
      tw.bytes.resize(n * 2);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = type == ggml_type::f16 ? f32_to_f16(g(rng)) : f32_to_bf16(g(rng));
        std::memcpy(&tw.bytes[i * 2], &h, 2);
      }
      break;
    case ggml_type::q8_0:
    case ggml_type::q4_0: {
      // Random scales and every possible quant byte (q8_0 includes -128).
      const int64_t bb = ggml_block_bytes(type), nb = n / 32;
      tw.bytes.resize(nb * bb);
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t d = f32_to_f16(0.01f + 0.05f * std::fabs(g(rng)));
        std::memcpy(&tw.bytes[b * bb], &d, 2);
        for (int64_t j = 2; j < bb; ++j) tw.bytes[b * bb + j] = (uint8_t)rng();
      }
      break;
    }
    default:  // every other quantized type: random bytes, scales +-2^[-8, -4) (some subnormal)
      tw.bytes = test::random_blocks(type, n / ggml_block_elems(type), seed, -8, -4);
      break;
  }
  tw.info.name = "test.weight";
  tw.info.type = type;
  tw.info.ne = {n_in, n_out};
  tw.info.n_bytes = tw.bytes.size();
  tw.info.data = tw.bytes.data();
  return tw;
}

std::vector<float> random_x(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  if (n > 3) x[n / 2] = 0;  // exact zeros and a zero block scale path stay covered elsewhere
  return x;
}

// Rigorous per-output bound: f32 summation (n_in * 2^-23 * sum|w x|) plus, for quantized types,
// the activation quantization (|dx_i| <= amax(activation block)/254).
std::vector<double> error_bounds(const weight_view& w, const float* x, int64_t n_tokens) {
  std::vector<double> bound(n_tokens * w.n_out);
  std::vector<float> row(w.n_in);
  const act_type at = find_weight_traits(w.type)->vec_dot_type;
  const bool quant = at != act_type::f32;
  const int64_t ab = act_block_elems(at);
  for (int64_t r = 0; r < w.n_out; ++r) {
    weight_row_to_f32(w, r, row.data());
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * w.n_in;
      double sum_abs = 0, qerr = 0;
      for (int64_t i = 0; i < w.n_in; ++i) sum_abs += std::fabs((double)row[i] * xt[i]);
      if (quant)
        for (int64_t b = 0; b < w.n_in / ab; ++b) {
          double amax = 0, wsum = 0;
          for (int64_t i = 0; i < ab; ++i) {
            amax = std::max(amax, (double)std::fabs(xt[b * ab + i]));
            wsum += std::fabs(row[b * ab + i]);
          }
          qerr += wsum * amax / 254.0;
        }
      bound[t * w.n_out + r] = (double)(w.n_in + 4) * 1.2e-7 * sum_abs + 1.001 * qerr + 1e-30;
    }
  }
  return bound;
}

std::vector<isa> tiers() {
  std::vector<isa> t{isa::scalar};
  if (best_isa() >= isa::avx2) t.push_back(isa::avx2);
  if (best_isa() >= isa::avx512) t.push_back(isa::avx512);
  return t;
}

void check_matmul(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_tokens, thread_pool& pool,
                  uint32_t seed) {
  test_weight tw = random_weight(type, n_in, n_out, seed);
  const weight_view w = tw.view();
  const std::vector<float> x = random_x(n_in * n_tokens, seed + 1);
  std::vector<float> ref(n_tokens * n_out);
  matmul_ref(w, x.data(), n_tokens, ref.data());
  const std::vector<double> bound = error_bounds(w, x.data(), n_tokens);
  std::vector<std::vector<float>> per_tier;
  for (isa tier : tiers()) {
    std::vector<float> y(n_tokens * n_out, NAN);
    detail::matmul_with_isa(tier, w, x.data(), n_tokens, y.data(), pool);
    int bad = 0;
    for (int64_t i = 0; i < n_tokens * n_out; ++i)
      if (!(std::fabs((double)y[i] - ref[i]) <= bound[i]) && ++bad <= 3)
        ADD_FAILURE() << ggml_type_name(type) << " " << isa_name(tier) << " n_in " << n_in << " n_out "
                      << n_out << " n_tokens " << n_tokens << " threads " << pool.size() << " [t "
                      << i / n_out << ", r " << i % n_out << "]: got " << y[i] << " ref " << ref[i]
                      << " bound " << bound[i];
    EXPECT_EQ(bad, 0);
    per_tier.push_back(std::move(y));
  }
  // The public entry point runs the best tier: identical to that tier's result.
  std::vector<float> y(n_tokens * n_out);
  matmul(w, x.data(), n_tokens, y.data(), pool);
  EXPECT_EQ(y, per_tier.back());
}

struct shape {
  int64_t n_in, n_out;
};

TEST(matmul, float_types_odd_shapes) {
  thread_pool pool1(1), pool2(2);
  uint32_t seed = 1;
  for (ggml_type type : {ggml_type::f32, ggml_type::f16, ggml_type::bf16})
    for (shape s : {shape{1, 1}, shape{7, 5}, shape{8, 9}, shape{64, 37}, shape{172, 64},
                    shape{259, 13}, shape{512, 131}})
      for (int64_t n_tokens : {1, 3, 17})
        for (thread_pool* p : {&pool1, &pool2}) check_matmul(type, s.n_in, s.n_out, n_tokens, *p, seed++);
}

TEST(matmul, quant_types_odd_shapes) {
  thread_pool pool1(1), pool2(2);
  uint32_t seed = 100;
  for (ggml_type type : {ggml_type::q8_0, ggml_type::q4_0})
    for (shape s : {shape{32, 1}, shape{32, 7}, shape{96, 9}, shape{256, 37}, shape{512, 131}})
      for (int64_t n_tokens : {1, 3, 17})
        for (thread_pool* p : {&pool1, &pool2}) check_matmul(type, s.n_in, s.n_out, n_tokens, *p, seed++);
}

// Every other quantized weight type (its own vec_dot_type), odd row counts, decode and prefill.
TEST(matmul, all_weight_types_odd_shapes) {
  thread_pool pool1(1), pool2(2);
  uint32_t seed = 500;
  for (ggml_type type : {ggml_type::q4_1, ggml_type::q5_0, ggml_type::q5_1, ggml_type::iq4_nl,
                         ggml_type::q2_k, ggml_type::q3_k, ggml_type::q4_k, ggml_type::q5_k,
                         ggml_type::q6_k, ggml_type::iq4_xs}) {
    const int64_t blk = ggml_block_elems(type);
    for (shape s : {shape{blk, 1}, shape{blk, 7}, shape{3 * blk, 9}, shape{4 * blk, 37}})
      for (int64_t n_tokens : {1, 3, 17})
        for (thread_pool* p : {&pool1, &pool2}) check_matmul(type, s.n_in, s.n_out, n_tokens, *p, seed++);
  }
}

TEST(matmul, large_prefill_f16) {  // spans several token chunks and both threads
  thread_pool pool(2);
  check_matmul(ggml_type::f16, 1408, 67, 40, pool, 7);
  check_matmul(ggml_type::q4_0, 1408, 67, 40, pool, 8);
}

TEST(matmul, quant_zero_and_extreme_activations) {
  thread_pool pool(1);
  for (ggml_type type : {ggml_type::q8_0, ggml_type::q4_0}) {
    test_weight tw = random_weight(type, 64, 5, 3);
    const weight_view w = tw.view();
    std::vector<float> x(64, 0.0f);  // block 0 all zero (scale 0), block 1 one huge value
    x[40] = 3e4f;
    x[41] = -1e-3f;
    std::vector<float> ref(5), y(5);
    matmul_ref(w, x.data(), 1, ref.data());
    const std::vector<double> bound = error_bounds(w, x.data(), 1);
    for (isa tier : tiers()) {
      detail::matmul_with_isa(tier, w, x.data(), 1, y.data(), pool);
      for (int r = 0; r < 5; ++r) EXPECT_LE(std::fabs((double)y[r] - ref[r]), bound[r]) << isa_name(tier);
    }
  }
}

// Every quantized type's SIMD tiers equal the scalar tier bit for bit: the same integer block sums
// scaled and summed in the reference's order (dot_ref.h), for decode (one token) and every prefill
// tile and remainder, so a token's output does not depend on the batch it is in either. Gemma 3
// 270M's shapes (n_embd 640 = 20 q8_0 / q5_0 blocks; 13 and 37 rows: row remainders of the 4-row
// tiles; 1, 2, 3, 5, 18 tokens: token remainders) with Gemma-sized activations (scaled by
// sqrt(640), every 97th value 400x). Before, the 32-value types (q4_0, q5_0, q8_0, iq4_nl) summed
// in a different order from the reference, and decode (two accumulators) differently from prefill;
// differences of about 1e-7 relative that Gemma 3 turned into a wikitext-2 chunk-1 PPL of 11.2325
// at -b 1 and 11.1998 at -b 512 (scalar tier: 11.0983) and token 1995 for 2060 on golden prompt 3.
TEST(matmul, quant_tiers_bit_exact_with_scalar) {
  thread_pool pool1(1), pool2(2);
  uint32_t seed = 900;
  for (ggml_type type : {ggml_type::q8_0, ggml_type::q4_0, ggml_type::q5_0, ggml_type::iq4_nl, ggml_type::q4_1,
                         ggml_type::q5_1, ggml_type::q4_k, ggml_type::q5_k, ggml_type::q6_k}) {
    const int64_t blk = ggml_block_elems(type);
    for (shape s : {shape{640, 37}, shape{blk == 32 ? 224 : 1024, 13}, shape{blk == 32 ? 32 : 256, 9}})
      for (int64_t n_tokens : {1, 2, 3, 5, 18})
        for (thread_pool* p : {&pool1, &pool2}) {
          if (s.n_in % blk != 0) continue;
          test_weight tw = random_weight(type, s.n_in, s.n_out, seed++);
          const weight_view w = tw.view();
          std::vector<float> x = random_x(s.n_in * n_tokens, seed++);
          for (int64_t i = 0; i < (int64_t)x.size(); ++i) x[i] *= i % 97 == 5 ? 400.0f : 25.3f;
          std::vector<float> ref(n_tokens * s.n_out), y(n_tokens * s.n_out), y1(s.n_out);
          detail::matmul_with_isa(isa::scalar, w, x.data(), n_tokens, ref.data(), *p);
          for (isa tier : tiers()) {
            detail::matmul_with_isa(tier, w, x.data(), n_tokens, y.data(), *p);
            int bad = 0;
            for (int64_t i = 0; i < n_tokens * s.n_out; ++i)
              if (std::memcmp(&y[i], &ref[i], 4) != 0 && ++bad <= 3)
                ADD_FAILURE() << ggml_type_name(type) << " " << isa_name(tier) << " n_in " << s.n_in << " n_out "
                              << s.n_out << " n_tokens " << n_tokens << " threads " << p->size() << " [t "
                              << i / s.n_out << ", r " << i % s.n_out << "]: " << fmt::format("{:a}", y[i])
                              << " scalar " << fmt::format("{:a}", ref[i]);
            EXPECT_EQ(bad, 0);
            // Token by token (decode) gives the batch's (prefill's) values.
            for (int64_t t = 0; t < n_tokens; ++t) {
              detail::matmul_with_isa(tier, w, x.data() + t * s.n_in, 1, y1.data(), *p);
              EXPECT_EQ(std::memcmp(y1.data(), &y[t * s.n_out], 4 * s.n_out), 0)
                  << ggml_type_name(type) << " " << isa_name(tier) << " token " << t << " of " << n_tokens;
            }
          }
        }
  }
}

TEST(matmul, weight_row_to_f32_layouts) {
  // q4_0: byte j holds element j (low nibble) and j + 16 (high nibble); value (nibble - 8) * d.
  block_q4_0 b4{};
  b4.d = f32_to_f16(0.5f);
  for (int j = 0; j < 16; ++j) b4.qs[j] = (uint8_t)((j & 0xf) | ((15 - j) << 4));
  gguf_tensor_info t4;
  t4.name = "q4";
  t4.type = ggml_type::q4_0;
  t4.ne = {32, 1};
  t4.n_bytes = sizeof(b4);
  t4.data = reinterpret_cast<const uint8_t*>(&b4);
  float out[32];
  weight_row_to_f32(make_weight_view(t4), 0, out);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], 0.5f * (float)(j - 8));
    EXPECT_EQ(out[j + 16], 0.5f * (float)(15 - j - 8));
  }
  block_q8_0 b8[2];
  for (int k = 0; k < 2; ++k) {
    b8[k].d = f32_to_f16(k ? -0.25f : 2.0f);
    for (int j = 0; j < 32; ++j) b8[k].qs[j] = (int8_t)(j * 8 - 128);
  }
  gguf_tensor_info t8{"q8", ggml_type::q8_0, {32, 2}, 0, sizeof(b8), reinterpret_cast<const uint8_t*>(b8)};
  const weight_view w8 = make_weight_view(t8);
  EXPECT_EQ(w8.row_bytes, 34u);
  weight_row_to_f32(w8, 1, out);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], -0.25f * (float)(j * 8 - 128));
  EXPECT_THROW(weight_row_to_f32(w8, 2, out), error);

  const uint16_t h[3] = {0x3c00, 0xc000, 0x7bff};  // 1, -2, 65504
  gguf_tensor_info th{"h", ggml_type::f16, {3}, 0, 6, reinterpret_cast<const uint8_t*>(h)};
  weight_row_to_f32(make_weight_view(th), 0, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 65504.0f);
  const uint16_t bh[2] = {0x3f80, 0xc040};  // 1, -3
  gguf_tensor_info tb{"b", ggml_type::bf16, {2}, 0, 4, reinterpret_cast<const uint8_t*>(bh)};
  weight_row_to_f32(make_weight_view(tb), 0, out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -3.0f);
}

TEST(matmul, make_weight_view_errors) {
  std::vector<uint8_t> bytes(1024);
  gguf_tensor_info t{"blk.0.ffn_up.weight", ggml_type::iq2_xxs, {256, 2}, 0, 132, bytes.data()};
  for (ggml_type bad : {ggml_type::iq2_xxs, (ggml_type)77}) {  // known but not computed; unknown id
    t.type = bad;
    try {
      make_weight_view(t);
      FAIL();
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::unsupported);
      const std::string m = e.what();
      EXPECT_NE(m.find(fmt::format("[matmul] tensor 'blk.0.ffn_up.weight' (shape [256, 2]) has type {} (id {})",
                                   ggml_type_name(bad), (unsigned)bad)),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs"),
                std::string::npos)
          << m;
    }
  }
  t.type = ggml_type::q4_k;  // byte size must match type and shape exactly (288)
  for (uint64_t nb : {287u, 289u})
    try {
      t.n_bytes = nb;
      make_weight_view(t);
      FAIL();
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_input);
      const std::string m = e.what();
      EXPECT_NE(m.find(fmt::format("[matmul] tensor 'blk.0.ffn_up.weight' (q4_k, shape [256, 2]) has {} "
                                   "bytes of data; its type and shape need 288",
                                   nb)),
                std::string::npos)
          << m;
    }
  t.n_bytes = 288;
  EXPECT_EQ(make_weight_view(t).row_bytes, 144u);
  t.type = ggml_type::q8_0;
  t.ne = {48, 2};
  EXPECT_THROW(make_weight_view(t), error);  // not a multiple of 32
  t.ne = {32, 100};
  t.n_bytes = 340;
  EXPECT_THROW(make_weight_view(t), error);  // too few bytes
  t.ne = {32, 2, 2};
  EXPECT_THROW(make_weight_view(t), error);  // 3-D
  t.ne = {32, 2};
  t.n_bytes = 68;
  const weight_view w = make_weight_view(t);
  EXPECT_EQ(w.n_in, 32);
  EXPECT_EQ(w.n_out, 2);
  EXPECT_EQ(w.row_bytes, 34u);
}

TEST(matmul, real_tinylit_f16_weights) {
  KVQ_REQUIRE_DATA(path, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  auto f = gguf_file::open(path);
  thread_pool pool(2);
  for (const char* name : {"blk.0.ffn_up.weight", "blk.5.ffn_down.weight", "output.weight"}) {
    const weight_view w = make_weight_view(f->tensor(name));
    for (int64_t n_tokens : {1, 5}) {
      const std::vector<float> x = random_x(w.n_in * n_tokens, 42);
      std::vector<float> ref(w.n_out * n_tokens), y(w.n_out * n_tokens);
      matmul_ref(w, x.data(), n_tokens, ref.data());
      matmul(w, x.data(), n_tokens, y.data(), pool);
      const std::vector<double> bound = error_bounds(w, x.data(), n_tokens);
      double max_rel = 0;
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_LE(std::fabs((double)y[i] - ref[i]), bound[i]) << name << " " << i;
        max_rel = std::max(max_rel, std::fabs((double)y[i] - ref[i]) / (std::fabs(ref[i]) + 1e-3));
      }
      EXPECT_LT(max_rel, 1e-3) << name;
    }
  }
}

}  // namespace
}  // namespace kvq
