// Private: orthonormal real FFT used by the srft rotation (include/kvq/rotation.h).
//
// Packing of y = F x for x[d], d even, m = d / 2, X_k = sum_j x_j e^{-2 pi i jk/d}:
//   y[0] = X_0 / sqrt(d)                  (DC)
//   y[1] = X_m / sqrt(d)                  (Nyquist)
//   y[2k], y[2k+1] = sqrt(2/d) (Re X_k, Im X_k),  k = 1 .. m-1
// F is orthonormal (rows are the unit-norm cos/sin basis of R^d), so F^{-1} = F^T.
// Method: the d real samples are read as m complex z_j = x_{2j} + i x_{2j+1}; one complex FFT of
// length m, then the usual even/odd split (Cooley-Tukey 1965; any real-FFT text) gives X_0..X_m.
// The complex FFT is a Stockham autosort mixed-radix FFT: radix 4 and 2 (O(m log m) for powers of
// two), radix 3/5/7/... by direct O(p^2) butterflies, so any even d works (cost O(d * sum p_i)).
#pragma once
#include <vector>

#include "kvq/rotation.h"

namespace kvq {

struct real_fft_plan {
  int d = 0;                   // real length (even)
  int m = 0;                   // complex length d / 2
  std::vector<int> factors;    // radices, product = m
  std::vector<float> tw;       // [m][2] e^{-2 pi i t / m}, (re, im)
  std::vector<float> tw_real;  // [m][2] e^{-2 pi i k / d}, (re, im), k < m

  // Throws unsupported "[rotation] srft needs an even head_dim, got 7" for odd d.
  explicit real_fft_plan(int d);

  // In place on x[d]: forward y = F x, inverse x = F^T y. No allocation after a thread's first
  // call (scratch is thread-local, grown once to the largest d seen).
  void forward(float* x) const;
  void inverse(float* x) const;
};

}  // namespace kvq
