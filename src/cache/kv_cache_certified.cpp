// The certified cache: a compressed fast tier with per-token error norms, an exact f16 host tier,
// certified attention with the fallback ladder (src/kernels/attn_certified_ref.cpp), adaptive
// precision per (layer, kv head), and statistics. See include/kvq/certified.h, docs/certified.md.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "cache/attend_plan.h"
#include "cache/kv_cache_certified_host.h"
#include "cache/kv_cache_impl.h"
#include "kvq/certified.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

constexpr float kF16Max = 65504.0f;

constexpr kv_format kDefaultK = kCertifiedDefaultK, kDefaultV = kCertifiedDefaultV;

// The next precision of a side whose bound keeps failing: int8 (per-channel: kivi2 -> kivi4 ->
// kivi8), then f16 (exact copies of the originals: that head's fast tier then costs as much as an
// f16 cache, traded for not reading the host tier). f when none.
kv_format upgrade_of(kv_format f) {
  switch (f) {
    case kv_format::q2: case kv_format::q3: case kv_format::q4: return kv_format::q8;
    case kv_format::q2a: case kv_format::q3a: case kv_format::q4a: return kv_format::q8a;
    case kv_format::kivi2: return kv_format::kivi4;
    case kv_format::kivi4: return kv_format::kivi8;
    case kv_format::q8: case kv_format::q8a: case kv_format::kivi8: return kv_format::f16;
    default: return f;
  }
}

bool is_per_channel(kv_format f) { return kv_traits(f).layout == kv_layout::per_channel; }

int default_group(const kv_cache_params& p) {
  return p.group_size == 0 ? (p.head_dim % 32 == 0 ? 32 : p.head_dim) : p.group_size;
}

// The format a side stores: the named one; a KIVI V side is its per-token kivi_v (as in the
// compressed cache).
kv_format cert_side_format(const kv_cache_params& p, bool is_v) {
  const kv_format f = side_format(p, is_v);
  return is_v && is_per_channel(f) ? kv_traits(f).kivi_v : f;
}

// f16 values per per-channel K group: head_dim scales, head_dim zeros and, unrotated, head_dim Δ
// (cert_segment::chan_err).
int channel_blob(const kv_cache_params& p, kv_format f) {
  return (side_rotation(p, f, true) == rotation_kind::none ? 3 : 2) * p.head_dim;
}

// Fast-tier bytes of one row of format f: codes, scales (per channel: the row's share of its
// group's blob) and the f16 ε (K: one per error group, V: one).
double cert_row_bytes(const kv_cache_params& p, kv_format f, bool is_k) {
  const int hd = p.head_dim;
  const double err = is_k ? 2.0 * (hd / cert_error_group(hd)) : 2.0;
  const double scales = is_per_channel(f) ? 2.0 * channel_blob(p, f) / p.kivi_group
                                          : 2.0 * kv_row_scale_count(f, hd, default_group(p));
  return (double)kv_code_bytes(f, hd) + scales + err;
}

// Bytes per token of the f16 cache with p's shape (the budget's unit).
double f16_bytes_per_token(const kv_cache_params& p) { return (double)p.n_layer * p.n_kv_head * 4.0 * p.head_dim; }

// Log-spaced histogram for medians / percentiles of positive ratios (64 bins per decade).
struct log_hist {
  static constexpr int kPerDecade = 64, kLo = -15, kHi = 15;
  static constexpr int kBins = (kHi - kLo) * kPerDecade + 2;  // + underflow, overflow
  std::vector<uint64_t> bins = std::vector<uint64_t>(kBins, 0);
  uint64_t n = 0;
  void add(double x) {
    int b;
    if (!(x > 0)) b = 0;
    else if (!std::isfinite(x)) b = kBins - 1;
    else b = std::clamp((int)std::floor((std::log10(x) - kLo) * kPerDecade) + 1, 0, kBins - 1);
    ++bins[b];
    ++n;
  }
  // Geometric center of the bin holding quantile q (0 when empty).
  double quantile(double q) const {
    if (n == 0) return 0;
    const uint64_t want = (uint64_t)std::ceil(q * (double)n);
    uint64_t acc = 0;
    for (int b = 0; b < kBins; ++b) {
      acc += bins[b];
      if (acc >= std::max<uint64_t>(want, 1)) {
        if (b == 0) return 0;
        if (b == kBins - 1) return INFINITY;
        return std::pow(10.0, kLo + (b - 0.5) / kPerDecade);
      }
    }
    return INFINITY;
  }
};

struct side_rows {  // one side (K or V) of one (layer, seq, kv head)
  struct seg {
    int row_begin;
    kv_format format;
    size_t code_off, scale_off;
    // KIVI residual: f16 copies of the originals (original basis) of the rows of a per-channel
    // group still being filled; quantized as one group when it holds kivi_group rows (flush_group).
    // Only the last segment can be pending.
    bool pending = false;
  };
  std::vector<uint8_t> codes;    // rows of each segment, contiguous
  std::vector<uint16_t> scales;  // per-token scales of each row / per-channel scales and zeros of each group
  std::vector<uint16_t> err;     // [n, err_groups] ε (f16, rounded up)
  std::vector<seg> segs;
  size_t bytes() const { return codes.capacity() + 2 * (scales.capacity() + err.capacity()); }
  size_t bytes_used() const { return codes.size() + 2 * (scales.size() + err.size()); }
};

