// Orthonormal rotations applied to K (and Q, and V) before quantizing, so that outlier channels
// are spread over the whole head and per-token quantization error drops; since R is orthonormal,
// (Rq)·(Rk) = q·k, and the attention output (a combination of Rv) is un-rotated once per head.
// Sources: QuaRot (Ashkboos et al. 2024, arXiv:2404.00456, §3), QuIP# (Tseng et al. 2024,
// arXiv:2402.04396, §3.1: randomized Hadamard), and "When Quantization Is Free" (arXiv:2605.05699,
// the sign-randomized FFT, SRFT).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq {

struct real_fft_plan;  // private (src/rotation/real_fft.h): srft twiddles, immutable

enum class rotation_kind {
  none,      // identity
  hadamard,  // orthonormal FWHT; block-diagonal with the largest power-of-two block dividing head_dim
  srht,      // fixed random ±1 signs, then the (block-diagonal) FWHT
  srft,      // random ±1 signs, then an orthonormal real FFT (any even head_dim)
  count
};

// "none" | "hadamard" | "srht" | "srft"; throws invalid_input "[rotation] unknown rotation 'x' (...)".
rotation_kind parse_rotation(const std::string& name);
const char* rotation_name(rotation_kind k);

// A rotation plan for one head_dim. Cheap to copy; forward/inverse are O(d log d), allocation-free.
struct rotation {
  rotation_kind kind = rotation_kind::none;
  int head_dim = 0;
  int block = 0;               // Hadamard block size (power of two dividing head_dim); 0 for none/srft
  std::vector<float> signs;    // [head_dim] ±1 for srht/srft, empty otherwise
  std::shared_ptr<const real_fft_plan> fft;  // srft only, built by make(); shared, so copies stay cheap

  // Throws unsupported "[rotation] srft needs an even head_dim, got 7" etc. head_dim must be >= 1.
  static rotation make(rotation_kind kind, int head_dim, uint64_t seed);

  // In place on x[head_dim]: y = R x (forward) and x = R^T y (inverse); R orthonormal.
  void forward(float* x) const;
  void inverse(float* x) const;
  // n vectors of head_dim contiguous floats, stride = head_dim.
  void forward_n(float* x, int64_t n) const;
  void inverse_n(float* x, int64_t n) const;
};

// Orthonormal in-place FWHT of x[n], n a power of two (scale 1/sqrt(n)).
void fwht_radix2(float* x, int n);
// Largest power of two dividing d (d >= 1).
int largest_pow2_divisor(int d);

}  // namespace kvq
