// Certified attention over one kv head: compressed-tier attention with a rigorous per-step error
// bound, and the fallback ladder (stage 1: recompute the tokens carrying most of the bound from
// the host tier; stage 2: recompute the head exactly). Scalar reference tier: f64 accumulation so
// that the rounding allowance stays far below the quantization terms even at 32K keys.
// Derivation of every term: docs/certified.md.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvq/attn_certified.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

constexpr double kU32 = 0x1p-24;  // unit roundoff of f32
constexpr double kU64 = 0x1p-53;  // unit roundoff of f64
constexpr double kRel = 1e-6;     // relative inflation of every computed bound (its own rounding)
constexpr int kBlock = 64;        // rows dequantized at a time

double norm2(const float* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return std::sqrt(s);
}

// Sequential reader of the rows of one fast-tier side (segments of different formats).
struct row_reader {
  const cert_side_view* s;
  int hd;
  int seg = 0;
  const uint16_t* chan_err = nullptr;  // of the last row loaded: its group's Δ (per-channel rows), else null
  // Loads row r into y; returns whether it is in the rotated basis (false: original basis).
  bool load(int r, float* y) {
    while (seg + 1 < s->n_segs && s->segs[seg + 1].row_begin <= r) ++seg;
    while (seg > 0 && s->segs[seg].row_begin > r) --seg;
    const cert_segment& g = s->segs[seg];
    const int64_t i = r - g.row_begin;
    const uint8_t* c = g.codes + i * g.code_stride;
    chan_err = nullptr;
    switch (g.format) {
      case kv_format::f32:
        for (int e = 0; e < hd; ++e) y[e] = reinterpret_cast<const float*>(c)[e];
        break;
      case kv_format::f16:
        for (int e = 0; e < hd; ++e) y[e] = f16_to_f32(reinterpret_cast<const uint16_t*>(c)[e]);
        break;
      case kv_format::bf16:
        for (int e = 0; e < hd; ++e) y[e] = bf16_to_f32(reinterpret_cast<const uint16_t*>(c)[e]);
        break;
      case kv_format::kivi8: case kv_format::kivi4: case kv_format::kivi2:  // per channel: the group's scales
        dequantize_channel_group_ref(g.format, c, g.scales + (i / g.group) * g.scale_stride, 1, hd, y);
        if (g.chan_err && !g.rotated) chan_err = g.scales + (i / g.group) * g.scale_stride + 2 * hd;
        break;
      default:
        dequantize_row_ref(g.format, c, g.scales + i * g.scale_stride, hd, g.group, y);
        break;
    }
    return g.rotated;
  }
  // A V row in the working basis of the V side: the rotated one when rotate (rows stored in the
  // original basis are rotated here, in f32: returns true for those), else the original one (every
  // row is in it). Returns whether the row was rotated here.
  bool load_v(int r, float* y, bool rotate) {
    if (load(r, y) || !rotate) return false;
    s->rot->forward(y);
    return true;
  }
};

// Whether any row of the side is in the rotated basis (else the kernel works in the original one).
bool any_rotated(const cert_side_view& s) {
  for (int i = 0; i < s.n_segs; ++i)
    if (s.segs[i].rotated) return true;
  return false;
}

inline float err_at(const uint16_t* e, int r) { return f16_to_f32(e[r]); }