struct head_adapt {  // per (layer, kv head)
  kv_format fk = kDefaultK, fv = kDefaultV;  // formats of new tokens
  uint64_t steps = 0, fallbacks = 0;
  double sum_rel = 0;
  uint64_t win_steps = 0, win_fallbacks = 0;
  double win_key = 0, win_value = 0;  // sums of relative key(+cross) / value terms
  double last_key = 0, last_value = 0;  // win_key / win_value of the last complete window
  uint64_t win_len = 0;               // steps of the current decision window (0: the default)
};

class kv_cache_certified_impl final : public kv_cache_certified {
 public:
  explicit kv_cache_certified_impl(const kv_cache_params& p);

  const kv_cache_params& params() const override { return p_; }
  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override;
  void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale, float* out,
              thread_pool& pool) override;
  void attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale, thread_pool& pool) override;
  int n_pos(int seq_id) const override {
    if (seq_id < 0 || seq_id >= p_.n_seq) return 0;
    return n_[(size_t)(p_.n_layer - 1) * p_.n_seq + seq_id];
  }
  void clear(int seq_id) override { truncate(seq_id, 0); }
  void truncate(int seq_id, int n_keep) override;
  size_t bytes() const override { return tier_bytes().fast + tier_bytes().host; }
  size_t bytes_used() const override {
    const auto t = tier_bytes();
    return t.fast_used + t.host_used;
  }
  kv_cache_stats stats() const override { return base_stats_; }
  std::string describe() const override;

  certified_tier_bytes tier_bytes() const override;
  certified_stats certified_statistics() const override;
  std::vector<certified_head_info> heads() const override;
  const std::vector<cert_step>& last_steps() const override { return last_steps_; }
  certified_report report() const override;

  // Fast-tier bytes of one row (codes, scales, ε; per-channel: its share of the group's scales and
  // zeros); is_k: the K side (err_groups ε per row).
  double row_bytes(kv_format f, bool is_k) const { return cert_row_bytes(p_, f, is_k); }
  // Fast-tier bytes per token at the formats new tokens get now (all layers, K + V).
  double fast_bytes_per_token() const {
    double b = 0;
    for (const head_adapt& a : adapt_) b += row_bytes(a.fk, true) + row_bytes(a.fv, false);
    return b;
  }

 private:
  size_t head_index(int il, int seq, int h) const { return ((size_t)il * p_.n_seq + seq) * p_.n_kv_head + h; }
  uint16_t* host_row(int il, int seq, int h, int pos) const {
    return reinterpret_cast<uint16_t*>(host_->data()) + (head_index(il, seq, h) * p_.n_ctx + pos) * 2 * p_.head_dim;
  }
  void check_layer_seq(const char* op, int il, int seq_id) const;
  void push_row(side_rows& s, kv_format f, const float* x, const float* x_rot, const float* x16r, double x_norm,
                double eta, int n_err);
  void flush_group(side_rows& s, kv_format f);
  void maybe_upgrade();
  void record(int il, int n_head);
  void attend_seqs(const char* op, int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                   thread_pool& pool);

  kv_cache_params p_;
  kv_format fk_ = kDefaultK, fv_ = kDefaultV;  // base formats
  int group_ = 0;
  int n_err_k_ = 1;  // ε per K row (error groups of cert_error_group(head_dim) elements)
  rotation rot_k_, rot_v_;
  double eta_k_ = 0, eta_v_ = 0;
  std::vector<side_rows> k_, v_;   // [n_layer, n_seq, n_kv_head]
  std::vector<int> n_;             // [n_layer, n_seq] positions stored
  std::vector<head_adapt> adapt_;  // [n_layer, n_kv_head]
  std::unique_ptr<host_region> host_;
  size_t fast_peak_ = 0, host_peak_ = 0;  // largest used bytes of each tier after an append
  // statistics
  kv_cache_stats base_stats_;
  certified_stats cs_;
  log_hist rel_hist_, ratio_hist_;
  double value_share_sum_ = 0;  // certified_stats::value_share_mean's sum and count
  uint64_t value_share_n_ = 0;
  std::vector<std::string> upgrades_;
  std::vector<cert_step> last_steps_;  // [batch tokens, n_head] of the last attend / attend_batch
  std::vector<attend_plan_seq> plan_in_;  // attend scratch (one call at a time per cache)
  attend_planner plan_;
  // scratch
  std::vector<float> xr_, x16_, qr_;
  std::vector<double> xn_;
};

