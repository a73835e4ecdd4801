// Geometry of the device page layout (include/kvq/cuda.h). Host code, built with and without CUDA so
// that the 64-bit offset arithmetic is tested everywhere.
#include <cmath>
#include <string>

#include "kvq/cuda.h"
#include "kvq/error.h"

namespace kvq::cuda {

namespace {
int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
}  // namespace

paged_kv_geometry paged_kv_geometry_of(const paged_kv_format& f) {
  const int hd = f.head_dim;
  const bool kivi = f.format == kv_format::kivi4;
  if (f.format != kv_format::q8 && f.format != kv_format::q4 && f.format != kv_format::f16 && !kivi)
    fail_unsupported(std::string("[cuda paged_kv] unsupported format '") + kv_traits(f.format).name +
                     "' (supported: q8, q4, f16, kivi4)");
  if (hd != 64 && hd != 80 && hd != 96 && hd != 128 && hd != 256)
    fail_unsupported("[cuda paged_kv] unsupported head_dim " + std::to_string(hd) + " (supported: 64, 80, 96, 128, 256)");
  if (kivi && hd % 32 != 0)
    fail_unsupported("[cuda paged_kv] kivi4 pages: unsupported head_dim " + std::to_string(hd) +
                     " (supported: 64, 96, 128, 256; V's q4a groups are 32 elements)");
  if (kivi && f.page_size != 32 && f.page_size != 64)
    fail_unsupported("[cuda paged_kv] kivi4 pages: unsupported page_size " + std::to_string(f.page_size) +
                     " (supported: 32, 64: a page holds whole KIVI groups of 32 positions)");
  if (!kivi && f.page_size != 16 && f.page_size != 64)
    fail_unsupported("[cuda paged_kv] unsupported page_size " + std::to_string(f.page_size) + " (supported: 16, 64)");
  if (f.n_kv_head < 1 || f.n_kv_head > 4096)
    fail_input("[cuda paged_kv] n_kv_head must be in [1, 4096], got " + std::to_string(f.n_kv_head));
  if (f.rotation != rotation_kind::none && f.rotation != rotation_kind::hadamard)
    fail_unsupported(std::string("[cuda paged_kv] unsupported rotation '") + rotation_name(f.rotation) +
                     "' (supported: none, hadamard)");
  paged_kv_geometry g;
  if (kivi) {
    // K: codes [page_size][hd / 2] (q4a rows), per group of kivi_group rows [hd] f16 scales then [hd]
    // zeros; V: q4a codes [page_size][hd / 2], per row [hd / 32] f16 scales then [hd / 32] zeros
    g.group = 32;
    g.kivi_group = 32;
    g.n_scales = 2 * hd / 32;
    g.code_bytes = hd / 2;
    const int64_t codes = align16((int64_t)f.page_size * g.code_bytes);
    const int64_t kscales = align16((int64_t)(f.page_size / g.kivi_group) * 2 * hd * 2);
    const int64_t vscales = align16((int64_t)f.page_size * g.n_scales * 2);
    g.k_codes = 0;
    g.v_codes = codes;
    g.k_scales = 2 * codes;
    g.v_scales = 2 * codes + kscales;
    g.head_bytes = 2 * codes + kscales + vscales;
    g.page_bytes = g.head_bytes * f.n_kv_head;
  } else {
    const bool dense = f.format == kv_format::f16;
    g.group = hd % 32 == 0 ? 32 : hd;
    g.n_scales = dense ? 0 : hd / g.group;
    g.code_bytes = dense ? 2 * (int64_t)hd : (int64_t)kv_code_bytes(f.format, hd);
    const int64_t codes = align16(f.page_size * g.code_bytes), scales = align16((int64_t)f.page_size * g.n_scales * 2);
    g.k_codes = 0;
    g.v_codes = codes;
    g.k_scales = 2 * codes;
    g.v_scales = 2 * codes + scales;
    g.head_bytes = 2 * codes + 2 * scales;
    g.page_bytes = g.head_bytes * f.n_kv_head;
  }
  if (f.rotation == rotation_kind::hadamard) {
    g.rot_block = largest_pow2_divisor(hd);
    g.rot_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(g.rot_block)));
  }
  return g;
}

}  // namespace kvq::cuda