// Contributions of one token to the three terms (docs/certified.md, "Output error"):
//   key   p (e^δ - 1) ||v̂ - ô|| / Z_lo,   value   p ε_v,   cross   p (e^δ / Z_lo - 1) ε_v
// with p (e^δ / Z_lo - 1) = (p (e^δ - 1) + p (1 - Z_lo)) / Z_lo computed without cancellation, and
// p e^δ taken in the log domain for large δ (p may underflow while p e^δ does not).
struct softmax_z {
  double lse = 0;                                  // log Σ exp(s): p_j = exp(s_j - lse)
  double zlo = 1, one_minus_zlo = 0, spread = 0;  // Z_lo, 1 - Z_lo, Z_hi - Z_lo
};
struct bound_terms {
  double key = 0, value = 0, cross = 0, spv = 0, total = 0, onorm = 0;
};
inline double sanitize(double x) { return std::isnan(x) ? std::numeric_limits<double>::infinity() : x; }
// p (e^δ - 1) for p = exp(ls)
inline double p_expm1(double p, double ls, double delta) {
  return delta < 0.5 ? p * std::expm1(delta) : std::exp(ls + delta) - p;
}
// pe = p (e^δ - 1) as computed by the softmax pass.
inline double add_token(bound_terms& b, const softmax_z& z, double p, double pe, double dist, double ev,
                        double vnorm) {
  if (pe == 0 && p == 0) return 0;  // below the f64 underflow threshold (docs/certified.md)
  const double kt = sanitize(pe * dist / z.zlo);
  const double vt = p * ev;
  const double xt = sanitize((pe + p * z.one_minus_zlo) / z.zlo * ev);
  b.key += kt;
  b.value += vt;
  b.cross += xt;
  b.spv += p * vnorm;
  return kt + vt + xt;
}
// Adds the rounding allowances of the computed output (f64 sums and softmax, the center ô,
// f32 conversion and the inverse V rotation) and the relative inflation.
inline void finish_bound(bound_terms& b, const softmax_z& z, int n, double eta_v) {
  const double rho_d = (8.0 * n + 64.0) * 0x1p-53 * b.spv;
  const double rho_c = sanitize(z.spread / z.zlo * rho_d);
  const double rho_out = (eta_v + 2 * 0x1p-24) * b.onorm * (1 + 1e-3);
  b.total = sanitize((b.key + b.value + b.cross) * (1 + 1e-6) + rho_d + rho_c + rho_out);
}

struct query_ctx {
  const float* q;      // original basis
  const float* q_rot;  // K basis
  double qn;           // ||q||
  const double* qg;    // [2, err_groups] ||q_g|| (original basis), then ||(q_rot)_g||
  int lo, lim;         // keys [lo, lim) (attn_spec::key_range clamped to the stored rows)
};

// Thread-local scratch of one call (grows, never shrinks).
struct scratch {
  std::vector<double> s, p, pe;  // [nq, n_max] scores, probabilities, p (e^δ - 1)
  std::vector<double> d;         // [nq, n_max] δ_j of the compressed rows
  std::vector<double> qg;        // [nq, 2, err_groups] per-group query norms
  std::vector<float> c;          // [nq, n_max] per-token contributions to the bound
  std::vector<float> kb, vb;     // [kBlock, hd] dequantized rows
  std::vector<uint8_t> kb_rot;   // [kBlock] row of kb is in the rotated basis
  std::vector<const uint16_t*> kb_ce;  // [kBlock] the row's per-channel Δ (null: none)
  std::vector<double> kb_norm;   // [kBlock] ||k̂|| of rows with Δ
  std::vector<uint8_t> vb_rot;   // [kBlock] row of vb was rotated on read (dense row, rotated V basis)
  std::vector<double> o;         // [nq, hd] compressed-tier output (rotated V basis)
  std::vector<double> ex;        // [hd] exact output of one query
  std::vector<double> o1;        // [hd] stage-1 output
  std::vector<float> vx;         // [budget, hd] exact V rows (rotated) of stage 1
  std::vector<double> dx;        // [budget] δ of stage-1 rows
  std::vector<float> ex_err;     // [budget] ε_v of stage-1 rows
  std::vector<int> slot, order;  // [n_max]
  std::vector<float> tmp;        // [hd]
  std::vector<double> sx;        // [n_max] exact scores
  std::vector<query_ctx> qs;     // [nq]
  std::vector<softmax_z> zs;     // [nq]
  std::vector<bound_terms> bt;   // [nq]
};