kv_cache_certified_impl::kv_cache_certified_impl(const kv_cache_params& p) : p_(p) {
  // p is validated (make_kv_cache and kv_bytes_per_token call validate first)
  fk_ = cert_side_format(p, false);
  fv_ = cert_side_format(p, true);
  const int hd = p.head_dim;
  group_ = default_group(p);
  n_err_k_ = hd / cert_error_group(hd);
  // auto: Hadamard on every compressed side (int8 included: the default is rotated)
  rot_k_ = rotation::make(side_rotation(p, fk_, true), hd, p.seed);
  rot_v_ = rotation::make(side_rotation(p, fv_, true), hd, p.seed);
  eta_k_ = rotation_rounding_bound(rot_k_);
  eta_v_ = rotation_rounding_bound(rot_v_);
  const size_t heads = (size_t)p.n_layer * p.n_seq * p.n_kv_head;
  k_.resize(heads);
  v_.resize(heads);
  n_.assign((size_t)p.n_layer * p.n_seq, 0);
  adapt_.assign((size_t)p.n_layer * p.n_kv_head, head_adapt{fk_, fv_});
  if (p.certify_budget > 0 && fast_bytes_per_token() > p.certify_budget * f16_bytes_per_token(p))
    fail_input("[kv_cache] certified cache: certify_budget (--kv-cert-budget) " + std::to_string(p.certify_budget) +
               " of f16's " + std::to_string((long long)f16_bytes_per_token(p)) + " bytes/token is below the " +
               std::to_string(fast_bytes_per_token()) + " bytes/token the fast tier needs at K " + kv_traits(fk_).name +
               " / V " + kv_traits(fv_).name);
  host_ = std::make_unique<host_region>(heads * p.n_ctx * 2 * hd * sizeof(uint16_t), p.host_dir);
}

void kv_cache_certified_impl::check_layer_seq(const char* op, int il, int seq_id) const {
  kvq::check_layer_seq(p_, op, il, seq_id);
}

std::string kv_cache_certified_impl::describe() const {
  auto side = [&](kv_format f, const rotation& r) {
    std::string d = kv_traits(f).name;
    if (is_per_channel(f))
      d += std::string(" (") + rotation_name(r.kind) + ", per-channel T" + std::to_string(p_.kivi_group) + ")";
    else if (kv_traits(f).layout != kv_layout::dense)
      d += std::string(" (") + rotation_name(r.kind) + ", g" + std::to_string(group_) + ")";
    return d;
  };
  char tol[32], budget[64] = "";
  std::snprintf(tol, sizeof tol, "%g", p_.certify_tol);
  if (p_.certify_budget > 0)
    std::snprintf(budget, sizeof budget, "; budget %g of f16 (%.0f bytes/token)", p_.certify_budget,
                  p_.certify_budget * f16_bytes_per_token(p_));
  const std::string sink = p_.sink > 0 ? "; sink " + std::to_string(p_.sink) + " f16" : "";
  return "certified: K " + side(fk_, rot_k_) + " / V " + side(fv_, rot_v_) + sink + "; tol " + tol + budget + "; host f16 " +
         (p_.host_dir.empty() ? std::string("in RAM") : "file in " + p_.host_dir) +
         (p_.certify_measure ? "; measuring" : "");
}

// x: the f16 original (original basis); x_rot = fl(R x); x16r = f16(x_rot). Per-token formats
// quantize x16r (rotated basis, as the compressed cache); dense formats keep x itself (original
// basis: f16 rows are exact copies, ε only covers the rotation of V rows when they are read);
// per-channel formats (K only) keep x as an f16 row of the pending group, quantized with the rest
// of its group by flush_group. n_err: ε per row (error groups).
void kv_cache_certified_impl::push_row(side_rows& s, kv_format f, const float* x, const float* x_rot,
                                       const float* x16r, double x_norm, double eta, int n_err) {
  const int hd = p_.head_dim;
  const auto& t = kv_traits(f);
  const int r = (int)(s.err.size() / n_err);
  const bool pc = t.layout == kv_layout::per_channel;
  if (!s.segs.empty() && s.segs.back().pending && !pc) s.segs.back().pending = false;  // f16 rows as they are
  if (pc) {
    if (s.segs.empty() || !s.segs.back().pending)
      s.segs.push_back({r, kv_format::f16, s.codes.size(), s.scales.size(), true});
  } else if (s.segs.empty() || s.segs.back().format != f) {
    s.segs.push_back({r, f, s.codes.size(), s.scales.size()});
  }
  const kv_format sf = pc ? kv_format::f16 : f;  // stored now
  const size_t cb = kv_code_bytes(sf, hd), sb = (size_t)kv_row_scale_count(sf, hd, group_);
  const size_t c0 = s.codes.size(), s0 = s.scales.size(), e0 = s.err.size();
  s.codes.resize(c0 + cb);
  s.scales.resize(s0 + sb);
  s.err.resize(e0 + n_err);
  float xh[1024];
  uint8_t* c = s.codes.data() + c0;
  if (t.layout == kv_layout::per_token) {
    quantize_row_ref(f, x16r, hd, group_, c, s.scales.data() + s0);
    dequantize_row_ref(f, c, s.scales.data() + s0, hd, group_, xh);
    cert_error_bounds_f16(x_rot, xh, hd, n_err, x_norm, eta, &s.err[e0]);
    return;
  }
  if (sf == kv_format::f32) {
    std::memcpy(c, x, (size_t)hd * 4);
    std::memcpy(xh, x, (size_t)hd * 4);
  } else {
    auto* h = reinterpret_cast<uint16_t*>(c);
    for (int i = 0; i < hd; ++i) {
      h[i] = sf == kv_format::f16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
      xh[i] = sf == kv_format::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
    }
  }
  // ||x - x̂|| (+ dot rounding) in the original basis: K rows are scored with the exact query; the
  // kernel adds the rotation allowance of a V row it rotates when read (attn_certified_ref.cpp)
  cert_error_bounds_f16(x, xh, hd, n_err, x_norm, 0.0, &s.err[e0]);
  if (pc && r + 1 - s.segs.back().row_begin == p_.kivi_group) flush_group(s, f);
}

