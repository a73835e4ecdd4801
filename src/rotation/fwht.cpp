#include "rotation/fwht.h"

#include <cmath>
#include <string>

#include "kvq/cpu.h"
#include "kvq/error.h"
#include "kvq/rotation.h"

namespace kvq {

void fwht_radix2_ref(float* x, int n) {
  // Sylvester order: stage h pairs elements h apart, (a, b) -> (a + b, a - b).
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

using fwht_fn = void (*)(float*, int);

static fwht_fn pick_fwht() {
  return best_isa() >= isa::avx2 ? &fwht_radix2_avx2 : &fwht_radix2_ref;
}

void fwht_radix2(float* x, int n) {
  if (n < 1 || (n & (n - 1)) != 0)
    fail_input("[fwht_radix2] n must be a power of two >= 1, got " + std::to_string(n));
  static const fwht_fn fn = pick_fwht();
  fn(x, n);
}

int largest_pow2_divisor(int d) {
  if (d < 1) fail_input("[rotation] largest_pow2_divisor needs d >= 1, got " + std::to_string(d));
  return d & -d;
}

}  // namespace kvq