// Exact attention in f64 over the host tier (original basis): o[hd]. Returns its bound on
// ||fl32(o) - o_true|| (rounding only) through *bound.
// Absolute rounding of spec.logit in f64 beyond the score's own (0 without a soft-cap).
double softcap_rounding(const attn_spec& spec) { return spec.softcap > 0 ? 8 * kU64 * spec.softcap : 0.0; }

void exact_attend(const cert_kv_view& kv, const query_ctx& qc, const attn_spec& spec, double* o, double* bound,
                  std::vector<double>& s) {
  const int hd = kv.head_dim, n = qc.lim;
  const double scale = spec.scale;
  s.resize(n);
  double m = -std::numeric_limits<double>::infinity(), kmax = 0;
  for (int j = qc.lo; j < n; ++j) {
    const uint16_t* k = kv.host.k + (int64_t)j * kv.host.row_stride;
    double a = 0, kk = 0;
    for (int i = 0; i < hd; ++i) {
      const double x = f16_to_f32(k[i]);
      a += (double)qc.q[i] * x;
      kk += x * x;
    }
    s[j] = spec.logit(a * scale);
    m = std::max(m, s[j]);
    kmax = std::max(kmax, kk);
  }
  double d = 0;
  for (int j = qc.lo; j < n; ++j) d += (s[j] = std::exp(s[j] - m));
  std::fill(o, o + hd, 0.0);
  double spv = 0;
  for (int j = qc.lo; j < n; ++j) {
    const uint16_t* v = kv.host.v + (int64_t)j * kv.host.row_stride;
    const double p = s[j] / d;
    double vv = 0;
    for (int i = 0; i < hd; ++i) {
      const double x = f16_to_f32(v[i]);
      o[i] += p * x;
      vv += x * x;
    }
    spv += p * std::sqrt(vv);
  }
  double on = 0;
  for (int i = 0; i < hd; ++i) on += o[i] * o[i];
  on = std::sqrt(on);
  // score rounding (hd-term f64 dot): δ <= 1e-12 scale ||q|| ||k||, moving the output by at most
  // (e^{2δ} - 1) Σ p (||v|| + ||o||); f64 sums; the final rounding to f32.
  // (the soft-cap is 1-Lipschitz; its own f64 rounding adds a few ulp of c)
  const double dmax = 1e-12 * scale * qc.qn * std::sqrt(kmax) + softcap_rounding(spec);
  const double rho_d = (8.0 * (n - qc.lo) + 64.0) * kU64 * spv;
  *bound = (std::expm1(2 * dmax) * (spv + on) + rho_d + kU32 * on) * (1 + kRel);
}

}  // namespace

double rotation_rounding_bound(const rotation& rot) {
  if (rot.kind == rotation_kind::none) return 0.0;
  int l = 0;
  while ((1 << l) < rot.head_dim) ++l;
  return (16.0 * l + 32.0) * kU32;
}

int cert_error_group(int head_dim) { return head_dim % 32 == 0 ? 32 : head_dim % 8 == 0 ? 8 : head_dim; }

void cert_error_bounds_f16(const float* x_rot, const float* x_hat, int head_dim, int n_groups, double x_norm,
                           double eta, uint16_t* out) {
  KVQ_ASSERT(n_groups >= 1 && n_groups <= 1024 && head_dim % n_groups == 0);
  const int gl = head_dim / n_groups;
  double eg[1024], e = 0, h = 0;
  for (int g = 0; g < n_groups; ++g) {
    double a = 0;
    for (int i = g * gl; i < (g + 1) * gl; ++i) {
      const double d = (double)x_rot[i] - x_hat[i];
      a += d * d;
      h += (double)x_hat[i] * x_hat[i];
    }
    eg[g] = std::sqrt(a);
    e += a;
  }
  h = std::sqrt(h);
  // ||(R x)_g - x̂_g|| <= ||fl(Rx)_g - x̂_g|| + ||(Rx - fl(Rx))_g||; the last, the q-rotation terms
  // η ||q|| (||x̂|| + ||d||) and the f64 dot rounding are folded in per group through a: Σ_g ||q_g||
  // >= ||q|| (docs/certified.md, "Score error").
  const double a = eta * (x_norm + h + std::sqrt(e)) + 1e-12 * h;
  for (int g = 0; g < n_groups; ++g) {
    const double eps = (eg[g] + a) * (1 + 2 * eta + 1e-7);
    if (!(eps <= 65504.0)) {
      out[g] = 0x7c00;  // +inf: the bound is useless but still valid
      continue;
    }
    const float ef = (float)eps;
    out[g] = f16_round_up(ef < eps ? std::nextafter(ef, INFINITY) : ef);
  }
}