// Quantizes the pending group (kivi_group f16 rows of originals, the last segment) per channel in
// the head's K format: KIVI's per-channel scale and zero over the group (quantize_channel_group_ref),
// in the K basis (rot_k_: none unless a rotation was asked for), and replaces the rows' ε.
void kv_cache_certified_impl::flush_group(side_rows& s, kv_format fk) {
  const int hd = p_.head_dim, T = p_.kivi_group;
  side_rows::seg g = s.segs.back();
  s.segs.pop_back();
  // the originals of the group's rows
  thread_local std::vector<float> x, xr, x16r, xh;
  thread_local std::vector<uint8_t> codes;
  x.resize((size_t)T * hd);
  const auto* h = reinterpret_cast<const uint16_t*>(s.codes.data() + g.code_off);
  for (size_t i = 0; i < (size_t)T * hd; ++i) x[i] = f16_to_f32(h[i]);
  xr = x;
  rot_k_.forward_n(xr.data(), T);
  x16r.resize(xr.size());
  for (size_t i = 0; i < xr.size(); ++i) x16r[i] = f16_to_f32(f32_to_f16(xr[i]));
  const size_t row = kv_code_bytes(fk, hd);
  codes.resize((size_t)T * row);
  uint16_t sc[3 * 1024];
  const int blob = channel_blob(p_, fk);
  quantize_channel_group_ref(fk, x16r.data(), T, hd, codes.data(), sc);
  xh.resize(x.size());
  dequantize_channel_group_ref(fk, codes.data(), sc, T, hd, xh.data());
  if (blob == 3 * hd)  // unrotated: Δ_c = max |x - x̂| per channel over the group (the per-element bound)
    for (int i = 0; i < hd; ++i) {
      double m = 0;
      for (int j = 0; j < T; ++j) m = std::max(m, std::fabs((double)x[(size_t)j * hd + i] - xh[(size_t)j * hd + i]));
      const float mf = (float)m;
      sc[2 * hd + i] = m <= 65504.0 ? f16_round_up(mf < m ? std::nextafter(mf, INFINITY) : mf) : 0x7c00;
    }
  for (int j = 0; j < T; ++j) {
    double xn = 0;
    for (int i = 0; i < hd; ++i) xn += (double)x[(size_t)j * hd + i] * x[(size_t)j * hd + i];
    cert_error_bounds_f16(&xr[(size_t)j * hd], &xh[(size_t)j * hd], hd, n_err_k_, std::sqrt(xn), eta_k_,
                          &s.err[(size_t)(g.row_begin + j) * n_err_k_]);
  }
  s.codes.resize(g.code_off);
  const bool extend = !s.segs.empty() && s.segs.back().format == fk &&
                      (g.row_begin - s.segs.back().row_begin) % T == 0;
  if (!extend) s.segs.push_back({g.row_begin, fk, s.codes.size(), s.scales.size()});
  s.codes.insert(s.codes.end(), codes.begin(), codes.end());
  s.scales.insert(s.scales.end(), sc, sc + blob);
}

