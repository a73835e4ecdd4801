#include "rotation/real_fft.h"

#include <cmath>
#include <numbers>
#include <string>
#include <utility>

#include "kvq/error.h"

namespace kvq {

namespace {

struct cf {
  float re, im;
};
inline cf add(cf a, cf b) { return {a.re + b.re, a.im + b.im}; }
inline cf sub(cf a, cf b) { return {a.re - b.re, a.im - b.im}; }
inline cf mul(cf a, cf b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }
inline cf conj(cf a) { return {a.re, -a.im}; }
inline cf mul_neg_i(cf a) { return {a.im, -a.re}; }  // -i * a

static_assert(sizeof(cf) == 2 * sizeof(float));

// Unnormalized forward complex DFT of a[m] (Stockham, decimation in frequency). Each stage splits
// the l current sub-problems of length len into r sub-problems of length len / r:
//   b[j1 (l r) + q + l k2] = w_len^{j1 k2} sum_{j2<r} a[(j1 + (len/r) j2) l + q] w_r^{j2 k2}
// and after the last stage a[k] = X_k in natural order. Returns the buffer holding the result.
cf* fft_stockham(const real_fft_plan& p, cf* a, cf* b) {
  const int n = p.m;
  const cf* tw = reinterpret_cast<const cf*>(p.tw.data());
  int l = 1, len = n;
  for (const int r : p.factors) {
    const int ms = len / r, step = n / len;  // w_len^t = tw[t * step]
    if (r == 2) {
      for (int j1 = 0; j1 < ms; ++j1) {
        const cf w1 = tw[step * j1];
        const cf* a0 = a + j1 * l;
        const cf* a1 = a + (j1 + ms) * l;
        cf* o = b + j1 * 2 * l;
        for (int q = 0; q < l; ++q) {
          o[q] = add(a0[q], a1[q]);
          o[q + l] = mul(w1, sub(a0[q], a1[q]));
        }
      }
    } else if (r == 4) {
      for (int j1 = 0; j1 < ms; ++j1) {
        const cf w1 = tw[step * j1], w2 = tw[step * 2 * j1], w3 = tw[step * 3 * j1];
        const cf* a0 = a + j1 * l;
        const cf* a1 = a + (j1 + ms) * l;
        const cf* a2 = a + (j1 + 2 * ms) * l;
        const cf* a3 = a + (j1 + 3 * ms) * l;
        cf* o = b + j1 * 4 * l;
        for (int q = 0; q < l; ++q) {
          const cf s02 = add(a0[q], a2[q]), d02 = sub(a0[q], a2[q]);
          const cf s13 = add(a1[q], a3[q]), d13 = mul_neg_i(sub(a1[q], a3[q]));
          o[q] = add(s02, s13);
          o[q + l] = mul(w1, add(d02, d13));
          o[q + 2 * l] = mul(w2, sub(s02, s13));
          o[q + 3 * l] = mul(w3, sub(d02, d13));
        }
      }
    } else {  // any radix by direct DFT, O(r^2) per output group
      const int rstep = n / r;  // w_r^t = tw[t * rstep]
      for (int j1 = 0; j1 < ms; ++j1)
        for (int k2 = 0; k2 < r; ++k2) {
          const cf w = tw[step * j1 * k2];
          cf* o = b + j1 * r * l + k2 * l;
          for (int q = 0; q < l; ++q) {
            cf s{0.f, 0.f};
            for (int j2 = 0; j2 < r; ++j2)
              s = add(s, mul(a[(j1 + ms * j2) * l + q], tw[rstep * ((j2 * k2) % r)]));
            o[q] = mul(w, s);
          }
        }
    }
    std::swap(a, b);
    l *= r;
    len = ms;
  }
  return a;
}

std::vector<float>& scratch(int floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int>(buf.size()) < floats) buf.resize(floats);
  return buf;
}

}  // namespace