uint16_t cert_error_bound_f16(const float* x_rot, const float* x_hat, int head_dim, double x_norm, double eta) {
  uint16_t e;
  cert_error_bounds_f16(x_rot, x_hat, head_dim, 1, x_norm, eta, &e);
  return e;
}

void attn_certified_ref(const cert_kv_view& kv, const cert_query_view& qv, const cert_options& opt, float* out,
                        cert_step* steps) {
  const int hd = kv.head_dim, ng = qv.n_group, nq = qv.n_tokens * ng;
  const int neg = kv.k.err_groups, egl = hd / std::max(1, neg);  // K error groups, their length
  KVQ_ASSERT(hd <= 1024 && qv.pos0 + qv.n_tokens <= kv.n_pos && kv.k.n_segs > 0 && kv.v.n_segs > 0 && neg >= 1 &&
             hd % neg == 0 && kv.v.err_groups == 1);
  const int n_max = std::min(kv.n_pos, qv.pos0 + qv.n_tokens);
  const attn_spec& spec = qv.spec;
  const double scale = spec.scale, cap_round = softcap_rounding(spec);
  // V basis of the outputs: rotated when any V row is; when every V row is dense (original basis,
  // e.g. a head upgraded to f16 after clear()), no rotation and no rotation allowance at all.
  const bool v_rot = any_rotated(kv.v);
  const double eta_v = v_rot ? rotation_rounding_bound(*kv.v.rot) : 0.0;
  // ε of V row j as used by the bound: the stored one, plus for a dense row rotated on read the
  // f32 rotation error ||fl(R v̂) - R v̂|| <= η ||v̂|| <= η vn / (1 - η), vn = ||fl(R v̂)||.
  auto v_err = [&](int j, bool rotated_here, double vn) {
    const double e = err_at(kv.v.err, j);
    return rotated_here ? e + eta_v * vn / (1 - eta_v) * (1 + 1e-6) : e;
  };
  const bool always = std::isinf(opt.tol);
  thread_local scratch w;
  w.s.resize((size_t)nq * n_max);
  w.p.resize((size_t)nq * n_max);
  w.pe.resize((size_t)nq * n_max);
  w.d.resize((size_t)nq * n_max);
  w.qg.resize((size_t)nq * 2 * neg);
  w.c.resize((size_t)nq * n_max);
  w.kb.resize((size_t)kBlock * hd);
  w.kb_rot.resize(kBlock);
  w.kb_ce.resize(kBlock);
  w.kb_norm.resize(kBlock);
  w.vb_rot.resize(kBlock);
  w.vb.resize((size_t)kBlock * hd);
  w.o.resize((size_t)nq * hd);
  w.ex.resize(hd);
  w.o1.resize(hd);
  w.tmp.resize(hd);
  if ((int)w.slot.size() < n_max) w.slot.resize(n_max, -1);

  std::vector<query_ctx>& qs = w.qs;
  qs.resize(nq);
  for (int t = 0; t < qv.n_tokens; ++t)
    for (int g = 0; g < ng; ++g) {
      query_ctx& c = qs[t * ng + g];
      c.q = qv.q + t * qv.stride_t + (int64_t)g * hd;
      c.q_rot = qv.q_rot + t * qv.stride_t + (int64_t)g * hd;
      double a = 0;
      for (int i = 0; i < hd; ++i) a += (double)c.q[i] * c.q[i];
      c.qn = std::sqrt(a);
      double* qg = &w.qg[(size_t)(t * ng + g) * 2 * neg];
      for (int b = 0; b < 2; ++b)
        for (int e = 0; e < neg; ++e) {
          const float* x = (b ? c.q_rot : c.q) + e * egl;
          double s2 = 0;
          for (int i = 0; i < egl; ++i) s2 += (double)x[i] * x[i];
          qg[b * neg + e] = std::sqrt(s2);
        }
      c.qg = qg;
      const key_span r = spec.key_range(qv.pos0 + t);
      c.lo = std::max(0, r.lo);
      c.lim = std::min(kv.n_pos, r.hi);
    }
  int lo_min = n_max;
  for (const query_ctx& c : qs) lo_min = std::min(lo_min, c.lo);
  // δ_j of a compressed row for query c: |s_j - ŝ_j| <= δ_j (docs/certified.md, "Score error"):
  // scale Σ_g ||q_g|| ε_{j,g}, with q in the basis of the row (rotated: q_rot).
  auto delta_row = [&](const query_ctx& c, int j, bool rotated) {
    const uint16_t* e = kv.k.err + (size_t)j * neg;
    const double* qg = c.qg + (rotated ? neg : 0);
    double a = 0;
    for (int g = 0; g < neg; ++g) a += qg[g] * f16_to_f32(e[g]);
    return scale * a * (1 + 1e-6) + cap_round;
  };
  auto delta_of = [&](const query_ctx& c, int j) { return w.d[(size_t)(&c - qs.data()) * n_max + j]; };
  // p = softmax(s[0, n)), pe = p (e^δ - 1) and Z_lo / Z_hi for the score errors dl(j).
  auto softmax = [&](const double* s, double* p, double* pe, int n, auto&& dl) {
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
    double d = 0;
    for (int j = 0; j < n; ++j) d += (p[j] = std::exp(s[j] - m));
    const double inv = 1.0 / d;
    softmax_z z;
    z.lse = m + std::log(d);
    double om = 0, lo = 0, sp = 0;
    for (int j = 0; j < n; ++j) {
      p[j] *= inv;
      const double dj = dl(j);
      pe[j] = p_expm1(p[j], s[j] - z.lse, dj);
      if (p[j] == 0 && pe[j] == 0) continue;
      const double en = std::expm1(-dj);
      om -= p[j] * en;                                    // Σ p (1 - e^{-δ}): accurate near Z_lo = 1
      lo += p[j] * (dj < 0.5 ? 1 + en : std::exp(-dj));  // Σ p e^{-δ}: accurate when Z_lo is small
      sp += pe[j] - p[j] * en;                            // Σ p (e^{δ} - e^{-δ})
    }
    // a lower bound of Z (deflated for the rounding of these sums); 0 makes every term +inf
    z.zlo = std::max(0.0, std::min(lo, 1 - om) * (1 - 1e-9));
    z.one_minus_zlo = std::max(om, 1 - z.zlo);
    z.spread = sanitize(sp);
    return z;
  };
  auto onorm_of = [&](const double* o) {
    double a = 0;
    for (int i = 0; i < hd; ++i) a += o[i] * o[i];
    return std::sqrt(a);
  };
  auto dist_norm = [&](const float* v, const double* o, double* vnorm) {
    double a = 0, vv = 0;
    for (int i = 0; i < hd; ++i) {
      const double d = (double)v[i] - o[i];
      a += d * d;
      vv += (double)v[i] * v[i];
    }
    *vnorm = std::sqrt(vv);
    return std::sqrt(a);
  };

  // ---- pass K: scores of every query against the dequantized keys -------------------------
  row_reader rk{&kv.k, hd}, rv{&kv.v, hd};
  for (int r0 = lo_min; r0 < n_max; r0 += kBlock) {
    const int nb = std::min(kBlock, n_max - r0);
    for (int j = 0; j < nb; ++j) {
      w.kb_rot[j] = rk.load(r0 + j, &w.kb[(size_t)j * hd]);
      w.kb_ce[j] = rk.chan_err;
      if (rk.chan_err) w.kb_norm[j] = norm2(&w.kb[(size_t)j * hd], hd);
    }
    for (int qi = 0; qi < nq; ++qi) {
      const query_ctx& c = qs[qi];
      const int ne = std::min(nb, c.lim - r0);
      double* s = &w.s[(size_t)qi * n_max + r0];
      double* dd = &w.d[(size_t)qi * n_max + r0];
      const uint16_t* last_ce = nullptr;  // Σ_c |q_c| Δ_c of the last group seen
      double last_sum = 0;
      for (int j = std::max(0, c.lo - r0); j < ne; ++j) {
        const float* k = &w.kb[(size_t)j * hd];
        const float* qq = w.kb_rot[j] ? c.q_rot : c.q;  // original-basis rows: the exact query
        double a = 0;
        for (int i = 0; i < hd; ++i) a += (double)qq[i] * k[i];
        s[j] = spec.logit(a * scale);
        dd[j] = delta_row(c, r0 + j, w.kb_rot[j]);
        if (const uint16_t* ce = w.kb_ce[j]) {  // per element: Σ_c |q_c| Δ_c (docs/certified.md)
          if (ce != last_ce) {
            last_sum = 0;
            for (int i = 0; i < hd; ++i) last_sum += std::fabs((double)c.q[i]) * f16_to_f32(ce[i]);
            last_ce = ce;
          }
          const double de = scale * (last_sum + 1e-12 * c.qn * w.kb_norm[j]) * (1 + 1e-6) + cap_round;
          dd[j] = std::min(dd[j], de);
        }
      }
    }
  }
  // ---- softmax per query; pass V: ô; pass V again: the bound ------------------------------
  std::vector<softmax_z>& zs = w.zs;
  zs.resize(nq);
  for (int qi = 0; qi < nq; ++qi) {
    const query_ctx& c = qs[qi];
    const size_t at = (size_t)qi * n_max + c.lo;  // keys [lo, lim)
    zs[qi] = softmax(&w.s[at], &w.p[at], &w.pe[at], c.lim - c.lo, [&](int j) { return delta_of(c, c.lo + j); });
  }
  std::fill(w.o.begin(), w.o.end(), 0.0);
  for (int r0 = lo_min; r0 < n_max; r0 += kBlock) {
    const int nb = std::min(kBlock, n_max - r0);
    for (int j = 0; j < nb; ++j) rv.load_v(r0 + j, &w.vb[(size_t)j * hd], v_rot);
    for (int qi = 0; qi < nq; ++qi) {
      const int ne = std::min(nb, qs[qi].lim - r0);
      const double* p = &w.p[(size_t)qi * n_max + r0];
      double* o = &w.o[(size_t)qi * hd];
      for (int j = std::max(0, qs[qi].lo - r0); j < ne; ++j) {
        const float* v = &w.vb[(size_t)j * hd];
        for (int i = 0; i < hd; ++i) o[i] += p[j] * v[i];
      }
    }
  }
  std::vector<bound_terms>& bt = w.bt;
  bt.assign(nq, bound_terms{});
  for (int r0 = lo_min; r0 < n_max; r0 += kBlock) {
    const int nb = std::min(kBlock, n_max - r0);
    for (int j = 0; j < nb; ++j) w.vb_rot[j] = rv.load_v(r0 + j, &w.vb[(size_t)j * hd], v_rot);
    for (int qi = 0; qi < nq; ++qi) {
      const query_ctx& c = qs[qi];
      const int ne = std::min(nb, c.lim - r0);
      const double* o = &w.o[(size_t)qi * hd];
      const double* p = &w.p[(size_t)qi * n_max + r0];
      const double* pe = &w.pe[(size_t)qi * n_max + r0];
      float* cj = &w.c[(size_t)qi * n_max + r0];
      for (int j = std::max(0, c.lo - r0); j < ne; ++j) {
        double vn;
        const double dist = dist_norm(&w.vb[(size_t)j * hd], o, &vn);
        cj[j] = (float)add_token(bt[qi], zs[qi], p[j], pe[j], dist, v_err(r0 + j, w.vb_rot[j], vn), vn);
      }
    }
  }
  for (int qi = 0; qi < nq; ++qi) {
    bt[qi].onorm = onorm_of(&w.o[(size_t)qi * hd]);
    finish_bound(bt[qi], zs[qi], qs[qi].lim - qs[qi].lo, eta_v);
  }

  // ---- per query: decide, run the ladder, write the output ----------------------------------
  auto write_rotated = [&](const double* o, float* dst) {
    for (int i = 0; i < hd; ++i) w.tmp[i] = (float)o[i];
    if (v_rot) kv.v.rot->inverse(w.tmp.data());
    if (dst != w.tmp.data()) std::copy(w.tmp.begin(), w.tmp.end(), dst);
  };
  for (int t = 0; t < qv.n_tokens; ++t)
    for (int g = 0; g < ng; ++g) {
      const int qi = t * ng + g;
      const query_ctx& c = qs[qi];
      const int lo = c.lo, n = c.lim, count = n - lo;  // keys [lo, n)
      cert_step& st = steps[qi];
      st = cert_step{};
      st.n_keys = count;
      st.bound_fast = bt[qi].total;
      st.key_term = bt[qi].key;
      st.value_term = bt[qi].value;
      st.cross_term = bt[qi].cross;
      st.norm_fast = bt[qi].onorm;
      float* dst = out + t * qv.stride_t + (int64_t)g * hd;
      double ex_bound = 0;
      if (opt.measure) exact_attend(kv, c, spec, w.ex.data(), &ex_bound, w.sx);
      const double* o = &w.o[(size_t)qi * hd];
      const double target = opt.tol * bt[qi].onorm;
      if (always || bt[qi].total <= target) {
        st.stage = cert_stage::certified;
        st.bound = st.bound_fast;
        write_rotated(o, dst);
      } else {
        bool done = false;
        // ---- stage 1: recompute the tokens carrying most of the bound ----------------------
        const int budget = std::min(count, std::max(opt.stage1_min, (int)std::ceil(opt.stage1_fraction * count)));
        const double floor_ = (eta_v + 4 * 0x1p-24) * bt[qi].onorm;  // rounding alone exceeds the target
        if (target > floor_ && budget < count) {
          const float* cj = &w.c[(size_t)qi * n_max];
          w.order.resize(count);
          std::iota(w.order.begin(), w.order.end(), lo);
          std::partial_sort(w.order.begin(), w.order.begin() + budget, w.order.end(), [&](int a, int b) {
            const float x = std::isnan(cj[a]) ? INFINITY : cj[a], y = std::isnan(cj[b]) ? INFINITY : cj[b];
            return x > y;
          });
          const double need = bt[qi].total - 0.5 * target;
          double removed = 0;
          int chosen = 0;
          while (chosen < budget && removed < need) {
            const float x = cj[w.order[chosen++]];
            removed += std::isnan(x) ? INFINITY : x;
          }
          if (removed >= need) {
            w.vx.resize((size_t)chosen * hd);
            w.dx.resize(chosen);
            w.ex_err.resize(chosen);
            double* s = &w.s[(size_t)qi * n_max];
            double* p = &w.p[(size_t)qi * n_max];
            double* pe = &w.pe[(size_t)qi * n_max];
            for (int x = 0; x < chosen; ++x) {
              const int j = w.order[x];
              w.slot[j] = x;
              const uint16_t* kh = kv.host.k + (int64_t)j * kv.host.row_stride;
              const uint16_t* vh = kv.host.v + (int64_t)j * kv.host.row_stride;
              double a = 0, kk = 0;
              for (int i = 0; i < hd; ++i) {
                const double kx = f16_to_f32(kh[i]);
                a += (double)c.q[i] * kx;
                kk += kx * kx;
              }
              s[j] = spec.logit(a * scale);  // exact score, original basis (f64 dot of f32 x f16 values)
              w.dx[x] = 1e-12 * scale * c.qn * std::sqrt(kk) + cap_round;
              float* vr = &w.vx[(size_t)x * hd];
              for (int i = 0; i < hd; ++i) vr[i] = f16_to_f32(vh[i]);
              const double vn = norm2(vr, hd);
              if (v_rot) kv.v.rot->forward(vr);  // into the basis of the compressed rows: error <= η ||v||
              w.ex_err[x] = (float)((eta_v + 1e-12) * vn * (1 + 1e-6));
            }
            auto dl = [&](int i) {
              const int j = lo + i;
              return w.slot[j] >= 0 ? w.dx[w.slot[j]] : delta_of(c, j);
            };
            const softmax_z z = softmax(s + lo, p + lo, pe + lo, count, dl);
            row_reader r1{&kv.v, hd};
            bool rotated_here = false;  // of the last row() that was read from the fast tier
            auto row = [&](int j) -> const float* {
              if (w.slot[j] >= 0) return &w.vx[(size_t)w.slot[j] * hd];
              rotated_here = r1.load_v(j, w.vb.data(), v_rot);
              return w.vb.data();
            };
            std::fill(w.o1.begin(), w.o1.end(), 0.0);
            for (int j = lo; j < n; ++j) {
              const float* v = row(j);
              for (int i = 0; i < hd; ++i) w.o1[i] += p[j] * v[i];
            }
            bound_terms b1;
            for (int j = lo; j < n; ++j) {
              double vn;
              const double dist = dist_norm(row(j), w.o1.data(), &vn);
              const double ev = w.slot[j] >= 0 ? (double)w.ex_err[w.slot[j]] : v_err(j, rotated_here, vn);
              add_token(b1, z, p[j], pe[j], dist, ev, vn);
            }
            b1.onorm = onorm_of(w.o1.data());
            finish_bound(b1, z, count, eta_v);
            for (int x = 0; x < chosen; ++x) w.slot[w.order[x]] = -1;
            if (b1.total <= opt.tol * b1.onorm) {
              st.stage = cert_stage::partial;
              st.bound = b1.total;
              st.n_recomputed = chosen;
              write_rotated(w.o1.data(), dst);
              done = true;
            }
          }
        }
        // ---- stage 2: the whole head exactly from the host tier ----------------------------
        if (!done) {
          if (!opt.measure) exact_attend(kv, c, spec, w.ex.data(), &ex_bound, w.sx);
          for (int i = 0; i < hd; ++i) dst[i] = (float)w.ex[i];
          st.stage = cert_stage::exact;
          st.bound = ex_bound;
          st.n_recomputed = count;
        }
      }
      st.norm = norm2(dst, hd);
      if (opt.measure) {
        double e = 0;
        for (int i = 0; i < hd; ++i) e += (dst[i] - w.ex[i]) * (dst[i] - w.ex[i]);
        st.error = std::sqrt(e);
        write_rotated(o, w.tmp.data());  // the compressed-tier output as it would have been returned
        e = 0;
        for (int i = 0; i < hd; ++i) e += (w.tmp[i] - w.ex[i]) * (w.tmp[i] - w.ex[i]);
        st.error_fast = std::sqrt(e);
      }
    }
}

}  // namespace kvq