void kv_cache_certified_impl::append(int il, int seq_id, int n_tokens, const float* k, const float* v) {
  check_layer_seq("append", il, seq_id);
  int& n = n_[(size_t)il * p_.n_seq + seq_id];
  check_append_order(il, seq_id, n_tokens, p_.n_layer, p_.n_ctx, n,
                     il > 0 ? n_[(size_t)(il - 1) * p_.n_seq + seq_id] : 0, n_pos(seq_id));
  if (n_tokens == 0) return;
  const int hd = p_.head_dim, nh = p_.n_kv_head;
  const size_t rows = (size_t)n_tokens * nh, m = rows * hd;
  // 1. validate and transform everything first: x16_ = f16 originals, xr_ = fl(R x), xn_ = ||x||
  x16_.resize(2 * m);
  xr_.resize(2 * m);
  xn_.resize(2 * rows);
  for (int side = 0; side < 2; ++side) {
    const float* x = side == 0 ? k : v;
    const rotation& rot = side == 0 ? rot_k_ : rot_v_;
    float* h = &x16_[side * m];
    float* r = &xr_[side * m];
    for (size_t i = 0; i < m; ++i) {
      const float f = f16_to_f32(f32_to_f16(x[i]));
      if (!std::isfinite(f))
        fail_input(std::string("[kv_cache] append: ") + (side ? "V" : "K") + " value " + std::to_string(x[i]) +
                   " at layer " + std::to_string(il) + ", position " + std::to_string(n + i / (nh * hd)) +
                   ", kv head " + std::to_string(i / hd % nh) + ", channel " + std::to_string(i % hd) +
                   " is not representable in f16 (the certified host tier stores f16 originals)");
      h[i] = f;
    }
    std::memcpy(r, h, m * sizeof(float));
    rot.forward_n(r, (int64_t)rows);
    for (size_t i = 0; i < m; ++i)
      if (!(std::fabs(r[i]) <= kF16Max))
        fail_input(std::string("[kv_cache] append: ") + (side ? "V" : "K") + " value " + std::to_string(r[i]) +
                   " at layer " + std::to_string(il) + ", position " + std::to_string(n + i / (nh * hd)) +
                   ", kv head " + std::to_string(i / hd % nh) + " exceeds the f16 range (65504) after rotation");
    for (size_t j = 0; j < rows; ++j) {
      double a = 0;
      for (int i = 0; i < hd; ++i) a += (double)h[j * hd + i] * h[j * hd + i];
      xn_[side * rows + j] = std::sqrt(a);
    }
  }
  // 2. adaptive precision decisions (at layer 0: every layer's windows are complete), then store
  if (il == 0) maybe_upgrade();
  float x16r[1024];
  for (int t = 0; t < n_tokens; ++t)
    for (int hh = 0; hh < nh; ++hh) {
      const size_t j = (size_t)t * nh + hh, hi = head_index(il, seq_id, hh);
      uint16_t* host = host_row(il, seq_id, hh, n + t);
      for (int i = 0; i < hd; ++i) {
        host[i] = f32_to_f16(x16_[j * hd + i]);
        host[hd + i] = f32_to_f16(x16_[m + j * hd + i]);
      }
      const head_adapt& a = adapt_[(size_t)il * nh + hh];
      const bool sink = n + t < p_.sink;  // the sink window: f16 rows in the fast tier
      for (int side = 0; side < 2; ++side) {
        const float* r = &xr_[side * m + j * hd];
        for (int i = 0; i < hd; ++i) x16r[i] = f16_to_f32(f32_to_f16(r[i]));
        push_row(side == 0 ? k_[hi] : v_[hi], sink ? kv_format::f16 : side == 0 ? a.fk : a.fv, &x16_[side * m + j * hd], r, x16r,
                 xn_[side * rows + j], side == 0 ? eta_k_ : eta_v_, side == 0 ? n_err_k_ : 1);
      }
    }
  n += n_tokens;
  if (il == p_.n_layer - 1) {
    const certified_tier_bytes tb = tier_bytes();
    fast_peak_ = tb.fast_used_peak;
    host_peak_ = tb.host_used_peak;
  }
}

void kv_cache_certified_impl::truncate(int seq_id, int n_keep) {
  check_layer_seq("truncate", 0, seq_id);
  if (n_keep < 0) fail_input("[kv_cache] truncate: n_pos must be >= 0, got " + std::to_string(n_keep));
  const int hd = p_.head_dim;
  for (int il = 0; il < p_.n_layer; ++il) {
    int& n = n_[(size_t)il * p_.n_seq + seq_id];
    if (n_keep >= n) continue;
    n = n_keep;
    for (int h = 0; h < p_.n_kv_head; ++h)
      for (auto* s : {&k_[head_index(il, seq_id, h)], &v_[head_index(il, seq_id, h)]}) {
        while (!s->segs.empty() && s->segs.back().row_begin >= n_keep) s->segs.pop_back();
        if (s->segs.empty()) {
          s->codes.clear();
          s->scales.clear();
        } else {
          const auto& g = s->segs.back();
          const size_t keep = (size_t)(n_keep - g.row_begin);
          s->codes.resize(g.code_off + keep * kv_code_bytes(g.format, hd));
          // a per-channel segment keeps the scales of its groups, the last one possibly partial
          // (its rows keep their codes and ε; new rows start a pending group of their own)
          s->scales.resize(g.scale_off + (is_per_channel(g.format)
                                              ? (keep + p_.kivi_group - 1) / p_.kivi_group * channel_blob(p_, g.format)
                                              : keep * kv_row_scale_count(g.format, hd, group_)));
        }
        s->err.resize((size_t)n_keep * (s == &k_[head_index(il, seq_id, h)] ? n_err_k_ : 1));
      }
  }
}