real_fft_plan::real_fft_plan(int d_) : d(d_), m(d_ / 2) {
  if (d < 2 || d % 2 != 0)
    fail_unsupported("[rotation] srft needs an even head_dim, got " + std::to_string(d));
  for (int rest = m; rest > 1;) {
    int r = rest % 4 == 0 ? 4 : rest % 2 == 0 ? 2 : 3;
    while (rest % r != 0) r += 2;  // smallest odd prime factor
    factors.push_back(r);
    rest /= r;
  }
  tw.resize(2 * m);
  tw_real.resize(2 * m);
  for (int t = 0; t < m; ++t) {
    const double a = -2.0 * std::numbers::pi * t / m, b = -2.0 * std::numbers::pi * t / d;
    tw[2 * t] = static_cast<float>(std::cos(a));
    tw[2 * t + 1] = static_cast<float>(std::sin(a));
    tw_real[2 * t] = static_cast<float>(std::cos(b));
    tw_real[2 * t + 1] = static_cast<float>(std::sin(b));
  }
}

void real_fft_plan::forward(float* x) const {
  cf* z = reinterpret_cast<cf*>(x);  // z_j = x_2j + i x_2j+1
  cf* work = reinterpret_cast<cf*>(scratch(d).data());
  const cf* Z = fft_stockham(*this, z, work);
  const cf* wd = reinterpret_cast<const cf*>(tw_real.data());
  const float s0 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const float s1 = static_cast<float>(std::sqrt(2.0 / d));
  // X_k = E_k + w_d^k O_k with E_k = (Z_k + conj Z_{m-k}) / 2, O_k = (Z_k - conj Z_{m-k}) / 2i;
  // pair (k, m-k) reads both Z first, so writing into z (possibly == Z) is safe.
  const float z0r = Z[0].re, z0i = Z[0].im;
  for (int k = 1; 2 * k <= m; ++k) {
    const int kk = m - k;
    const cf zk = Z[k], zkk = Z[kk];
    const cf ek = {0.5f * (zk.re + zkk.re), 0.5f * (zk.im - zkk.im)};
    const cf ok = {0.5f * (zk.im + zkk.im), -0.5f * (zk.re - zkk.re)};
    const cf xk = add(ek, mul(wd[k], ok));
    // E_{m-k} = conj E_k, O_{m-k} = conj O_k.
    const cf xkk = add(conj(ek), mul(wd[kk], conj(ok)));
    z[k] = {s1 * xk.re, s1 * xk.im};
    z[kk] = {s1 * xkk.re, s1 * xkk.im};
  }
  z[0] = {s0 * (z0r + z0i), s0 * (z0r - z0i)};
}

void real_fft_plan::inverse(float* x) const {
  cf* y = reinterpret_cast<cf*>(x);
  const cf* wd = reinterpret_cast<const cf*>(tw_real.data());
  const float h = static_cast<float>(std::sqrt(0.5));  // V_k = (y_2k + i y_2k+1) / sqrt 2
  // Rebuild Z_k = E_k + i O_k from V (X = sqrt(d) V); store conj Z so one forward FFT inverts.
  const float v0 = y[0].re, vm = y[0].im;
  for (int k = 1; 2 * k <= m; ++k) {
    const int kk = m - k;
    const cf vk = {h * y[k].re, h * y[k].im}, vkk = {h * y[kk].re, h * y[kk].im};
    const cf ek = {0.5f * (vk.re + vkk.re), 0.5f * (vk.im - vkk.im)};      // (V_k + conj V_m-k)/2
    const cf dk = {0.5f * (vk.re - vkk.re), 0.5f * (vk.im + vkk.im)};      // (V_k - conj V_m-k)/2
    const cf ok = mul(conj(wd[k]), dk);
    // For m-k: E_{m-k} = conj E_k, and O_{m-k} = conj O_k.
    const cf zk = {ek.re - ok.im, ek.im + ok.re};            // E + iO
    const cf zkk = {ek.re + ok.im, ok.re - ek.im};           // conj E + i conj O
    y[k] = conj(zk);
    y[kk] = conj(zkk);
  }
  y[0] = conj(cf{0.5f * (v0 + vm), 0.5f * (v0 - vm)});
  cf* work = reinterpret_cast<cf*>(scratch(d).data());
  const cf* z = fft_stockham(*this, y, work);
  // z = sqrt(d) / m * conj(FFT(conj Z)) = 2 / sqrt(d) * ...
  const float s = static_cast<float>(2.0 / std::sqrt(static_cast<double>(d)));
  for (int j = 0; j < m; ++j) {
    const cf v = z[j];
    y[j] = {s * v.re, -s * v.im};
  }
}

}  // namespace kvq
