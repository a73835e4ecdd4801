// Paged layout geometry (runs everywhere) and the fused append kernel: codes and scales must be
// bit-identical to the CPU pipeline (rotation -> f16 rounding -> quantize_row_ref).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "cuda_test_util.h"
#include "kvq/error.h"

namespace kvq::cuda::test {
namespace {

TEST(CudaGeometry, Q4Head128Page16) {
  paged_kv_format f;
  f.format = kv_format::q4;
  f.head_dim = 128;
  f.n_kv_head = 8;
  f.page_size = 16;
  const paged_kv_geometry g = paged_kv_geometry_of(f);
  EXPECT_EQ(g.group, 32);
  EXPECT_EQ(g.n_scales, 4);
  EXPECT_EQ(g.code_bytes, 64);
  EXPECT_EQ(g.k_codes, 0);
  EXPECT_EQ(g.v_codes, 16 * 64);
  EXPECT_EQ(g.k_scales, 2 * 16 * 64);
  EXPECT_EQ(g.v_scales, 2 * 16 * 64 + 16 * 4 * 2);
  EXPECT_EQ(g.head_bytes, 2 * 16 * 64 + 2 * 16 * 4 * 2);
  EXPECT_EQ(g.page_bytes, 8 * g.head_bytes);
  EXPECT_EQ(g.rot_block, 128);
  EXPECT_EQ(g.rot_scale, static_cast<float>(1.0 / std::sqrt(128.0)));
}

TEST(CudaGeometry, OddHeadDimsUseOneScalePerRow) {
  paged_kv_format f;
  f.format = kv_format::q4;
  f.head_dim = 80;
  f.page_size = 64;
  paged_kv_geometry g = paged_kv_geometry_of(f);
  EXPECT_EQ(g.group, 80);  // kv_cache_quant's default group for head_dim % 32 != 0
  EXPECT_EQ(g.n_scales, 1);
  EXPECT_EQ(g.code_bytes, 40);
  EXPECT_EQ(g.rot_block, 16);
  f.format = kv_format::q8;
  f.head_dim = 96;
  g = paged_kv_geometry_of(f);
  EXPECT_EQ(g.group, 32);
  EXPECT_EQ(g.n_scales, 3);
  EXPECT_EQ(g.rot_block, 32);
  EXPECT_EQ(g.head_bytes % 16, 0);
  f.format = kv_format::f16;
  f.rotation = rotation_kind::none;
  g = paged_kv_geometry_of(f);
  EXPECT_EQ(g.n_scales, 0);
  EXPECT_EQ(g.code_bytes, 192);
  EXPECT_EQ(g.rot_block, 0);
}

// 64-bit offsets: a page index whose block lies far past 2^31 (and 2^32) bytes.
TEST(CudaGeometry, OffsetsPast2To31Bytes) {
  paged_kv_format f;
  f.format = kv_format::q8;
  f.head_dim = 256;
  f.n_kv_head = 32;
  f.page_size = 64;
  const paged_kv_geometry g = paged_kv_geometry_of(f);
  const int64_t page = (int64_t{1} << 21) + 5;  // ~2M pages of ~1.1 MB
  const int64_t expect = page * g.page_bytes + 31 * g.head_bytes + g.v_scales + 63 * g.n_scales * 2;
  EXPECT_EQ(g.v_scale_offset(page, 31, 63), expect);
  EXPECT_GT(expect, int64_t{1} << 40);
  EXPECT_EQ(g.k_code_offset(page, 0, 1) - g.block_offset(page, 0), g.code_bytes);
}

TEST(CudaGeometry, RejectsUnsupported) {
  paged_kv_format f;
  auto expect_error = [&](const std::string& needle) {
    try {
      (void)paged_kv_geometry_of(f);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const kvq::error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("[cuda paged_kv]", 0), 0u) << e.what();
    }
  };
  f.head_dim = 72;
  expect_error("head_dim 72");
  f.head_dim = 128;
  f.page_size = 32;
  expect_error("page_size 32");
  f.page_size = 16;
  f.format = kv_format::q3;
  expect_error("'q3'");
  f.format = kv_format::q4;
  f.rotation = rotation_kind::srht;
  expect_error("'srht'");
}

TEST(CudaBackend, StubOrDeviceIsConsistent) {
  if (available()) {
    EXPECT_NO_THROW(require());
    EXPECT_EQ(device_name().find("none"), std::string::npos);
  } else {
    EXPECT_THROW(require(), kvq::error);
  }
}

struct append_case {
  kv_format format;
  int hd;
  kv_elem elem;
  int page_size;
};
void PrintTo(const append_case& c, std::ostream* os) { *os << "hd" << c.hd << "_p" << c.page_size; }

class CudaAppend : public ::testing::TestWithParam<append_case> {};

TEST_P(CudaAppend, CodesBitIdenticalToCpu) {
  KVQ_REQUIRE_GPU();
  const append_case p = GetParam();
  paged_kv_format f;
  f.format = p.format;
  f.head_dim = p.hd;
  f.n_kv_head = 3;
  f.page_size = p.page_size;
  f.rotation = p.format == kv_format::f16 ? rotation_kind::none : rotation_kind::hadamard;
  std::mt19937 rng(1234 + p.hd);
  paged_cache c;
  build_cache(c, f, {17, 100, 1}, rng, p.elem);
  const rotation rot = rotation::make(f.rotation, p.hd, 0);
  const auto& g = c.g;
  std::vector<float> y(p.hd);
  std::vector<uint8_t> codes(g.code_bytes);
  std::vector<uint16_t> scales(std::max(1, g.n_scales));
  int64_t bad_rows = 0, rows = 0;
  for (int b = 0; b < c.batch(); ++b)
    for (int j = 0; j < c.len[b]; ++j)
      for (int h = 0; h < f.n_kv_head; ++h)
        for (int side = 0; side < 2; ++side) {
          const auto& src = side ? c.v : c.k;
          transform_row_ref(rot, &src[((c.token_offset[b] + j) * f.n_kv_head + h) * p.hd], p.elem, p.hd, y.data());
          const uint8_t* got = side ? c.v_codes(b, j, h) : c.k_codes(b, j, h);
          bool ok;
          if (p.format == kv_format::f16) {
            std::vector<uint16_t> e(p.hd);
            for (int i = 0; i < p.hd; ++i) e[i] = f32_to_f16(y[i]);
            ok = std::memcmp(got, e.data(), 2 * p.hd) == 0;
          } else {
            quantize_row_ref(p.format, y.data(), p.hd, g.group, codes.data(), scales.data());
            const uint16_t* gs = side ? c.v_scales(b, j, h) : c.k_scales(b, j, h);
            ok = std::memcmp(got, codes.data(), g.code_bytes) == 0 &&
                 std::memcmp(gs, scales.data(), 2 * g.n_scales) == 0;
          }
          bad_rows += !ok;
          ++rows;
        }
  EXPECT_EQ(bad_rows, 0) << "of " << rows << " rows differ from the CPU codes";
}

std::string append_name(const ::testing::TestParamInfo<append_case>& i) {
  return std::string(kv_traits(i.param.format).name) + "_hd" + std::to_string(i.param.hd) +
         (i.param.elem == kv_elem::bf16 ? "_bf16" : "_f16") + "_p" + std::to_string(i.param.page_size);
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, CudaAppend,
    ::testing::Values(append_case{kv_format::q4, 64, kv_elem::f16, 16}, append_case{kv_format::q4, 80, kv_elem::bf16, 64},
                      append_case{kv_format::q4, 96, kv_elem::f16, 16}, append_case{kv_format::q4, 128, kv_elem::bf16, 16},
                      append_case{kv_format::q4, 256, kv_elem::f16, 64}, append_case{kv_format::q8, 64, kv_elem::bf16, 64},
                      append_case{kv_format::q8, 80, kv_elem::f16, 16}, append_case{kv_format::q8, 96, kv_elem::bf16, 64},
                      append_case{kv_format::q8, 128, kv_elem::f16, 64}, append_case{kv_format::q8, 256, kv_elem::bf16, 16},
                      append_case{kv_format::f16, 80, kv_elem::bf16, 16}, append_case{kv_format::f16, 128, kv_elem::f16, 64}),
    append_name);

}  // namespace
}  // namespace kvq::cuda::test