void kv_cache_certified_impl::attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q,
                                     float scale, float* out, thread_pool& pool) {
  const attend_seq one{seq_id, pos0, n_tokens, q, out};
  attend_seqs("attend", il, &one, 1, n_head, scale, pool);
}

void kv_cache_certified_impl::attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                                           thread_pool& pool) {
  attend_seqs("attend_batch", il, seqs, n_seqs, n_head, scale, pool);
}

void kv_cache_certified_impl::attend_seqs(const char* op, int il, const attend_seq* seqs, int n_seqs, int n_head,
                                          float scale, thread_pool& pool) {
  check_attend_seqs(p_, op, il, seqs, n_seqs, n_head, [&](int seq) { return n_[(size_t)il * p_.n_seq + seq]; });
  if (n_seqs == 0) return;
  const int hd = p_.head_dim, nh = p_.n_kv_head, ng = n_head / nh;
  // Work items (attend_plan.h): (sequence, kv head, query tile), one chunk each (the certificate
  // needs every key of a query at once); the tile bounds the per-thread score scratch.
  plan_in_.resize(n_seqs);
  for (int b = 0; b < n_seqs; ++b) {
    const int64_t n_max = (int64_t)seqs[b].pos0 + seqs[b].n_tokens;
    plan_in_[b].n_tokens = seqs[b].n_tokens;
    plan_in_[b].max_tile = (int)std::clamp<int64_t>((int64_t(1) << 19) / std::max<int64_t>(1, ng * n_max), 1, 16);
  }
  attend_plan_options popt;
  popt.split = false;
  plan_.plan(plan_in_.data(), n_seqs, nh, n_head, hd, pool.size(), popt);
  const size_t nq = (size_t)plan_.n_tokens() * n_head;
  qr_.resize(nq * hd);
  for (int b = 0; b < n_seqs; ++b)
    std::memcpy(&qr_[(size_t)plan_.tok0(b) * n_head * hd], seqs[b].q, (size_t)seqs[b].n_tokens * n_head * hd * sizeof(float));
  rot_k_.forward_n(qr_.data(), (int64_t)nq);
  last_steps_.resize(nq);
  const attn_spec spec = kv_layer_spec(p_, il, scale);
  cert_options opt;
  opt.tol = p_.certify_tol;
  opt.measure = p_.certify_measure;
  // always threaded: certified items are heavy (scores, bounds, exact fallbacks)
  plan_.run(pool, thread_pool::min_parallel_work, [&](const attend_item& w) {
    thread_local std::vector<cert_segment> segs;
    thread_local std::vector<cert_step> steps;
    const attend_seq& a = seqs[w.seq];
    const int h = w.kv_head, ta = w.ta, tb = w.tb;
    const size_t hi = head_index(il, a.seq_id, h);
    segs.clear();
    cert_kv_view kv;
    for (auto [view, rows, rot] : {std::tuple{&kv.k, &k_[hi], &rot_k_}, std::tuple{&kv.v, &v_[hi], &rot_v_}}) {
      view->err = rows->err.data();
      view->rot = rot;
      view->n_segs = (int)rows->segs.size();
    }
    kv.k.err_groups = n_err_k_;
    for (const auto* rows : {&k_[hi], &v_[hi]})
      for (const auto& g : rows->segs) {
        cert_segment cs;
        cs.row_begin = g.row_begin;
        cs.format = g.format;
        cs.codes = rows->codes.data() + g.code_off;
        cs.code_stride = (int64_t)kv_code_bytes(g.format, hd);
        cs.scales = rows->scales.data() + g.scale_off;
        const bool pc = is_per_channel(g.format);
        cs.scale_stride = pc ? channel_blob(p_, g.format) : kv_row_scale_count(g.format, hd, group_);
        cs.group = pc ? p_.kivi_group : group_;
        // per-channel K without a rotation is in the original basis (scored with q, Δ per channel)
        cs.rotated = kv_traits(g.format).layout != kv_layout::dense && !(pc && rot_k_.kind == rotation_kind::none);
        cs.chan_err = pc && cs.scale_stride == 3 * hd;
        segs.push_back(cs);
      }
    kv.k.segs = segs.data();
    kv.v.segs = segs.data() + kv.k.n_segs;
    kv.host.k = host_row(il, a.seq_id, h, 0);
    kv.host.v = kv.host.k + hd;
    kv.host.row_stride = 2 * hd;
    kv.n_pos = n_[(size_t)il * p_.n_seq + a.seq_id];
    kv.head_dim = hd;
    cert_query_view qv;
    const size_t off = ((size_t)ta * n_head + (size_t)h * ng) * hd;
    const size_t qbase = (size_t)plan_.tok0(w.seq) * n_head * hd;  // the sequence's queries in qr_
    qv.q = a.q + off;
    qv.q_rot = qr_.data() + qbase + off;
    qv.stride_t = (int64_t)n_head * hd;
    qv.n_tokens = tb - ta;
    qv.n_group = ng;
    qv.head_dim = hd;
    qv.pos0 = a.pos0 + ta;
    qv.spec = spec;  // the window honoured; the tiers still keep every position (no ring)
    steps.resize((size_t)(tb - ta) * ng);
    attn_certified_ref(kv, qv, opt, a.out + off, steps.data());
    cert_step* dst = &last_steps_[(size_t)plan_.tok0(w.seq) * n_head];
    for (int t = ta; t < tb; ++t)
      for (int g = 0; g < ng; ++g) dst[(size_t)t * n_head + h * ng + g] = steps[(size_t)(t - ta) * ng + g];
  });
  record(il, n_head);
}

