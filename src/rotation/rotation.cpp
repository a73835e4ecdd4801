#include "kvq/rotation.h"

#include <cstring>
#include <string>

#include "kvq/error.h"
#include "rotation/real_fft.h"

namespace kvq {

namespace {

// splitmix64 (Steele, Lea, Flood 2014): a full-period 64-bit generator; the sign of element i is
// the top bit of its i-th output, so signs depend only on (seed, i), not on head_dim.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void apply_signs(const std::vector<float>& signs, float* x) {
  const int n = static_cast<int>(signs.size());
  for (int i = 0; i < n; ++i) x[i] *= signs[i];
}

void fwht_blocks(float* x, int head_dim, int block) {
  for (int b = 0; b < head_dim; b += block) fwht_radix2(x + b, block);
}

const real_fft_plan& plan_of(const rotation& r, std::shared_ptr<const real_fft_plan>& local) {
  if (r.fft && r.fft->d == r.head_dim) return *r.fft;
  local = std::make_shared<const real_fft_plan>(r.head_dim);  // hand-built rotation: slow path
  return *local;
}

}  // namespace

rotation_kind parse_rotation(const std::string& name) {
  for (int k = 0; k < static_cast<int>(rotation_kind::count); ++k)
    if (name == rotation_name(static_cast<rotation_kind>(k))) return static_cast<rotation_kind>(k);
  fail_input("[rotation] unknown rotation '" + name + "' (expected none, hadamard, srht or srft)");
}

const char* rotation_name(rotation_kind k) {
  switch (k) {
    case rotation_kind::none: return "none";
    case rotation_kind::hadamard: return "hadamard";
    case rotation_kind::srht: return "srht";
    case rotation_kind::srft: return "srft";
    default: return "?";
  }
}

rotation rotation::make(rotation_kind kind, int head_dim, uint64_t seed) {
  if (static_cast<int>(kind) < 0 || kind >= rotation_kind::count)
    fail_input("[rotation] invalid rotation_kind " + std::to_string(static_cast<int>(kind)));
  if (head_dim < 1)
    fail_input("[rotation] head_dim must be >= 1, got " + std::to_string(head_dim));
  rotation r;
  r.kind = kind;
  r.head_dim = head_dim;
  if (kind == rotation_kind::hadamard || kind == rotation_kind::srht)
    r.block = largest_pow2_divisor(head_dim);
  if (kind == rotation_kind::srft) r.fft = std::make_shared<const real_fft_plan>(head_dim);
  if (kind == rotation_kind::srht || kind == rotation_kind::srft) {
    r.signs.resize(head_dim);
    uint64_t state = seed;
    for (int i = 0; i < head_dim; ++i) r.signs[i] = (splitmix64(state) >> 63) ? -1.f : 1.f;
  }
  return r;
}

void rotation::forward(float* x) const {
  switch (kind) {
    case rotation_kind::none: return;
    case rotation_kind::hadamard: fwht_blocks(x, head_dim, block); return;
    case rotation_kind::srht:
      apply_signs(signs, x);
      fwht_blocks(x, head_dim, block);
      return;
    case rotation_kind::srft: {
      apply_signs(signs, x);
      std::shared_ptr<const real_fft_plan> local;
      plan_of(*this, local).forward(x);
      return;
    }
    default: return;
  }
}

void rotation::inverse(float* x) const {
  switch (kind) {
    case rotation_kind::none: return;
    case rotation_kind::hadamard: fwht_blocks(x, head_dim, block); return;  // H symmetric
    case rotation_kind::srht:
      fwht_blocks(x, head_dim, block);
      apply_signs(signs, x);
      return;
    case rotation_kind::srft: {
      std::shared_ptr<const real_fft_plan> local;
      plan_of(*this, local).inverse(x);
      apply_signs(signs, x);
      return;
    }
    default: return;
  }
}

void rotation::forward_n(float* x, int64_t n) const {
  if (kind == rotation_kind::none) return;
  for (int64_t i = 0; i < n; ++i) forward(x + i * head_dim);
}

void rotation::inverse_n(float* x, int64_t n) const {
  if (kind == rotation_kind::none) return;
  for (int64_t i = 0; i < n; ++i) inverse(x + i * head_dim);
}

}  // namespace kvq