void kv_cache_certified_impl::record(int il, int n_head) {
  const int ng = n_head / p_.n_kv_head;
  ++base_stats_.attend_calls;
  for (size_t i = 0; i < last_steps_.size(); ++i) {
    const cert_step& s = last_steps_[i];
    head_adapt& a = adapt_[(size_t)il * p_.n_kv_head + (int)(i % n_head) / ng];
    const bool fell = s.stage != cert_stage::certified;
    const double rel = s.norm_fast > 0 ? s.bound_fast / s.norm_fast : INFINITY;
    ++cs_.steps;
    switch (s.stage) {
      case cert_stage::certified: ++cs_.certified; ++base_stats_.heads_certified; break;
      case cert_stage::partial:
        ++cs_.partial;
        ++base_stats_.heads_partial;
        cs_.tokens_recomputed += s.n_recomputed;
        break;
      default: ++cs_.exact; ++base_stats_.heads_exact; break;
    }
    rel_hist_.add(rel);
    ++a.steps;
    a.fallbacks += fell;
    a.sum_rel += std::min(rel, 1e30);
    ++a.win_steps;
    a.win_fallbacks += fell;
    const double terms = s.key_term + s.cross_term + s.value_term;
    if (terms > 0 && std::isfinite(terms)) {
      value_share_sum_ += s.value_term / terms;
      ++value_share_n_;
    }
    if (s.norm_fast > 0) {
      a.win_key += std::min((s.key_term + s.cross_term) / s.norm_fast, 1e30);
      a.win_value += std::min(s.value_term / s.norm_fast, 1e30);
    }
    if (s.error_fast >= 0) {
      if (s.bound_fast < s.error_fast || s.bound < s.error) ++cs_.violations;
      if (s.error_fast > 0) {
        const double r = s.bound_fast / s.error_fast;
        ratio_hist_.add(r);
        cs_.ratio_min = cs_.measured == 0 ? r : std::min(cs_.ratio_min, r);
        ++cs_.measured;
      }
    }
  }
}

void kv_cache_certified_impl::maybe_upgrade() {
  if (!p_.certify_adapt || !(p_.certify_tol > 0) || std::isinf(p_.certify_tol)) return;
  // A decision per window of steps; after an upgrade the next window is 4x longer, so that the
  // tokens stored at the new precision (not the older ones, which keep their error) decide it.
  // The heads whose window ended and that fell back in at least half of it are upgraded in order of
  // their fallback share (then their relative bound), each only while the fast tier stays within
  // the byte budget (docs/certified.md, "Adaptive precision", "Byte budget").
  constexpr uint64_t kWindow = 64;
  struct cand {
    size_t i;
    double share, rel;
  };
  std::vector<cand> cands;
  for (size_t i = 0; i < adapt_.size(); ++i) {
    head_adapt& a = adapt_[i];
    if (a.win_steps < (a.win_len ? a.win_len : kWindow)) continue;
    a.win_len = kWindow;
    if (2 * a.win_fallbacks >= a.win_steps)  // at least half of the recent steps fell back
      cands.push_back({i, (double)a.win_fallbacks / a.win_steps, (a.win_key + a.win_value) / a.win_steps});
    a.last_key = a.win_key;
    a.last_value = a.win_value;
    a.win_steps = a.win_fallbacks = 0;
    a.win_key = a.win_value = 0;
  }
  std::stable_sort(cands.begin(), cands.end(),
                   [](const cand& x, const cand& y) { return x.share != y.share ? x.share > y.share : x.rel > y.rel; });
  const double limit = p_.certify_budget > 0 ? p_.certify_budget * f16_bytes_per_token(p_) : INFINITY;
  double bytes = fast_bytes_per_token();
  for (const cand& c : cands) {
    head_adapt& a = adapt_[c.i];
    // the side with the larger share of the recent bound first (window sums of this decision)
    const bool key_first = a.last_key >= a.last_value;
    kv_format* first = key_first ? &a.fk : &a.fv;
    kv_format* second = key_first ? &a.fv : &a.fk;
    kv_format* side = upgrade_of(*first) != *first ? first : upgrade_of(*second) != *second ? second : nullptr;
    if (!side) continue;
    const bool is_k = side == &a.fk;
    const kv_format from = *side, to = upgrade_of(from);
    const double grow = row_bytes(to, is_k) - row_bytes(from, is_k);
    if (bytes + grow > limit * (1 + 1e-12)) {
      ++cs_.upgrades_refused;
      continue;
    }
    bytes += grow;
    *side = to;
    a.win_len = 4 * kWindow;
    ++cs_.heads_upgraded;
    const int il = (int)(c.i / p_.n_kv_head), h = (int)(c.i % p_.n_kv_head);
    upgrades_.push_back("layer " + std::to_string(il) + " kv head " + std::to_string(h) + " " + (is_k ? "K " : "V ") +
                        kv_traits(from).name + "->" + kv_traits(to).name);
  }
}

certified_tier_bytes kv_cache_certified_impl::tier_bytes() const {
  certified_tier_bytes t;
  for (const auto* sides : {&k_, &v_})
    for (const auto& s : *sides) {
      t.fast += s.bytes();
      t.fast_used += s.bytes_used();
    }
  t.host = host_->size();
  for (int n : n_) t.host_used += (size_t)n * p_.n_kv_head * 2 * p_.head_dim * sizeof(uint16_t);
  t.host_file_backed = host_->file_backed();
  t.fast_used_peak = std::max(fast_peak_, t.fast_used);
  t.host_used_peak = std::max(host_peak_, t.host_used);
  return t;
}

certified_stats kv_cache_certified_impl::certified_statistics() const {
  certified_stats s = cs_;
  s.rel_bound_median = rel_hist_.quantile(0.5);
  s.rel_bound_p99 = rel_hist_.quantile(0.99);
  s.ratio_median = ratio_hist_.quantile(0.5);
  s.ratio_p99 = ratio_hist_.quantile(0.99);
  s.value_share_mean = value_share_n_ ? value_share_sum_ / (double)value_share_n_ : 0.0;
  return s;
}

std::vector<certified_head_info> kv_cache_certified_impl::heads() const {
  std::vector<certified_head_info> r;
  for (int il = 0; il < p_.n_layer; ++il)
    for (int h = 0; h < p_.n_kv_head; ++h) {
      const head_adapt& a = adapt_[(size_t)il * p_.n_kv_head + h];
      certified_head_info i;
      i.layer = il;
      i.kv_head = h;
      i.k_format = a.fk;
      i.v_format = a.fv;
      i.steps = a.steps;
      i.fallbacks = a.fallbacks;
      i.mean_rel_bound = a.steps ? a.sum_rel / a.steps : 0;
      r.push_back(i);
    }
  return r;
}

certified_report kv_cache_certified_impl::report() const {
  certified_report r;
  r.type_k = kv_cache_type_name(p_.type_k);
  r.type_v = kv_cache_type_name(p_.type_v);
  r.describe = describe();
  r.n_layer = p_.n_layer;
  r.n_kv_head = p_.n_kv_head;
  r.head_dim = p_.head_dim;
  r.tol = p_.certify_tol;
  r.measure = p_.certify_measure;
  r.stats = certified_statistics();
  r.tiers = tier_bytes();
  r.fast_bytes_per_token = fast_bytes_per_token();
  r.f16_bytes_per_token = f16_bytes_per_token(p_);
  r.budget = p_.certify_budget;
  r.host_bytes_per_token = (double)p_.n_layer * p_.n_kv_head * 4.0 * p_.head_dim;
  r.upgrades = upgrades_;
  return r;
}

}  // namespace

bool is_certified(const kv_cache_params& p) {
  if (p.type_k == kv_cache_type::certified || p.type_v == kv_cache_type::certified) return true;
  if (!p.certify) return false;
  // certify on dense/dense (e.g. the f16 reference a tool derives from these params) is the dense cache
  kv_format fk, fv;
  const bool dk = kv_cache_type_format(p.type_k, &fk) && kv_traits(fk).layout == kv_layout::dense;
  const bool dv = kv_cache_type_format(p.type_v, &fv) && kv_traits(fv).layout == kv_layout::dense;
  return !(dk && dv);
}

std::unique_ptr<kv_cache_certified> make_kv_cache_certified(const kv_cache_params& p) {
  validate(p);
  return std::make_unique<kv_cache_certified_impl>(p);
}

double kv_bytes_per_token_certified(const kv_cache_params& p) {
  validate(p);
  return (double)p.n_layer * p.n_kv_head *
             (cert_row_bytes(p, cert_side_format(p, false), true) + cert_row_bytes(p, cert_side_format(p, true), false)) +
         f16_bytes_per_token(p);
}

const kv_cache_certified* as_certified(const kv_cache& c) { return dynamic_cast<const kv_cache_certified*>(&c); }

void append_certified_report(const kv_cache& c, std::vector<certified_report>& out) {
  const kv_cache_certified* cc = as_certified(c);
  if (!cc) return;
  certified_report r = cc->report();
  // a cache that never stored a token was made to validate params
  if (r.stats.steps == 0 && r.tiers.host_used_peak == 0) return;
  out.push_back(std::move(r));
}

}  // namespace kvq
