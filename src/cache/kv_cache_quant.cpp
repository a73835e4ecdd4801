// The compressed KV cache: per-token / KIVI formats in a rotated basis, exact f16 sink and recent
// windows, optional per-channel scale λ, fused attention merged through attn_state.
//
// Positions of a sequence (per layer) are split in three parts, identical for K and V:
//   [0, sink)                   exact (f16), never compressed
//   [sink, sink + n_comp)       the body, compressed in whole units of U tokens (U = kivi_group
//                               when either side is KIVI, else 1)
//   [sink + n_comp, n)          the exact tail (f16), at most min_tail + U - 1 tokens
// with n_comp = U * floor(max(0, n - sink - min_tail) / U), never decreasing on append. A unit is
// quantized from the f16-rounded transformed values only, so the stored codes do not depend on how
// the tokens arrived. See docs/formats.md ("Exact windows").
// The body of a sliding-window layer is a ring of whole units (ring_[il] rows, a multiple of U,
// at least window - 1 + n_ubatch): body row r lives in slot r % ring, and rows [body_lo, n_comp)
// are held (docs/formats.md, "Sliding-window layers").
// A prefill batch's queries see the exact windows relative to their own positions: the rows an append
// compresses while one of its queries still has them in its exact window are also kept exact, in one
// scratch per sequence that the next append of that sequence reuses (fresh_rows; kv_cache.h, append).
// Channel statistics (channel_scale, k_channel_scale) are calibrated on a sequence's first cal_n_
// positions (kv_cache_params::channel_calib) whatever appends brought them: until they have all
// arrived they are kept as given in per-(layer, sequence) staging rows (f16 rows and their residuals,
// stage_pos_bytes) and queries attend the f16 rows exactly, as the f16 cache; the append that
// completes them calibrates and stores them, as given, through the ordinary path.
// Paged (page_size > 0): the body of every global layer lives in the page pool (kv_page_pool.h), per
// layer [n_pages, n_kv_head, page_size, code_row] (scales alike, per page the scale units of its
// rows); body row r of a sequence is on page table[r / page_size]. Attention passes the kernels the
// same views as the contiguous body, gathering a view's rows from its pages when it spans several.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "cache/attend_plan.h"
#include "cache/kv_cache_impl.h"
#include "cache/kv_page_pool.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"
#include "quant/f16_round.h"

namespace kvq {

namespace {

constexpr float kF16Max = 65504.0f;

float load_elem(const uint8_t* p, kv_elem e, int i) {
  switch (e) {
    case kv_elem::f32: return reinterpret_cast<const float*>(p)[i];
    case kv_elem::f16: return f16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
  }
}
void store_elems(uint8_t* p, kv_elem e, const float* x, int n) {
  switch (e) {
    case kv_elem::f32: std::memcpy(p, x, (size_t)n * 4); break;
    case kv_elem::f16:
      for (int i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(p)[i] = f32_to_f16(x[i]);
      break;
    default:
      for (int i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(p)[i] = f32_to_bf16(x[i]);
      break;
  }
}
// Channels whose position 0 is at least this large are staged as the distance to it (stage_ref),
// the others as given (ref 0): f16 rounds |x| >= 8 in steps of 2^-7 or coarser, and x - ref is exact
// in f32 (so is ref + d) while x stays within [ref / 2, 2 ref] (Sterbenz), which a channel's bias
// keeps it in; a channel near 0 with ref 0 is split exactly as well.
constexpr float kStageRefMin = 8.0f;

// A staged value x (|x| <= 65504) as f16(x) and the residual x - f16(x) in units of 2^(E - 24),
// E = the exponent of f16(x)'s binade (-14 below the normal range). The residual is at most half an
// f16 step, 2^(E - 11), so it fits in 14 bits, and x's own step (2^(E - 23) or, when f16(x)
// rounded up to 2^E, 2^(E - 24)) makes it a whole number: stage_join returns x bit for bit for
// |x| >= 2^-15, and within 2^-39 below (x's step is finer there than 2^-38).
// 2^(24 - E) and 2^(E - 24) for the binade of f16 value h (E = -14 for zero and subnormals).
float stage_unit_inv(uint16_t h) {
  const uint32_t e = (h >> 10) & 0x1f;
  return f32_from_bits((127 + 24 - (e == 0 ? -14 : (int)e - 15)) << 23);
}
float stage_unit(uint16_t h) {
  const uint32_t e = (h >> 10) & 0x1f;
  return f32_from_bits((127 - 24 + (e == 0 ? -14 : (int)e - 15)) << 23);
}
void stage_split(const float* x, int n, uint16_t* hi, int16_t* res) {
  for (int i = 0; i < n; ++i) {
    hi[i] = f32_to_f16(x[i]);
    // exact: x - f16(x) (Sterbenz, or f16(x) = 0) and its scaling by a power of two; a whole
    // number but for |x| < 2^-15, rounded there
    const float u = (x[i] - f16_to_f32(hi[i])) * stage_unit_inv(hi[i]);
    res[i] = (int16_t)(u + (u < 0 ? -0.5f : 0.5f));
  }
}
float stage_join(uint16_t hi, int16_t res) { return f16_to_f32(hi) + (float)res * stage_unit(hi); }

kv_elem elem_of(kv_format f) {
  return f == kv_format::f32 ? kv_elem::f32 : f == kv_format::bf16 ? kv_elem::bf16 : kv_elem::f16;
}

struct side_store {
  const char* name = "K";
  kv_format format = kv_format::f16;  // body format (KIVI V: its per-token kivi_v format)
  kv_format type = kv_format::f16;    // the user's type (kivi4 stays kivi4 on V)
  const kv_format_traits* t = nullptr;
  bool compressed = false;
  kv_elem exact_elem = kv_elem::f16;  // sink/tail rows
  rotation rot;
  int group = 0;                      // per_token: elements per scale; per_channel: tokens per group
  size_t code_row = 0;                // bytes of one body row
  int64_t scale_stride = 0;           // f16 per row (per_token) or per group (per_channel)
  std::vector<size_t> row0, unit0;    // [n_layer + 1] first body row / scale unit of each layer
  std::vector<uint8_t> codes;         // per layer [n_seq, n_kv_head, ring_[il], code_row] or paged [n_pages, n_kv_head, page_size, code_row]
  std::vector<uint16_t> scales;       // per layer [n_seq, n_kv_head, scale_units(ring_[il]), scale_stride] or paged alike
  std::vector<uint8_t> exact;         // [n_layer, n_seq, n_kv_head, exact_cap, head_dim] exact_elem
  // channel statistics (channel_scale; K: k_channel_scale), else empty; per sequence so that no
  // sequence's data changes another's results
  std::vector<float> lambda, mu;      // [n_layer, n_seq, n_kv_head, head_dim]
  // the first positions as given until the channel statistics are calibrated (kv_cache_quant::cal_n_)
  std::vector<uint8_t> stage;  // [n_layer, n_seq] staging blocks of cal_n_ positions (stage_block)
  // a compressed side's staging references: position 0 as given where large (stage_pos_bytes), else empty
  std::vector<float> stage_ref;  // [n_layer, n_seq, n_kv_head, head_dim]
  size_t planned = 0;            // bytes of the six arrays above, set before any allocation

  size_t bytes() const {
    return codes.size() + scales.size() * 2 + exact.size() +
           (lambda.size() + mu.size() + stage_ref.size()) * sizeof(float) + stage.size();
  }
  size_t unit_of_row(size_t r) const { return t->layout == kv_layout::per_channel ? r / group : r; }
  size_t scale_units(size_t rows) const {
    return t->layout == kv_layout::per_channel ? rows / group : t->layout == kv_layout::per_token ? rows : 0;
  }
  size_t row_bytes_asymptotic(int hd) const {
    if (t->layout == kv_layout::per_channel) return code_row;  // + 2 * 2 * hd / group (fractional)
    return code_row + (size_t)scale_stride * 2;
  }
};

class kv_cache_quant final : public kv_cache {
 public:
  // allocate == false: validates and sizes the cache (planned_bytes()) without allocating it.
  explicit kv_cache_quant(const kv_cache_params& p, bool allocate = true) : p_(p), allocate_(allocate) {
    // p is validated (make_kv_cache, kv_bytes_per_token and kv_bytes_at_ctx call validate first)
    const kv_format fk = side_format(p, false), fv = side_format(p, true);
    kivi_ = kv_traits(fk).layout == kv_layout::per_channel || kv_traits(fv).layout == kv_layout::per_channel;
    unit_ = kivi_ ? p.kivi_group : 1;
    // K channel scale (kv_cache_params::k_channel_scale): auto = on for per-token compressed K
    k_channel_scale_ = p.channel_scale || p.k_channel_scale.value_or(kv_traits(fk).layout == kv_layout::per_token);
    const int body_room = std::max(0, p.n_ctx - p.sink);  // positions after the sink
    // the tail keeps at least min_tail_ exact rows (clamped to the room: a longer window keeps every
    // post-sink token exact), so at most body_room - min_tail_ rows, in whole units, are compressed
    min_tail_ = std::min(kivi_ ? std::max(p.exact_recent, p.kivi_residual - p.kivi_group + 1) : p.exact_recent,
                         body_room);
    tail_cap_ = (int)std::min<int64_t>((int64_t)min_tail_ + unit_ - 1, body_room);
    exact_cap_ = std::min(p.sink, p.n_ctx) + tail_cap_;
    const size_t heads = (size_t)p.n_layer * p.n_seq * p.n_kv_head;
    // body rows per (layer, seq, kv head): every position that can leave the exact windows, in whole
    // units; a sliding-window layer's ring holds the rows its queries can see plus one batch
    const int body_cap = (body_room - min_tail_) / unit_ * unit_;
    for (int il = 0; il < p.n_layer; ++il) {
      const int w = kv_layer_window(p, il);
      window_.push_back(w);
      int ring = body_cap;
      if (w > 0) ring = (int)std::min<int64_t>(body_cap, ((int64_t)w + p.n_ubatch - 1 + unit_ - 1) / unit_ * unit_);
      ring_.push_back(ring);
      paged_.push_back(p.page_size > 0 && w == 0);
    }
    // channel statistics wait for the first cal_n_ positions, kept as given until then; the sides'
    // stored formats and whether they are compressed, as init_side sets them (asserted below)
    const kv_format bk = fk, bv = kv_traits(fv).layout == kv_layout::per_channel ? kv_traits(fv).kivi_v : fv;
    const bool ck = kv_traits(bk).layout != kv_layout::dense, cv = kv_traits(bv).layout != kv_layout::dense;
    const bool stats = ((p.channel_scale || k_channel_scale_) && ck) || (p.channel_scale && cv);
    cal_n_ = stats ? std::min(p.channel_calib, p.n_ctx) : 0;
    if (p.page_size > 0) {
      const int per_seq = (body_cap + p.page_size - 1) / p.page_size;
      // staging pages (stage_in_pages): blocks of stage_rows_ positions in stage_block_pages_ pages,
      // before the sides exist. A side's runs (one kv head, one plane: S rows of head_dim elements)
      // fill a layer's R = n_kv_head * P * code_row bytes of a page R / run bytes at a time; S is
      // as long as a block of at most kStageBlockPages pages allows (at most R / element bytes /
      // head_dim: one run a page), so that a head's rows lie in runs of S rows, not P / 8.
      bool any_paged = false;
      for (bool x : paged_) any_paged = any_paged || x;
      int rows = std::min(cal_n_, p.n_ctx);
      for (auto [f, c] : {std::pair{bk, ck}, std::pair{bv, cv}}) {
        const size_t eb = c ? 2 : kv_elem_bytes(elem_of(f)), runs = (size_t)p.n_kv_head * (c ? 2 : 1);
        const size_t region = (size_t)p.n_kv_head * p.page_size * kv_code_bytes(f, p.head_dim);
        const size_t one = region / ((size_t)p.head_dim * eb);  // rows of a run that fills the region
        rows = region % eb == 0 ? (int)std::min<size_t>(rows, std::min(one, one * kStageBlockPages / runs)) : 0;
      }
      if (!any_paged || cal_n_ == 0) rows = 0;
      stage_rows_ = rows;
      for (auto [f, c, i] : {std::tuple{bk, ck, 0}, std::tuple{bv, cv, 1}}) {
        if (rows == 0) break;
        const size_t eb = c ? 2 : kv_elem_bytes(elem_of(f)), runs = (size_t)p.n_kv_head * (c ? 2 : 1);
        const size_t region = (size_t)p.n_kv_head * p.page_size * kv_code_bytes(f, p.head_dim);
        stage_rpp_[i] = (int)(region / ((size_t)rows * p.head_dim * eb));
        stage_block_pages_ = std::max(stage_block_pages_, (int)((runs + stage_rpp_[i] - 1) / stage_rpp_[i]));
      }
      const int stage_per_seq = stage_pages_of(cal_n_);
      // n_pages 0: every sequence at n_ctx, and its staging pages on the way there
      pool_.init(p.page_size, p.n_pages > 0 ? p.n_pages : p.n_seq * (per_seq + stage_per_seq), allocate_ ? p.n_seq : 0,
                 per_seq);
    }
    init_side(k_, "K", fk, /*is_v=*/false, heads);
    init_side(v_, "V", fv, /*is_v=*/true, heads);
    state_.assign((size_t)p.n_layer * p.n_seq, {});
    fresh_.resize(allocate_ ? p.n_seq : 0);
    lambda_set_.assign((size_t)p.n_layer * p.n_seq, 0);
    KVQ_ASSERT(k_.format == bk && k_.compressed == ck && v_.format == bv && v_.compressed == cv);
    staged_.assign((size_t)p.n_layer * p.n_seq, 0);
    // staging rows of the paged layers in pages of the pool (stage_rows_ above); none (the heap
    // array below) when a page holds no run or a paged layer's rows would not be aligned to their
    // element
    KVQ_ASSERT(stage_rows_ == 0 || cal_n_ > 0);
    for (const auto* s : {&k_, &v_})
      for (int il = 0; il < p.n_layer; ++il)
        if (paged_[il] && s->row0[il] * s->code_row % kv_elem_bytes(s->exact_elem) != 0) stage_rows_ = 0;
    for (int il = 0; il < p.n_layer; ++il) heap_stage_ = heap_stage_ || (cal_n_ > 0 && !stage_in_pages(il));
    for (auto* s : {&k_, &v_}) {
      const size_t n_ref = cal_n_ > 0 && s->compressed ? heads * p.head_dim : 0;
      s->planned += stage_bytes(*s) + n_ref * sizeof(float);
      if (allocate_) {
        s->stage.assign(stage_bytes(*s), 0);
        s->stage_ref.assign(n_ref, 0.0f);
      }
    }
  }

  const kv_cache_params& params() const override { return p_; }

  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override;
  void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale, float* out,
              thread_pool& pool) override;
  void attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale, thread_pool& pool) override;
  // attend and attend_batch; op names the caller in error messages
  void attend_seqs(const char* op, int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                   thread_pool& pool);

  int n_pos(int seq_id) const override {
    if (seq_id < 0 || seq_id >= p_.n_seq) return 0;
    return held(p_.n_layer - 1, seq_id);
  }
  void clear(int seq_id) override {
    check_layer_seq("clear", 0, seq_id);
    for (int il = 0; il < p_.n_layer; ++il) {
      st(il, seq_id) = {};
      lambda_set_[(size_t)il * p_.n_seq + seq_id] = 0;  // the next appends calibrate again
      staged_[(size_t)il * p_.n_seq + seq_id] = 0;
    }
    if (pool_.on()) {
      pool_.shrink(seq_id, 0);
      pool_.stage_shrink(seq_id, 0);
    }
  }
  kv_page_info page_info() const override { return pool_.info(page_bytes()); }
  std::vector<int> seq_pages(int seq_id) const override {
    check_layer_seq("seq_pages", 0, seq_id);
    return pool_.on() ? pool_.table(seq_id) : std::vector<int>{};
  }
  // body rows <= positions (the sink and tail rows take no page)
  int pages_for(int n) const override { return pool_.pages_for(n, p_.n_ctx); }
  int stage_pages_for(int n) const override {
    return stage_rows_ > 0 ? stage_pages_of(std::min({n, cal_n_, p_.n_ctx})) : 0;
  }
  int seq_stage_pages(int seq_id) const override {
    check_layer_seq("seq_stage_pages", 0, seq_id);
    return pool_.on() ? (int)pool_.stage(seq_id).size() : 0;
  }
  void pin_page(int page) override {
    if (!pool_.on()) kv_cache::pin_page(page);
    pool_.pin(page);
  }
  void unpin_page(int page) override {
    if (!pool_.on()) kv_cache::unpin_page(page);
    pool_.unpin(page);
  }
  bool can_save_prefix() const override { return pool_.on(); }
  std::shared_ptr<const kv_prefix> save_prefix(int seq_id) override {
    check_layer_seq("save_prefix", 0, seq_id);
    if (!can_save_prefix()) return kv_cache::save_prefix(seq_id);
    // the staging rows are copied (the sequence goes on writing its staging pages); a loader takes
    // as many staging pages, stage_pages_held(n_pos), before it copies them back
    if ((int)pool_.stage(seq_id).size() != stage_pages_held(n_pos(seq_id)))
      fail_input("[kv_cache] save_prefix: seq " + std::to_string(seq_id) + " is between layers of an append");
    return kv_save_paged_prefix(this, pool_, seq_id, n_pos(seq_id), paged_rows(seq_id), seq_regions(seq_id));
  }
  void load_prefix(int seq_id, const kv_prefix& p) override {
    check_layer_seq("load_prefix", 0, seq_id);
    if (!can_save_prefix()) kv_cache::load_prefix(seq_id, p);
    const int n_stage = n_pos(seq_id) == 0 ? stage_pages_held(p.n_pos()) : 0;
    const bool copy = p.n_full_pages() < p.n_pages();  // a partly filled last page: one more free page
    if (n_stage > 0 && pool_.n_free() < n_stage + (copy ? 1 : 0))
      fail_input("[kv_cache] load_prefix: seq " + std::to_string(seq_id) + " needs " + std::to_string(n_stage) +
                 " pages for its channel-calibration rows" + (copy ? " and one for a page copy" : "") + ", the pool has " +
                 std::to_string(pool_.n_free()) + " free");
    const int had = (int)pool_.stage(seq_id).size();
    pool_.stage_grow(seq_id, n_stage);
    std::pair<int, int> ft;
    try {
      ft = kv_load_paged_prefix(this, pool_, seq_id, n_pos(seq_id), p, seq_regions(seq_id));
    } catch (...) {
      pool_.stage_shrink(seq_id, had);
      throw;
    }
    const auto [from, to] = ft;
    if (from >= 0) copy_page(from, to);
    for (int il = 0; il < p_.n_layer; ++il) st(il, seq_id).fresh_id = 0;  // exact copies belong to an append of the saver
  }
  // Bytes of one page: page_size body rows of every paged layer, every kv head, K and V.
  size_t page_bytes() const {
    size_t b = 0;
    const size_t P = (size_t)std::max(p_.page_size, 0);
    for (int il = 0; il < p_.n_layer; ++il)
      if (window_[il] == 0)
        for (const auto* s : {&k_, &v_})
          b += (size_t)p_.n_kv_head * (P * s->code_row + s->scale_units(P) * s->scale_stride * 2);
    return b;
  }
  void truncate(int seq_id, int n_pos) override;

  size_t bytes() const override { return k_.bytes() + v_.bytes(); }
  size_t planned_bytes() const { return k_.planned + v_.planned; }
  size_t bytes_used() const override {
    size_t b = 0;
    for (const auto* s : {&k_, &v_})
      for (size_t i = 0; i < state_.size(); ++i) {
        const seq_state& q = state_[i];
        const size_t exact_rows = (size_t)std::min(q.n, p_.sink) + (size_t)tail_len(q);
        b += exact_rows * p_.head_dim * kv_elem_bytes(s->exact_elem) * p_.n_kv_head;
        if (paged_[i / p_.n_seq]) continue;  // in the pages below
        b += (size_t)(q.n_comp - q.body_lo) * s->code_row * p_.n_kv_head;
        b += (s->scale_units((size_t)q.n_comp) - s->scale_units((size_t)q.body_lo)) * s->scale_stride * 2 * p_.n_kv_head;
      }
    if (pool_.on()) b += (size_t)pool_.n_seq_held() * page_bytes();  // pages of sequences (not those only pinned)
    // channel statistics of the (layer, sequence) pairs calibrated
    size_t n_set = 0;
    for (uint8_t x : lambda_set_) n_set += x;
    for (const auto* s : {&k_, &v_})
      if (!s->lambda.empty()) b += n_set * 2 * (size_t)p_.n_kv_head * p_.head_dim * sizeof(float);
    // staging rows held (a calibrated sequence keeps its cal_n_; truncate below them needs them)
    // (those in staging pages are in n_seq_held above)
    // and their references while the rows are held
    for (size_t i = 0; i < staged_.size(); ++i) {
      const bool in_pages = stage_in_pages((int)(i / p_.n_seq));
      for (const auto* s : {&k_, &v_}) {
        if (!in_pages) b += (size_t)staged_[i] * stage_pos_bytes(*s);
        if (!s->stage_ref.empty() && staged_[i] > 0 && (!in_pages || !lambda_set_[i]))
          b += (size_t)p_.n_kv_head * p_.head_dim * sizeof(float);
      }
    }
    return b;
  }
  std::string describe() const override {
    std::string d = "K " + side_desc(k_) + " / V " + side_desc(v_);
    if (p_.sink || p_.exact_recent)
      d += "; exact sink " + std::to_string(p_.sink) + ", exact recent " + std::to_string(p_.exact_recent);
    int n_win = 0;
    for (int w : window_) n_win += w > 0;
    if (n_win) d += "; " + std::to_string(n_win) + " sliding-window layers";
    if (kivi_) d += "; KIVI residual " + std::to_string(p_.kivi_residual);
    if (p_.channel_scale) d += "; channel scale";
    else if (k_channel_scale_ && k_.compressed) d += "; K channel scale";
    if (cal_n_ > 0) d += " (first " + std::to_string(cal_n_) + " positions)";
    return d;
  }

  std::vector<uint8_t> stored_bytes(int il, int seq_id) const {
    check_layer_seq("stored_bytes", il, seq_id);
    const seq_state& q = st(il, seq_id);
    std::vector<uint8_t> b;
    auto put = [&](const void* p, size_t n) {
      const auto* c = static_cast<const uint8_t*>(p);
      b.insert(b.end(), c, c + n);
    };
    put(&q.n, sizeof q.n);
    put(&q.n_comp, sizeof q.n_comp);
    put(&q.body_lo, sizeof q.body_lo);
    auto& self = const_cast<kv_cache_quant&>(*this);
    for (int h = 0; h < p_.n_kv_head; ++h) {
      const size_t hi = head_index(il, seq_id, h);
      for (auto* s : {&self.k_, &self.v_}) {
        const size_t eb = (size_t)p_.head_dim * kv_elem_bytes(s->exact_elem);
        put(self.exact_row(*s, hi, 0), (size_t)std::min(q.n, p_.sink) * eb);
        put(self.exact_row(*s, hi, p_.sink), (size_t)tail_len(q) * eb);
        for (int r = q.body_lo; r < q.n_comp; ++r) put(self.body_codes(*s, hi, r), s->code_row);  // held rows
        if (s->scale_stride)
          for (size_t u = s->scale_units(q.body_lo); u < s->scale_units(q.n_comp); ++u)
            put(self.body_scales(*s, hi, u), s->scale_stride * 2);
      }
    }
    return b;
  }

  // Global layers only: a sliding-window layer's ring does not grow with the context.
  double bytes_per_token() const {
    int n_global = 0;
    for (int w : window_) n_global += w == 0;
    return (double)n_global * p_.n_kv_head * (side_row_bytes(k_) + side_row_bytes(v_));
  }
  // Bytes of layer il as allocated (both sides: body ring or body, exact rows, λ / μ).
  size_t layer_bytes(int il) const {
    size_t b = 0;
    const size_t heads = (size_t)p_.n_seq * p_.n_kv_head, ring = (size_t)ring_[il];
    for (const auto* s : {&k_, &v_}) {
      if (paged_[il]) {
        const size_t P = (size_t)p_.page_size;
        b += (size_t)pool_.n_pages() * p_.n_kv_head * (P * s->code_row + s->scale_units(P) * s->scale_stride * 2) +
             heads * (size_t)exact_cap_ * p_.head_dim * kv_elem_bytes(s->exact_elem);
      } else {
        b += heads * (ring * s->code_row + s->scale_units(ring) * s->scale_stride * 2 +
                      (size_t)exact_cap_ * p_.head_dim * kv_elem_bytes(s->exact_elem));
      }
      if ((p_.channel_scale || (s == &k_ && k_channel_scale_)) && s->compressed)
        b += 2 * heads * p_.head_dim * sizeof(float);  // μ and λ
      b += stage_bytes(*s) / p_.n_layer;                // the staging rows
      if (cal_n_ > 0 && s->compressed) b += heads * p_.head_dim * sizeof(float);  // their references
    }
    return b;
  }

 private:
  struct seq_state {
    int n = 0;        // positions stored
    int n_comp = 0;   // body rows (positions [sink, sink + n_comp))
    int body_lo = 0;  // oldest body row still held (> 0 only once a sliding-window layer's ring wraps)
    // body rows [fresh_lo, n_comp) compressed by this layer's latest append while one of its queries
    // still sees them exact; their exact copies are in fresh_[seq] while its id is fresh_id
    int fresh_lo = 0;
    uint64_t fresh_id = 0;  // 0: none
  };
  // Exact copies of body rows [lo, hi) of one (layer, sequence), written by the append numbered id
  // (n_appends_), followed by a copy of the exact tail that append left (rows [hi, lo + n)), so that
  // a query sees the exact rows from any of [lo, hi) on as one view (the view a decode step at its
  // position attends). One per sequence, reused by every layer: a layer's attend finds its own rows
  // as long as no other layer's append to the sequence came in between (the model's order, kv_cache.h).
  struct fresh_rows {
    uint64_t id = 0;
    int lo = 0, hi = 0, n = 0;
    std::vector<uint8_t> k, v;  // [n_kv_head, n, head_dim] exact_elem of the side
  };

  double side_row_bytes(const side_store& s) const {
    if (s.t->layout == kv_layout::per_channel) return (double)s.code_row + 4.0 * p_.head_dim / s.group;
    return (double)s.row_bytes_asymptotic(p_.head_dim);
  }
  std::string side_desc(const side_store& s) const {
    std::string d = kv_traits(s.type).name;
    if (!s.compressed) return d;
    d += std::string(" (") + rotation_name(s.rot.kind);
    if (s.t->layout == kv_layout::per_channel) d += ", per-channel T" + std::to_string(s.group);
    else d += ", g" + std::to_string(s.group);
    if (s.type != s.format) d += std::string(", ") + s.t->name;
    return d + ")";
  }

  // Body rows of seq_id the paged layers hold (rows [0, n) of its pages).
  int paged_rows(int seq_id) const {
    int rows = 0;
    for (int il = 0; il < p_.n_layer; ++il)
      if (paged_[il]) rows = std::max(rows, st(il, seq_id).n_comp);
    return rows;
  }
  // What seq_id holds outside pages (save_prefix / load_prefix), per layer: its counters, whether
  // its channel statistics are calibrated, and per side μ / λ, the exact sink and tail rows (KIVI's
  // residual among them) and, for a sliding-window layer, its ring of body rows and scales. Any new
  // per-sequence state outside pages must be listed here too, or a loaded prefix continues
  // differently (kv_cache_paged.a_loaded_prefix_continues_as_the_saved_sequence fails).
  std::vector<kv_seq_region> seq_regions(int seq_id) {
    std::vector<kv_seq_region> r;
    const size_t nh = p_.n_kv_head, hd = p_.head_dim;
    for (int il = 0; il < p_.n_layer; ++il) {
      r.push_back({reinterpret_cast<uint8_t*>(&st(il, seq_id)), sizeof(seq_state)});
      r.push_back({&lambda_set_[(size_t)il * p_.n_seq + seq_id], 1});
      r.push_back({reinterpret_cast<uint8_t*>(&staged_[(size_t)il * p_.n_seq + seq_id]), sizeof(int)});
      const size_t h0 = head_index(il, seq_id, 0);
      for (auto* s : {&k_, &v_}) {
        if (stage_in_pages(il)) {  // the staging pages it holds, whole
          for (int pg : pool_.stage(seq_id))
            r.push_back({s->codes.data() + (s->row0[il] + (size_t)pg * nh * p_.page_size) * s->code_row,
                         nh * p_.page_size * s->code_row});
        } else if (cal_n_ > 0) {
          r.push_back({stage_run(*s, il, seq_id, 0, 0, 0), (size_t)cal_n_ * stage_pos_bytes(*s)});
        }
        if (!s->stage_ref.empty())
          r.push_back({reinterpret_cast<uint8_t*>(&s->stage_ref[h0 * hd]), nh * hd * sizeof(float)});
        if (!s->lambda.empty()) {
          r.push_back({reinterpret_cast<uint8_t*>(&s->lambda[h0 * hd]), nh * hd * sizeof(float)});
          r.push_back({reinterpret_cast<uint8_t*>(&s->mu[h0 * hd]), nh * hd * sizeof(float)});
        }
        r.push_back({exact_row(*s, h0, 0), nh * (size_t)exact_cap_ * hd * kv_elem_bytes(s->exact_elem)});
        if (paged_[il]) continue;
        const size_t ring = ring_[il], units = s->scale_units(ring);
        r.push_back({s->codes.data() + (s->row0[il] + (size_t)seq_id * nh * ring) * s->code_row, nh * ring * s->code_row});
        if (s->scale_stride)
          r.push_back({reinterpret_cast<uint8_t*>(s->scales.data() + (s->unit0[il] + (size_t)seq_id * nh * units) * s->scale_stride),
                       nh * units * s->scale_stride * 2});
      }
    }
    return r;
  }
  void init_side(side_store& s, const char* name, kv_format type, bool is_v, size_t heads);
  // Staging rows of a side, in blocks of B positions per (layer, sequence): block j holds
  // positions [j B, (j + 1) B) in runs of B rows, one per kv head and plane,
  //   plane 0: [n_kv_head][B, head_dim] exact_elem   the rows queries attend; on a compressed side
  //                                                  f16 of d = x - ref, ref = stage_ref (the
  //                                                  sequence's position 0 as given on channels
  //                                                  where it is >= kStageRefMin in size, else 0)
  //   plane 1: [n_kv_head][B, head_dim] int16        the residuals d - f16(d) (stage_split), so that
  //                                                  calibration and the store see x = ref + d
  // f16 of x itself would round a K of 210 (Qwen's bias) in steps of 0.125; d is the distance to
  // position 0 on such a channel (its bias taken out). Attention over d is attention over x: every K row
  // a staged query sees is shifted by the same ref, which moves all its scores by q·ref (softmax
  // ignores it), and ref is added back to the output once (the weights sum to 1); a soft-capped
  // layer (not shift-invariant) takes ref = 0 for K. In the heap array a block is [plane][n_kv_head]
  // runs, B = cal_n_; in staging pages B = stage_rows_ and a block takes stage_block_pages_ pages of
  // the sequence, run r = plane * n_kv_head + h at r % rpp in the layer's bytes of its page r / rpp
  // (rpp = stage_rpp_ of the side).
  size_t stage_pos_bytes(const side_store& s) const {
    return (size_t)p_.n_kv_head * p_.head_dim * (kv_elem_bytes(s.exact_elem) + (s.compressed ? 2 : 0));
  }
  // Bytes of the heap staging array (0 when every layer stages in pages).
  size_t stage_bytes(const side_store& s) const {
    if (!heap_stage_) return 0;
    return (size_t)p_.n_layer * p_.n_seq * cal_n_ * stage_pos_bytes(s);
  }
  // Whether layer il keeps its staging rows in staging pages (a paged layer of a paged cache whose
  // pages hold at least one position of them) rather than the heap array.
  bool stage_in_pages(int il) const { return stage_rows_ > 0 && paged_[il]; }
  int stage_pages_of(int n) const {
    return n <= 0 || stage_rows_ == 0 ? 0 : (n + stage_rows_ - 1) / stage_rows_ * stage_block_pages_;
  }
  // Staging pages a sequence of n positions holds between appends: those of its n staged positions
  // until it is calibrated (n >= cal_n_), then none.
  int stage_pages_held(int n) const { return stage_rows_ > 0 && n < cal_n_ ? stage_pages_of(n) : 0; }
  // Positions per staging block of layer il (stage_pos_bytes).
  int stage_block_rows(int il) const { return stage_in_pages(il) ? stage_rows_ : cal_n_; }
  // Row pos of the staging run (plane, kv head h) of layer il, seq: head_dim elements of 2 bytes
  // (a compressed side: f16, then the int16 residuals) or of exact_elem.
  uint8_t* stage_run(side_store& s, int il, int seq, int plane, int h, int pos) {
    const int B = stage_block_rows(il), r = plane * p_.n_kv_head + h;
    const size_t eb = s.compressed ? 2 : kv_elem_bytes(s.exact_elem), run = (size_t)B * p_.head_dim * eb;
    uint8_t* base;
    if (stage_in_pages(il)) {
      const int rpp = stage_rpp_[&s == &k_ ? 0 : 1];
      const size_t pg = pool_.stage(seq)[(size_t)(pos / B) * stage_block_pages_ + r / rpp];
      base = s.codes.data() + (s.row0[il] + pg * p_.n_kv_head * p_.page_size) * s.code_row + (size_t)(r % rpp) * run;
    } else {
      base = s.stage.data() + ((size_t)il * p_.n_seq + seq) * cal_n_ * stage_pos_bytes(s) + (size_t)r * run;
    }
    return base + (size_t)(pos % B) * p_.head_dim * eb;
  }
  // The attended staging row of kv head h at position pos, and on a compressed side its residuals.
  uint8_t* stage_row(side_store& s, int il, int seq, int h, int pos) { return stage_run(s, il, seq, 0, h, pos); }
  int16_t* stage_residual(side_store& s, int il, int seq, int h, int pos) {
    return reinterpret_cast<int16_t*>(stage_run(s, il, seq, 1, h, pos));
  }
  // The staging reference of kv head h (head_dim floats; a compressed side).
  float* stage_ref(side_store& s, int il, int seq, int h) { return &s.stage_ref[head_index(il, seq, h) * p_.head_dim]; }
  // Positions layer il of seq holds: the staged ones until its channel statistics are calibrated,
  // then those of the store (which then holds every position, the staged ones included).
  int held(int il, int seq) const {
    const size_t i = (size_t)il * p_.n_seq + seq;
    return cal_n_ > 0 && !lambda_set_[i] ? staged_[i] : state_[i].n;
  }
  // The stored part of append (transform, sink, body, tail) and of truncate.
  void append_stored(int il, int seq_id, int n_tokens, const float* k, const float* v);
  void truncate_stored(int seq_id, int n_keep);
  // Queries of seqs[0, n), all at positions below cal_n_: exact attention over the staging rows (the
  // query as given, K / V in their exact element type: f16 on a compressed side, as its exact sink),
  // outputs written to each one's out. One parallel loop for the whole
  // batch (one work item per sequence, kv head and query: the same kernel call for a query whatever
  // batch it is in), not one per sequence: a decode step of 16 sequences would otherwise issue 16
  // loops of n_kv_head items per layer, waking every thread for two items each.
  void attend_staged(int il, const attend_seq* seqs, int n, int n_head, float scale, thread_pool& pool);
  seq_state& st(int il, int seq) { return state_[(size_t)il * p_.n_seq + seq]; }
  const seq_state& st(int il, int seq) const { return state_[(size_t)il * p_.n_seq + seq]; }
  int tail_len(const seq_state& q) const { return std::max(0, q.n - p_.sink - q.n_comp); }
  size_t head_index(int il, int seq, int h) const { return ((size_t)il * p_.n_seq + seq) * p_.n_kv_head + h; }
  uint8_t* exact_row(side_store& s, size_t hi, int row) {
    return s.exact.data() + (hi * exact_cap_ + row) * p_.head_dim * kv_elem_bytes(s.exact_elem);
  }
  // n_comp's rule for a sequence of n positions: the body rows [0, rule) a decode step leaves compressed.
  int comp_rule(int n) const { return unit_ * (std::max(0, n - p_.sink - min_tail_) / unit_); }
  // Body rows of layer il, seq that attend reads from exact copies: [fresh_lo(il, seq), n_comp); n_comp
  // (none) when the copies are another layer's (an append of another layer came after this layer's).
  int fresh_lo(int il, int seq) const {
    const seq_state& q = st(il, seq);
    return q.fresh_id != 0 && fresh_[seq].id == q.fresh_id ? q.fresh_lo : q.n_comp;
  }
  // The exact copy of body row r of kv head h in f (f.lo <= r < f.lo + f.n; from f.hi on the tail's).
  const uint8_t* fresh_row(const side_store& s, const fresh_rows& f, int h, int r) const {
    const auto& b = &s == &k_ ? f.k : f.v;
    return b.data() + ((size_t)h * f.n + (r - f.lo)) * p_.head_dim * kv_elem_bytes(s.exact_elem);
  }
  uint8_t* fresh_row(const side_store& s, fresh_rows& f, int h, int r) {
    return const_cast<uint8_t*>(std::as_const(*this).fresh_row(s, std::as_const(f), h, r));
  }
  // Body row `row` / scale unit `unit` of head hi = head_index(il, seq, h): slot row % ring of layer il.
  uint8_t* body_codes(side_store& s, size_t hi, size_t row) {
    const size_t per_layer = (size_t)p_.n_seq * p_.n_kv_head, il = hi / per_layer, ring = ring_[il];
    if (paged_[il]) {  // page table[row / P] of the sequence, slot row % P
      const size_t nh = p_.n_kv_head, seq = hi % per_layer / nh, h = hi % nh, P = p_.page_size;
      const size_t pg = pool_.page_of((int)seq, row);
      return s.codes.data() + (s.row0[il] + (pg * nh + h) * P + row % P) * s.code_row;
    }
    return s.codes.data() + (s.row0[il] + hi % per_layer * ring + (ring ? row % ring : row)) * s.code_row;
  }
  uint16_t* body_scales(side_store& s, size_t hi, size_t unit) {
    const size_t per_layer = (size_t)p_.n_seq * p_.n_kv_head, il = hi / per_layer, units = s.scale_units(ring_[il]);
    if (paged_[il]) {  // a page holds the scale units of its rows (KIVI: page_size % kivi_group == 0)
      const size_t nh = p_.n_kv_head, seq = hi % per_layer / nh, h = hi % nh, upp = s.scale_units(p_.page_size);
      const size_t pg = pool_.table((int)seq)[unit / upp];
      return s.scales.data() + (s.unit0[il] + (pg * nh + h) * upp + unit % upp) * s.scale_stride;
    }
    return s.scales.data() + (s.unit0[il] + hi % per_layer * units + (units ? unit % units : unit)) * s.scale_stride;
  }
  void check_layer_seq(const char* op, int il, int seq_id) const { kvq::check_layer_seq(p_, op, il, seq_id); }
  // x[n_tokens, n_kv_head, head_dim] -> transformed (rotated, / λ, f16-rounded) into xs.
  void transform_side(side_store& s, int il, int seq_id, int pos, int n_tokens, const float* x, float* xs);
  // μ and λ of (layer il, seq_id), every kv head, from the append x[n_tokens, n_kv_head, head_dim]
  void calibrate_channels(side_store& s, int il, int seq_id, int n_tokens, const float* x);
  // Quantizes `n_units` units of rows x[rows, head_dim] into body rows starting at `row`.
  void store_body(side_store& s, size_t hi, size_t row, const float* x, int n_rows);
  void load_body_rows(side_store& s, size_t hi, size_t row0, int n_rows, float* y);
  void copy_page(int from, int to);  // every paged layer's rows and scales (copy on write)
  // Body rows [r0, r1) of head hi (a paged layer) copied page by page into the calling thread's
  // buffers; points v's codes and scales there (r0 starts a scale unit).
  void gather(side_store& s, size_t hi, int r0, int r1, kv_quant_side& v) {
    thread_local std::vector<uint8_t> codes_k, codes_v;
    thread_local std::vector<uint16_t> scales_k, scales_v;
    auto& codes = &s == &k_ ? codes_k : codes_v;
    auto& scales = &s == &k_ ? scales_k : scales_v;
    const int P = p_.page_size;
    codes.resize((size_t)(r1 - r0) * s.code_row);
    for (int r = r0; r < r1;) {
      const int e = std::min(r1, (r / P + 1) * P);
      std::memcpy(&codes[(size_t)(r - r0) * s.code_row], body_codes(s, hi, r), (size_t)(e - r) * s.code_row);
      r = e;
    }
    v.codes = codes.data();
    if (!s.scale_stride) return;
    const size_t u0 = s.unit_of_row(r0), u1 = s.unit_of_row(r1 - 1) + 1, upp = s.scale_units(P);
    scales.resize((u1 - u0) * s.scale_stride);
    for (size_t u = u0; u < u1;) {
      const size_t e = std::min(u1, (u / upp + 1) * upp);
      std::memcpy(&scales[(u - u0) * s.scale_stride], body_scales(s, hi, u), (e - u) * s.scale_stride * 2);
      u = e;
    }
    v.scales = scales.data();
  }

  kv_cache_params p_;
  bool allocate_ = true;  // false: sized only (kv_bytes_at_ctx)
  bool kivi_ = false;
  bool k_channel_scale_ = false;  // K stored as R((x - μ_K) / λ_K) (channel_scale or k_channel_scale)
  int unit_ = 1, min_tail_ = 0, tail_cap_ = 0, exact_cap_ = 0;
  std::vector<int> window_;  // [n_layer] attn_spec::window (0: global)
  std::vector<int> ring_;    // [n_layer] body rows held per (seq, kv head): all, or a windowed layer's ring
  std::vector<bool> paged_;  // [n_layer] body in the page pool (global layers of a paged cache)
  kv_page_pool pool_;
  side_store k_, v_;
  std::vector<seq_state> state_;     // [n_layer, n_seq]
  std::vector<uint8_t> lambda_set_;  // [n_layer, n_seq] channel statistics calibrated
  int cal_n_ = 0;                    // min(channel_calib, n_ctx) when there are channel statistics, else 0
  std::vector<int> staged_;          // [n_layer, n_seq] positions in the staging rows (<= cal_n_)
  static constexpr int kStageBlockPages = 4;  // pages a staging block aims at (stage_rows_)
  int stage_rows_ = 0;                        // positions per staging block in pages (0: none in pages; stage_in_pages)
  int stage_block_pages_ = 0;                 // pages per staging block
  int stage_rpp_[2] = {0, 0};                 // staging runs per page of K, V (stage_run)
  bool heap_stage_ = false;          // some layer stages in the heap array (side_store::stage)
  std::vector<int64_t> staged_item0_;  // attend_staged's first work item of each sequence
  // [n_seq] exact copies of the rows the latest prefill append compressed (scratch: grown on demand to
  // at most (n_ubatch + U - 2) x n_kv_head rows per side, not in bytes(), like xk_ / xv_)
  std::vector<fresh_rows> fresh_;
  uint64_t n_appends_ = 0;           // appends that kept exact copies (fresh_rows::id)
  // scratch of append / attend (one call at a time per cache)
  std::vector<float> xk_, xv_, pend_;
  std::vector<float> qr_, q8s_;
  std::vector<int8_t> q8_;
  std::vector<int16_t> q16_;  // the query of 8-bit K (quantize_q16_ref)
  std::vector<attend_plan_seq> plan_in_;
  attend_planner plan_;
};

void kv_cache_quant::init_side(side_store& s, const char* name, kv_format type, bool is_v, size_t heads) {
  const int hd = p_.head_dim;
  s.name = name;
  s.type = type;
  const auto& tt = kv_traits(type);
  s.format = (is_v && tt.layout == kv_layout::per_channel) ? tt.kivi_v : type;
  s.t = &kv_traits(s.format);
  s.compressed = s.t->layout != kv_layout::dense;
  s.exact_elem = s.compressed ? kv_elem::f16 : elem_of(s.format);
  if (s.t->layout == kv_layout::per_token) {
    int g = p_.group_size;
    if (g == 0) g = hd % 32 == 0 ? 32 : hd;
    s.group = g;
    s.scale_stride = kv_row_scale_count(s.format, hd, g);
  } else if (s.t->layout == kv_layout::per_channel) {
    s.group = p_.kivi_group;
    s.scale_stride = 2 * hd;
  }
  s.code_row = kv_code_bytes(s.format, hd);
  if (s.compressed) s.rot = rotation::make(side_rotation(p_, type, false), hd, p_.seed);
  const size_t per_layer = (size_t)p_.n_seq * p_.n_kv_head;
  s.row0.assign(p_.n_layer + 1, 0);
  s.unit0.assign(p_.n_layer + 1, 0);
  for (int il = 0; il < p_.n_layer; ++il) {
    if (paged_[il]) {
      const size_t slots = (size_t)pool_.n_pages() * p_.n_kv_head;
      s.row0[il + 1] = s.row0[il] + slots * p_.page_size;
      s.unit0[il + 1] = s.unit0[il] + slots * s.scale_units(p_.page_size);
      continue;
    }
    s.row0[il + 1] = s.row0[il] + per_layer * ring_[il];
    s.unit0[il + 1] = s.unit0[il] + per_layer * s.scale_units(ring_[il]);
  }
  const size_t n_codes = s.row0[p_.n_layer] * s.code_row, n_scales = s.unit0[p_.n_layer] * s.scale_stride;
  const size_t n_exact = heads * exact_cap_ * hd * kv_elem_bytes(s.exact_elem);
  const bool calibrated = p_.channel_scale || (!is_v && k_channel_scale_);
  const size_t n_lambda = calibrated && s.compressed ? heads * hd : 0;
  s.planned = n_codes + n_scales * 2 + n_exact + 2 * n_lambda * sizeof(float);
  if (!allocate_) return;
  s.codes.assign(n_codes, 0);
  s.scales.assign(n_scales, 0);
  s.exact.assign(n_exact, 0);
  s.lambda.assign(n_lambda, 1.0f);
  s.mu.assign(n_lambda, 0.0f);
}

void kv_cache_quant::calibrate_channels(side_store& s, int il, int seq_id, int n_tokens, const float* x) {
  // On the sequence's first positions (cal_n_ of them, less position 0 and the sink: append); x is
  // stored as R ((x - μ) / λ). For K, μ only shifts every score of a query by q·μ, which softmax
  // ignores; for V, μ is added back to the output (the weights sum to 1).
  const size_t h0 = head_index(il, seq_id, 0) * p_.head_dim;
  kv_channel_stats_ref(x, n_tokens, p_.n_kv_head, p_.head_dim, &s.mu[h0], &s.lambda[h0]);
}

void kv_cache_quant::transform_side(side_store& s, int il, int seq_id, int pos, int n_tokens, const float* x,
                                    float* xs) {
  const int hd = p_.head_dim, nh = p_.n_kv_head;
  const size_t n = (size_t)n_tokens * nh * hd;
  if (!s.compressed) {
    std::memcpy(xs, x, n * sizeof(float));
    return;
  }
  auto where = [&](size_t i) {
    const size_t t = i / ((size_t)nh * hd), h = i / hd % nh, c = i % hd;
    return "layer " + std::to_string(il) + ", seq " + std::to_string(seq_id) + ", position " +
           std::to_string(pos + t) + ", kv head " + std::to_string(h) + ", channel " + std::to_string(c);
  };
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      fail_input(std::string("[kv_cache] append: non-finite ") + s.name + " value " + std::to_string(x[i]) + " at " +
                 where(i) + " (compressed caches reject NaN/Inf)");
  std::memcpy(xs, x, n * sizeof(float));
  if (!s.lambda.empty()) {
    KVQ_ASSERT(lambda_set_[(size_t)il * p_.n_seq + seq_id]);  // (append calibrates first)
    for (int t = 0; t < n_tokens; ++t)
      for (int h = 0; h < nh; ++h) {
        const float* lam = &s.lambda[head_index(il, seq_id, h) * hd];
        const float* mu = &s.mu[head_index(il, seq_id, h) * hd];
        float* r = xs + ((size_t)t * nh + h) * hd;
        for (int c = 0; c < hd; ++c) r[c] = (r[c] - mu[c]) / lam[c];
      }
  }
  s.rot.forward_n(xs, (int64_t)n_tokens * nh);
  for (size_t i = 0; i < n; ++i)
    if (!(std::fabs(xs[i]) <= kF16Max))
      fail_input(std::string("[kv_cache] append: ") + s.name + " value " + std::to_string(xs[i]) + " at " + where(i) +
                 " exceeds the f16 range (65504) after rotation/scaling");
  round_to_f16_n(xs, n);
}

void kv_cache_quant::store_body(side_store& s, size_t hi, size_t row, const float* x, int n_rows) {
  const int hd = p_.head_dim;
  switch (s.t->layout) {
    case kv_layout::dense:
      for (int j = 0; j < n_rows; ++j) store_elems(body_codes(s, hi, row + j), elem_of(s.format), x + (size_t)j * hd, hd);
      break;
    case kv_layout::per_token:
      for (int j = 0; j < n_rows; ++j)
        quantize_row_ref(s.format, x + (size_t)j * hd, hd, s.group, body_codes(s, hi, row + j),
                         body_scales(s, hi, row + j));
      break;
    default:
      KVQ_ASSERT(row % s.group == 0 && n_rows % s.group == 0);
      for (int j = 0; j < n_rows; j += s.group)
        quantize_channel_group_ref(s.format, x + (size_t)j * hd, s.group, hd, body_codes(s, hi, row + j),
                                   body_scales(s, hi, (row + j) / s.group));
      break;
  }
}

void kv_cache_quant::load_body_rows(side_store& s, size_t hi, size_t row0, int n_rows, float* y) {
  const int hd = p_.head_dim;
  if (s.t->layout == kv_layout::per_channel) {
    const size_t g0 = row0 / s.group * s.group;
    std::vector<float> tmp((size_t)s.group * hd);
    dequantize_channel_group_ref(s.format, body_codes(s, hi, g0), body_scales(s, hi, g0 / s.group), s.group, hd,
                                 tmp.data());
    KVQ_ASSERT(row0 + n_rows <= g0 + s.group);
    std::memcpy(y, &tmp[(row0 - g0) * hd], (size_t)n_rows * hd * sizeof(float));
    return;
  }
  for (int j = 0; j < n_rows; ++j) {
    if (s.t->layout == kv_layout::dense)
      for (int i = 0; i < hd; ++i) y[(size_t)j * hd + i] = load_elem(body_codes(s, hi, row0 + j), elem_of(s.format), i);
    else
      dequantize_row_ref(s.format, body_codes(s, hi, row0 + j), body_scales(s, hi, row0 + j), hd, s.group,
                         y + (size_t)j * hd);
  }
}

void kv_cache_quant::append(int il, int seq_id, int n_tokens, const float* k, const float* v) {
  check_layer_seq("append", il, seq_id);
  check_append_order(il, seq_id, n_tokens, p_.n_layer, p_.n_ctx, held(il, seq_id), il > 0 ? held(il - 1, seq_id) : 0,
                     n_pos(seq_id));
  check_ring_append(p_, il, n_tokens);
  if (n_tokens == 0) return;
  const size_t i = (size_t)il * p_.n_seq + seq_id;
  if (cal_n_ == 0 || lambda_set_[i]) return append_stored(il, seq_id, n_tokens, k, v);
  // Not calibrated yet: positions below cal_n_ go to the staging rows as given (checked as the
  // store would check them, so that nothing is staged that the store would refuse).
  const int hd = p_.head_dim, nh = p_.n_kv_head, done = staged_[i];
  const size_t row = (size_t)nh * hd;
  for (auto* s : {&k_, &v_}) {
    if (!s->compressed) continue;
    const float* x = s == &k_ ? k : v;
    for (size_t e = 0; e < (size_t)n_tokens * row; ++e) {
      if (std::fabs(x[e]) <= kF16Max) continue;
      const std::string at = " at layer " + std::to_string(il) + ", seq " + std::to_string(seq_id) + ", position " +
                             std::to_string(done + e / row) + ", kv head " + std::to_string(e / hd % nh) +
                             ", channel " + std::to_string(e % hd);
      if (!std::isfinite(x[e]))
        fail_input(std::string("[kv_cache] append: non-finite ") + s->name + " value " + std::to_string(x[e]) + at +
                   " (compressed caches reject NaN/Inf)");
      fail_input(std::string("[kv_cache] append: ") + s->name + " value " + std::to_string(x[e]) + at +
                 " exceeds the f16 range (65504)");
    }
  }
  const int m = std::min(n_tokens, cal_n_ - done);
  if (stage_in_pages(il)) {  // the first layer to reach these positions takes their staging pages
    pool_.check_stage("append", seq_id, stage_pages_of(done + m));
    pool_.stage_grow(seq_id, stage_pages_of(done + m));
  }
  std::vector<float> d(hd);
  for (auto* s : {&k_, &v_})
    for (int t = 0; t < m; ++t)
      for (int h = 0; h < nh; ++h) {
        const float* x = (s == &k_ ? k : v) + (size_t)t * row + (size_t)h * hd;
        uint8_t* r = stage_row(*s, il, seq_id, h, done + t);
        if (!s->compressed) {
          store_elems(r, s->exact_elem, x, hd);
          continue;
        }
        float* ref = stage_ref(*s, il, seq_id, h);
        if (done + t == 0)  // position 0 sets the reference (none for a soft-capped K)
          for (int c = 0; c < hd; ++c)
            ref[c] = std::fabs(x[c]) >= kStageRefMin && !(s == &k_ && p_.attn_softcap > 0.0f) ? x[c] : 0.0f;
        for (int c = 0; c < hd; ++c) d[c] = x[c] - ref[c];
        stage_split(d.data(), hd, reinterpret_cast<uint16_t*>(r), stage_residual(*s, il, seq_id, h, done + t));
      }
  if (done + m < cal_n_) {
    staged_[i] = done + m;
    return;
  }
  // All cal_n_ positions are here: calibrate on them (as staged), then store them and the rest of
  // this append through the ordinary path, as one append (its codes do not depend on how tokens
  // arrive). Position 0 and the exact sink are left out of the statistics: on real models position
  // 0 is the attention sink, whose K is far from the other positions' (docs/formats.md).
  const int skip = std::min(std::max(1, p_.sink), cal_n_ - 1);
  const int n_all = cal_n_ + n_tokens - m;
  std::vector<float> ak((size_t)n_all * row), av((size_t)n_all * row);
  for (auto [s, a] : {std::pair{&k_, &ak}, std::pair{&v_, &av}})
    for (int t = 0; t < cal_n_; ++t)
      for (int h = 0; h < nh; ++h) {
        const uint8_t* r = stage_row(*s, il, seq_id, h, t);
        float* y = a->data() + (size_t)t * row + (size_t)h * hd;
        if (s->compressed) {
          const int16_t* res = stage_residual(*s, il, seq_id, h, t);
          const float* ref = stage_ref(*s, il, seq_id, h);
          for (int c = 0; c < hd; ++c) y[c] = ref[c] + stage_join(reinterpret_cast<const uint16_t*>(r)[c], res[c]);
        } else {
          for (int c = 0; c < hd; ++c) y[c] = load_elem(r, s->exact_elem, c);
        }
      }
  for (side_store* s : {&k_, &v_})
    if (!s->lambda.empty())
      calibrate_channels(*s, il, seq_id, cal_n_ - skip, (s == &k_ ? ak : av).data() + (size_t)skip * row);
  std::memcpy(ak.data() + (size_t)cal_n_ * row, k + (size_t)m * row, (size_t)(n_tokens - m) * row * sizeof(float));
  std::memcpy(av.data() + (size_t)cal_n_ * row, v + (size_t)m * row, (size_t)(n_tokens - m) * row * sizeof(float));
  lambda_set_[i] = 1;
  try {
    append_stored(il, seq_id, n_all, ak.data(), av.data());
  } catch (...) {
    lambda_set_[i] = 0;  // (e.g. a value beyond f16 once scaled): nothing stored, staging as before
    staged_[i] = done;
    throw;
  }
  staged_[i] = cal_n_;
  // the last layer calibrated: the staging pages go back to the pool (their rows are in the store now)
  if (il == p_.n_layer - 1 && stage_rows_ > 0) pool_.stage_shrink(seq_id, 0);
}

void kv_cache_quant::append_stored(int il, int seq_id, int n_tokens, const float* k, const float* v) {
  seq_state& q = st(il, seq_id);
  const int hd = p_.head_dim, nh = p_.n_kv_head;
  const size_t n = (size_t)n_tokens * nh * hd;
  const int body_rows = std::max(q.n_comp, comp_rule(q.n + n_tokens));
  if (paged_[il]) pool_.check_grow("append", seq_id, body_rows);  // nothing is modified when out of pages
  xk_.resize(n);
  xv_.resize(n);
  // 1. validate and transform (nothing is modified before this succeeds, except λ calibration)
  transform_side(k_, il, seq_id, q.n, n_tokens, k, xk_.data());
  transform_side(v_, il, seq_id, q.n, n_tokens, v, xv_.data());
  if (paged_[il]) pool_.grow(seq_id, body_rows);
  // 2. sink rows
  const int n_new = q.n + n_tokens;
  int t0 = 0;
  for (; t0 < n_tokens && q.n + t0 < p_.sink; ++t0)
    for (int h = 0; h < nh; ++h) {
      const size_t hi = head_index(il, seq_id, h);
      for (auto [s, x] : {std::pair{&k_, &xk_}, std::pair{&v_, &xv_}})
        store_elems(exact_row(*s, hi, q.n + t0), s->exact_elem, x->data() + ((size_t)t0 * nh + h) * hd, hd);
    }
  // 3. pending = old tail + new post-sink rows; quantize whole units off the front, keep the rest
  const int tail_old = tail_len(q);
  const int n_pend = tail_old + (n_tokens - t0);
  const int rule = unit_ * (std::max(0, n_new - p_.sink - min_tail_) / unit_);
  const int n_comp_new = std::max(q.n_comp, rule);
  const int n_quant = n_comp_new - q.n_comp;
  KVQ_ASSERT(n_quant >= 0 && n_quant <= n_pend && n_pend - n_quant <= tail_cap_);
  // Rows compressed now that a query of this batch still sees exact: a query at position pos sees
  // compressed only what a decode step at pos would have, comp_rule(pos + 1), so the batch's first
  // query (pos = q.n) already sees [0, comp_rule(q.n + 1)) compressed. At most n_tokens + U - 2 rows;
  // none for one token (decode), nor without a tail (min_tail_ == 0: every query sees its rows compressed).
  const int keep_lo = min_tail_ > 0 ? std::clamp(comp_rule(q.n + 1), q.n_comp, n_comp_new) : n_comp_new;
  fresh_rows& f = fresh_[seq_id];
  if (keep_lo < n_comp_new) {
    f.id = ++n_appends_;
    f.lo = keep_lo;
    f.hi = n_comp_new;
    f.n = n_comp_new - keep_lo + (n_pend - n_quant);  // and the tail
    const size_t rows = (size_t)nh * f.n;
    f.k.resize(rows * hd * kv_elem_bytes(k_.exact_elem));
    f.v.resize(rows * hd * kv_elem_bytes(v_.exact_elem));
  }
  pend_.resize((size_t)n_pend * hd);
  for (int h = 0; h < nh; ++h) {
    const size_t hi = head_index(il, seq_id, h);
    for (auto [s, x] : {std::pair{&k_, &xk_}, std::pair{&v_, &xv_}}) {
      const float* x_new = x->data() + (size_t)h * hd;  // new row j of pend_ is x_new + (t0 + j - tail_old) * nh * hd
      if (keep_lo == n_comp_new) {
        // No exact copies to keep (every decode step): only the n_quant rows compressed now go through
        // f32; the rest of the old tail moves down n_quant rows as bytes (the bits a load and a store
        // would give: f32 / f16 / bf16 round-trip exactly) and the new rows are stored once, so a
        // decode step no longer rewrites the whole exact window element by element.
        const int from_tail = std::min(n_quant, tail_old);
        for (int j = 0; j < from_tail; ++j)
          for (int i = 0; i < hd; ++i) pend_[(size_t)j * hd + i] = load_elem(exact_row(*s, hi, p_.sink + j), s->exact_elem, i);
        for (int j = from_tail; j < n_quant; ++j)
          std::memcpy(&pend_[(size_t)j * hd], x_new + (size_t)(t0 + j - tail_old) * nh * hd, hd * sizeof(float));
        if (n_quant > 0) store_body(*s, hi, q.n_comp, pend_.data(), n_quant);
        if (n_quant > 0 && tail_old > n_quant)
          std::memmove(exact_row(*s, hi, p_.sink), exact_row(*s, hi, p_.sink + n_quant),
                       (size_t)(tail_old - n_quant) * hd * kv_elem_bytes(s->exact_elem));
        for (int j = std::max(n_quant, tail_old); j < n_pend; ++j)
          store_elems(exact_row(*s, hi, p_.sink + j - n_quant), s->exact_elem,
                      x_new + (size_t)(t0 + j - tail_old) * nh * hd, hd);
        continue;
      }
      for (int j = 0; j < tail_old; ++j)
        for (int i = 0; i < hd; ++i) pend_[(size_t)j * hd + i] = load_elem(exact_row(*s, hi, p_.sink + j), s->exact_elem, i);
      for (int t = t0; t < n_tokens; ++t)
        std::memcpy(&pend_[(size_t)(tail_old + t - t0) * hd], x->data() + ((size_t)t * nh + h) * hd, hd * sizeof(float));
      if (n_quant > 0) store_body(*s, hi, q.n_comp, pend_.data(), n_quant);
      for (int r = keep_lo; r < n_comp_new; ++r)
        store_elems(fresh_row(*s, f, h, r), s->exact_elem, &pend_[(size_t)(r - q.n_comp) * hd], hd);
      for (int j = n_quant; j < n_pend; ++j) {
        store_elems(exact_row(*s, hi, p_.sink + j - n_quant), s->exact_elem, &pend_[(size_t)j * hd], hd);
        if (keep_lo < n_comp_new)
          store_elems(fresh_row(*s, f, h, n_comp_new + j - n_quant), s->exact_elem, &pend_[(size_t)j * hd], hd);
      }
    }
  }
  q.n = n_new;
  q.n_comp = n_comp_new;
  q.fresh_lo = keep_lo;
  q.fresh_id = keep_lo < n_comp_new ? f.id : 0;
  q.body_lo = std::max(q.body_lo, n_comp_new - ring_[il]);  // the rows the ring overwrote
}

void kv_cache_quant::truncate(int seq_id, int n_keep) {
  check_layer_seq("truncate", 0, seq_id);
  if (n_keep < 0) fail_input("[kv_cache] truncate: n_pos must be >= 0, got " + std::to_string(n_keep));
  if (cal_n_ > 0 && n_keep < cal_n_) {  // back into the calibration positions: calibrate again later
    if (n_keep > 0 && stage_rows_ > 0 && n_pos(seq_id) >= cal_n_)
      fail_input("[kv_cache] truncate: seq " + std::to_string(seq_id) + " would keep " + std::to_string(n_keep) +
                 " of the " + std::to_string(cal_n_) + " positions its channel statistics were calibrated on " +
                 "(channel_calib), whose exact rows a paged cache returns to the pool once calibrated: truncate to 0 "
                 "(clear) or to at least " + std::to_string(cal_n_));
    truncate_stored(seq_id, 0);
    if (pool_.on()) pool_.stage_shrink(seq_id, stage_pages_of(n_keep));
    for (int il = 0; il < p_.n_layer; ++il) {
      int& s = staged_[(size_t)il * p_.n_seq + seq_id];
      s = std::min(s, n_keep);
    }
    return;
  }
  truncate_stored(seq_id, n_keep);
}

void kv_cache_quant::truncate_stored(int seq_id, int n_keep) {
  const int hd = p_.head_dim;
  // a sliding-window layer must still hold the rows of a partial unit that go back to the exact tail
  for (int il = 0; il < p_.n_layer; ++il) {
    const seq_state& q = st(il, seq_id);
    if (n_keep >= q.n || n_keep >= p_.sink + q.n_comp) continue;
    const int body_keep = std::max(0, n_keep - p_.sink), n_comp_new = unit_ * (body_keep / unit_);
    if (body_keep > n_comp_new && n_comp_new < q.body_lo)
      fail_input("[kv_cache] truncate: layer " + std::to_string(il) + " (sliding window " +
                 std::to_string(window_[il]) + ") of seq " + std::to_string(seq_id) + " no longer holds position " +
                 std::to_string(p_.sink + n_comp_new) + ", which keeping " + std::to_string(n_keep) +
                 " positions needs (its ring holds positions from " + std::to_string(p_.sink + q.body_lo) + ")");
  }
  // body rows any paged layer keeps; a shared page kept in part is copied first (copy on write)
  int rows = 0;
  for (int il = 0; il < p_.n_layer; ++il) {
    const seq_state& q = st(il, seq_id);
    if (!paged_[il]) continue;
    rows = std::max(rows, n_keep >= q.n || n_keep >= p_.sink + q.n_comp
                              ? q.n_comp
                              : unit_ * (std::max(0, n_keep - p_.sink) / unit_));
  }
  if (pool_.on() && pool_.needs_copy(seq_id, rows) && pool_.n_free() == 0)
    fail_input("[kv_cache] truncate: seq " + std::to_string(seq_id) + " keeps part of a shared page, whose copy needs a "
               "free page; the pool has none");
  for (int il = 0; il < p_.n_layer; ++il) {
    seq_state& q = st(il, seq_id);
    if (n_keep == 0) lambda_set_[(size_t)il * p_.n_seq + seq_id] = 0;  // as clear: calibrate again
    if (n_keep >= q.n) continue;
    q.n = n_keep;
    if (q.n >= p_.sink + q.n_comp) continue;  // only the tail shrinks
    const int body_keep = std::max(0, q.n - p_.sink);
    const int n_comp_new = unit_ * (body_keep / unit_);
    q.body_lo = std::min(q.body_lo, n_comp_new);  // (above n_comp_new: nothing below it is held any more)
    const int moved = body_keep - n_comp_new;  // rows of a partial unit -> back to the exact tail
    if (moved > 0) {
      std::vector<float> y((size_t)moved * hd);
      for (int h = 0; h < p_.n_kv_head; ++h) {
        const size_t hi = head_index(il, seq_id, h);
        for (auto* s : {&k_, &v_}) {
          load_body_rows(*s, hi, n_comp_new, moved, y.data());
          for (int j = 0; j < moved; ++j) store_elems(exact_row(*s, hi, p_.sink + j), s->exact_elem, &y[(size_t)j * hd], hd);
        }
      }
    }
    q.n_comp = n_comp_new;
    q.fresh_id = 0;  // no exact copies after a truncate into the body
  }
  if (pool_.on()) {
    const auto [from, to] = pool_.shrink(seq_id, rows);
    if (from >= 0) copy_page(from, to);
  }
}

void kv_cache_quant::copy_page(int from, int to) {
  const size_t P = p_.page_size, nh = p_.n_kv_head;
  for (int il = 0; il < p_.n_layer; ++il) {
    if (!paged_[il]) continue;
    for (auto* s : {&k_, &v_}) {
      const size_t rows = nh * P, units = nh * s->scale_units(P);
      std::memcpy(s->codes.data() + (s->row0[il] + (size_t)to * rows) * s->code_row,
                  s->codes.data() + (s->row0[il] + (size_t)from * rows) * s->code_row, rows * s->code_row);
      if (s->scale_stride)
        std::memcpy(s->scales.data() + (s->unit0[il] + (size_t)to * units) * s->scale_stride,
                    s->scales.data() + (s->unit0[il] + (size_t)from * units) * s->scale_stride,
                    units * s->scale_stride * 2);
    }
  }
}

void kv_cache_quant::attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale,
                            float* out, thread_pool& pool) {
  const attend_seq one{seq_id, pos0, n_tokens, q, out};
  attend_seqs("attend", il, &one, 1, n_head, scale, pool);
}

void kv_cache_quant::attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                                  thread_pool& pool) {
  attend_seqs("attend_batch", il, seqs, n_seqs, n_head, scale, pool);
}

void kv_cache_quant::attend_staged(int il, const attend_seq* seqs, int n, int n_head, float scale, thread_pool& pool) {
  const int hd = p_.head_dim, nh = p_.n_kv_head, ng = n_head / nh;
  // items [item0[b], item0[b + 1]) are sequence b's: kv head h, query t at h * n_tokens + t
  std::vector<int64_t>& item0 = staged_item0_;
  item0.assign(1, 0);
  int64_t work = 0;
  for (int b = 0; b < n; ++b) {
    const attend_seq& a = seqs[b];
    const int n_st = staged_[(size_t)il * p_.n_seq + a.seq_id];
    item0.push_back(item0.back() + (int64_t)nh * a.n_tokens);
    work += (int64_t)a.n_tokens * n_head * std::min(n_st, a.pos0 + a.n_tokens) * hd * 4;
  }
  pool.parallel_for(item0.back(), work, [&](int64_t w, int) {
    const int b = (int)(std::upper_bound(item0.begin(), item0.end(), w) - item0.begin()) - 1;
    const attend_seq& a = seqs[b];
    const int n_st = staged_[(size_t)il * p_.n_seq + a.seq_id];
    const int64_t wi = w - item0[b];
    const int h = (int)(wi / a.n_tokens), t = (int)(wi % a.n_tokens);
    thread_local std::vector<float> o;
    thread_local std::vector<attn_state> sts;
    o.resize((size_t)ng * hd);
    sts.resize(ng);
    kv_dense_view dv;
    dv.n_pos = std::min(n_st, a.pos0 + t + 1);
    dv.type_k = k_.exact_elem;
    dv.type_v = v_.exact_elem;
    dv.pos_begin = 0;
    dv.row_stride = hd;  // (head h's rows of a block are one run)
    if (stage_in_pages(il) && dv.n_pos > stage_rows_) {
      // rows in several staging blocks: a paged view of head h's runs, read in place
      thread_local std::vector<const void*> pk, pv;
      const int n_blk = (dv.n_pos + stage_rows_ - 1) / stage_rows_;
      pk.resize(n_blk);
      pv.resize(n_blk);
      for (int j = 0; j < n_blk; ++j) {
        pk[j] = stage_row(k_, il, a.seq_id, h, j * stage_rows_);
        pv[j] = stage_row(v_, il, a.seq_id, h, j * stage_rows_);
      }
      dv.k_pages = pk.data();
      dv.v_pages = pv.data();
      dv.page_rows = stage_rows_;
      dv.page_row0 = 0;
    } else {
      dv.k = stage_row(k_, il, a.seq_id, h, 0);
      dv.v = stage_row(v_, il, a.seq_id, h, 0);
    }
    dv.head_dim = hd;
    attn_query_view qv;
    qv.q = a.q + ((size_t)t * n_head + (size_t)h * ng) * hd;
    qv.stride_t = (int64_t)n_head * hd;
    qv.n_tokens = 1;
    qv.n_group = ng;
    qv.head_dim = hd;
    qv.pos0 = a.pos0 + t;
    qv.spec = kv_layer_spec(p_, il, scale);
    for (int g = 0; g < ng; ++g) sts[g] = attn_state::empty(&o[(size_t)g * hd], hd);
    attn_dense(dv, qv, sts.data());
    for (int g = 0; g < ng; ++g) {
      float* out = a.out + ((size_t)t * n_head + h * ng + g) * hd;
      sts[g].finalize(out);
      if (v_.compressed) {  // V rows are d = v - ref (the query sees at least its own row)
        const float* ref = stage_ref(v_, il, a.seq_id, h);
        for (int c = 0; c < hd; ++c) out[c] += ref[c];
      }
    }
  });
}

void kv_cache_quant::attend_seqs(const char* op, int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                                 thread_pool& pool) {
  check_attend_seqs(p_, op, il, seqs, n_seqs, n_head, [&](int seq) { return held(il, seq); });
  if (cal_n_ > 0) {
    // Queries below the calibration positions see the staging rows alone (what every split of the
    // appends gives them); the rest go through the store, calibrated by then.
    std::vector<attend_seq> rest, staged;
    for (int b = 0; b < n_seqs; ++b) {
      attend_seq a = seqs[b];
      const int n_st = std::clamp(cal_n_ - a.pos0, 0, a.n_tokens);
      if (n_st > 0) {
        attend_seq s = a;
        s.n_tokens = n_st;
        staged.push_back(s);
      }
      if (n_st == a.n_tokens) continue;
      a.pos0 += n_st;
      a.q += (size_t)n_st * n_head * p_.head_dim;
      a.out += (size_t)n_st * n_head * p_.head_dim;
      a.n_tokens -= n_st;
      rest.push_back(a);
    }
    if (!staged.empty()) {
      attend_staged(il, staged.data(), (int)staged.size(), n_head, scale, pool);
      if (!rest.empty()) attend_seqs(op, il, rest.data(), (int)rest.size(), n_head, scale, pool);
      return;
    }
  }
  for (int b = 0; b < n_seqs; ++b) {
    // the body rows the first query needs (later queries need later rows) must still be in the ring
    const seq_state& sq = st(il, seqs[b].seq_id);
    const int need = kv_layer_spec(p_, il, 1.0f).key_range(seqs[b].pos0).lo - p_.sink;
    if (need < sq.n_comp)
      check_ring_holds(p_, op, il, seqs[b].seq_id, p_.sink + std::max(0, need), p_.sink + sq.body_lo);
  }
  if (n_seqs == 0) return;
  const int hd = p_.head_dim, nh = p_.n_kv_head, ng = n_head / nh;
  const bool k_int8 = k_.t->layout == kv_layout::per_token;
  // 1. Work items (attend_plan.h): (sequence, kv head, query tile, body chunk); the chunks split a
  // sequence's body rows [body0, n_comp), body0 the first unit any of its queries sees.
  const attn_spec spec = kv_layer_spec(p_, il, scale);
  plan_in_.resize(n_seqs);
  int64_t work = 0;  // multiply-adds of the batch: decides whether threads pay at all
  for (int b = 0; b < n_seqs; ++b) {
    const seq_state& sq = st(il, seqs[b].seq_id);
    const int lo = std::max(0, spec.key_range(seqs[b].pos0).lo - p_.sink);
    plan_in_[b].n_tokens = seqs[b].n_tokens;
    // the chunks split the body (chunk 0 also attends the exact rows)
    plan_in_[b].split_hi = sq.n_comp;
    plan_in_[b].split_lo = std::min(lo, sq.n_comp) / unit_ * unit_;
    const int64_t keys = spec.window > 0 ? std::min<int64_t>(spec.window, sq.n) : sq.n;
    work += (int64_t)seqs[b].n_tokens * n_head * keys * hd * 2;
  }
  // Views of the body start at multiples of kQ rows from a segment start (attend_plan.h), so that
  // the kernels' key blocks (32 / 64 rows from a view's start) and KIVI groups (U rows) fall on
  // the same rows for every query tile and split.
  const int kQ = std::lcm(64, unit_);
  attend_plan_options opt;
  opt.chunk_align = kQ;
  plan_.plan(plan_in_.data(), n_seqs, nh, n_head, hd, pool.size(), opt);
  // The batch's tokens are numbered across sequences: sequence b holds [tok0(b), tok0(b + 1)).
  const int n_tok = plan_.n_tokens();
  const size_t nq = (size_t)n_tok * n_head;
  // 2. Q rotated once (and scaled by λ_K), then, when K is per-token quantized, int8 (int16 for
  // 8-bit K) with one scale per K group.
  qr_.resize(nq * hd);
  for (int b = 0; b < n_seqs; ++b)
    std::memcpy(&qr_[(size_t)plan_.tok0(b) * n_head * hd], seqs[b].q, (size_t)seqs[b].n_tokens * n_head * hd * sizeof(float));
  const int qg = k_int8 ? k_.group : hd, nqg = hd / qg;  // one query scale per K group
  const bool q16 = k_int8 && k_.t->bits == 8;             // 8-bit K: an int16 query
  if (k_int8) {
    if (q16) q16_.resize(nq * hd);
    else q8_.resize(nq * hd);
    q8s_.resize(nq * nqg);
  }
  pool.parallel_for(n_tok, (int64_t)nq * hd * 8, [&](int64_t t, int) {
    float* r = &qr_[(size_t)t * n_head * hd];
    if (!k_.lambda.empty())
      for (int h = 0; h < n_head; ++h) {
        const float* lam = &k_.lambda[head_index(il, seqs[plan_.seq_of_token((int)t)].seq_id, h / ng) * hd];
        for (int c = 0; c < hd; ++c) r[(size_t)h * hd + c] *= lam[c];
      }
    k_.rot.forward_n(r, n_head);
    for (int h = 0; h < n_head; ++h) {
      float* x = r + (size_t)h * hd;
      if (k_int8) {
        const size_t i = (size_t)t * n_head + h;
        for (int gi = 0; gi < nqg; ++gi)
          q8s_[i * nqg + gi] = q16 ? quantize_q16_ref(x + gi * qg, qg, &q16_[i * hd + gi * qg])
                                   : quantize_q8_ref(x + gi * qg, qg, &q8_[i * hd + gi * qg]);
      }
    }
  });
  const bool dequant = p_.attn == attn_path::dequant;
  plan_.run(pool, work, [&](const attend_item& w) {
    const attend_seq& a = seqs[w.seq];
    const seq_state& sq = st(il, a.seq_id);
    const int h = w.kv_head, ta = w.ta, tb = w.tb;
    const size_t qbase = (size_t)plan_.tok0(w.seq) * n_head;  // the sequence's first query in the batch buffers
    const size_t hi = head_index(il, a.seq_id, h);
    const int pos0 = a.pos0;
    attn_query_view qv;
    qv.q = &qr_[(qbase + (size_t)ta * n_head + (size_t)h * ng) * hd];
    qv.stride_t = (int64_t)n_head * hd;
    qv.n_tokens = tb - ta;
    qv.n_group = ng;
    qv.head_dim = hd;
    qv.pos0 = pos0 + ta;
    qv.spec = spec;
    if (k_int8) {
      if (q16) qv.q16 = &q16_[(qbase + (size_t)ta * n_head + (size_t)h * ng) * hd];
      else qv.q8 = &q8_[(qbase + (size_t)ta * n_head + (size_t)h * ng) * hd];
      qv.q8_scale = &q8s_[(qbase + (size_t)ta * n_head + (size_t)h * ng) * nqg];
      qv.q8_scale_stride_t = (int64_t)n_head * nqg;
      qv.q8_group = qg;
    }
    attn_state* sts = plan_.begin(w, a.out);
    const int n_sink = std::min(sq.n, p_.sink), n_tail = tail_len(sq);
    // queries [t, t + n) of the tile alone
    auto sub = [&](int t, int n) {
      attn_query_view v = qv;
      const int64_t dt = t - ta;
      v.q += dt * qv.stride_t;
      if (v.q16) v.q16 += dt * qv.stride_t;
      if (v.q8) v.q8 += dt * qv.stride_t;
      if (v.q8_scale) v.q8_scale += dt * qv.q8_scale_stride_t;
      v.n_tokens = n;
      v.pos0 = pos0 + t;
      return v;
    };
    // compressed body rows [r0, r1) for the queries of `v` (in at most two pieces of a ring)
    auto body_pass = [&](int r0, int r1, const attn_query_view& v, attn_state* ls) {
      for (int a0 = r0; a0 < r1;) {
        const int ring = ring_[il], a1 = std::min(r1, a0 + ring - a0 % ring);
        kv_quant_view kv;
        for (auto [side, s] : {std::pair{&kv.k, &k_}, std::pair{&kv.v, &v_}}) {
          side->format = s->format;
          side->codes = body_codes(*s, hi, a0);
          side->code_stride = (int64_t)s->code_row;
          side->scales = s->scale_stride ? body_scales(*s, hi, s->unit_of_row(a0)) : nullptr;
          side->scale_stride = s->scale_stride;
          side->group = s->group;
          // a paged view spanning pages: its rows (and scale units) gathered into one run, so that
          // the kernel sees the contiguous cache's view (its results depend on the view only)
          if (paged_[il] && a0 / p_.page_size != (a1 - 1) / p_.page_size) gather(*s, hi, a0, a1, *side);
        }
        kv.pos_begin = p_.sink + a0;
        kv.n_pos = a1 - a0;
        kv.head_dim = hd;
        dequant ? attn_dequant_ref(kv, v, ls) : attn_quant(kv, v, ls);
        a0 = a1;
      }
    };
    // Query t sees body rows [0, e(t)) compressed: what a decode step at its position leaves
    // compressed, comp_rule(pos + 1), however the prompt was split into appends; rows [F, N) the
    // latest append compressed while a query of its batch still sees them exact have exact copies
    // (fresh_rows). e(t) grows with t.
    const int F = fresh_lo(il, a.seq_id), N = sq.n_comp;
    auto e_of = [&](int t) { return std::clamp(comp_rule(pos0 + t + 1), F, N); };
    // The canonical order (attend_plan.h): chunk 0 first attends the exact rows as one state (the
    // sink, then body rows [e(t), N) and the tail as the one view a decode step at the query's
    // position would attend), then every segment of the body as its own state.
    if (w.chunk == 0 && (n_sink > 0 || n_tail > 0 || F < N)) {
      plan_.accumulate(w, sts, [&](attn_state* ls) {
        kv_dense_view dv;
        dv.type_k = k_.exact_elem;
        dv.type_v = v_.exact_elem;
        dv.row_stride = hd;
        dv.head_dim = hd;
        if (n_sink > 0) {
          dv.k = exact_row(k_, hi, 0);
          dv.v = exact_row(v_, hi, 0);
          dv.pos_begin = 0;
          dv.n_pos = n_sink;
          attn_dense(dv, qv, ls);
        }
        int tn = tb;  // queries [tn, tb) have e == N: the tail as stored
        while (tn > ta && e_of(tn - 1) == N) --tn;
        if (n_tail > 0 && tn < tb && p_.sink + N <= pos0 + tb - 1) {
          dv.k = exact_row(k_, hi, p_.sink);
          dv.v = exact_row(v_, hi, p_.sink);
          dv.pos_begin = p_.sink + N;
          dv.n_pos = n_tail;
          attn_dense(dv, sub(tn, tb - tn), ls + (int64_t)(tn - ta) * ng);
        }
        const fresh_rows& f = fresh_[a.seq_id];  // (e < N: F < N, the copies are this layer's)
        for (int t = ta; t < tn; ++t) {
          const int e = e_of(t);
          if (p_.sink + e > pos0 + t) continue;
          dv.k = fresh_row(k_, f, h, e);
          dv.v = fresh_row(v_, f, h, e);
          dv.pos_begin = p_.sink + e;
          dv.n_pos = f.lo + f.n - e;
          attn_dense(dv, sub(t, 1), ls + (int64_t)(t - ta) * ng);
        }
      });
    }
    // The body, segment by segment: rows [s0, min(s1, e(t))) for query t, as one view from s0 for
    // the tile up to A (kQ-aligned, at most the smallest e(t) that ends before the causal bound)
    // and per query from A on, continuing the same state (the kernels' blocks stay those of one view).
    const int tile_lo = std::max(0, spec.key_range(pos0 + ta).lo - p_.sink) / unit_ * unit_;
    plan_.for_each_segment(std::max(w.row_lo, tile_lo), std::min(w.row_hi, N), [&](int s0, int s1) {
      if (p_.sink + s0 > pos0 + tb - 1) return;  // no query of the tile reaches it
      int emin = s1;
      for (int t = ta; t < tb; ++t) {
        const int e = e_of(t);
        if (e < std::min(s1, pos0 + t + 1 - p_.sink)) emin = std::min(emin, std::max(e, s0));
      }
      plan_.accumulate(w, sts, [&](attn_state* ls) {
        if (emin == s1) return body_pass(s0, s1, qv, ls);
        const int A = s0 + (emin - s0) / kQ * kQ;
        if (A > s0) body_pass(s0, A, qv, ls);
        for (int t = ta; t < tb; ++t) {
          const int e1 = std::min(s1, e_of(t));
          if (e1 > A && p_.sink + A <= pos0 + t) body_pass(A, e1, sub(t, 1), ls + (int64_t)(t - ta) * ng);
        }
      });
    });
  });
  // 4. merge the chunks, normalise, undo λ_V and the V rotation once per head
  pool.parallel_for(n_tok, (int64_t)nq * hd * 8, [&](int64_t tg, int) {
    const int b = plan_.seq_of_token((int)tg);
    const int t = (int)tg - plan_.tok0(b);
    float* out = seqs[b].out;
    plan_.finish_token((int)tg, out);
    v_.rot.inverse_n(out + (size_t)t * n_head * hd, n_head);
    if (!v_.lambda.empty())
      for (int hq = 0; hq < n_head; ++hq) {
        const size_t off = head_index(il, seqs[b].seq_id, hq / ng) * hd;
        float* o = out + ((size_t)t * n_head + hq) * hd;
        for (int x = 0; x < hd; ++x) o[x] = o[x] * v_.lambda[off + x] + v_.mu[off + x];
      }
  });
}

}  // namespace

std::unique_ptr<kv_cache> make_kv_cache_quant(const kv_cache_params& p) { return std::make_unique<kv_cache_quant>(p); }

std::vector<uint8_t> kv_cache_stored_bytes(const kv_cache& c, int il, int seq_id) {
  const auto* q = dynamic_cast<const kv_cache_quant*>(&c);
  KVQ_ASSERT(q != nullptr);
  return q->stored_bytes(il, seq_id);
}

double kv_bytes_per_token_quant(const kv_cache_params& p) { return kv_cache_quant(p, false).bytes_per_token(); }

size_t kv_layer_bytes_quant(const kv_cache_params& p, int il) { return kv_cache_quant(p, false).layer_bytes(il); }

size_t kv_bytes_at_ctx_quant(const kv_cache_params& p) { return kv_cache_quant(p, false).planned_bytes(); }

size_t kv_page_bytes_quant(const kv_cache_params& p) { return kv_cache_quant(p, false).page_bytes(); }

void kv_channel_stats_ref(const float* x, int n_tokens, int n_kv_head, int head_dim, float* mu, float* lambda) {
  const int hd = head_dim, nh = n_kv_head;
  KVQ_ASSERT(n_tokens >= 1);
  for (int h = 0; h < nh; ++h) {
    std::vector<double> mean(hd, 0.0), rms(hd, 0.0);
    for (int t = 0; t < n_tokens; ++t)
      for (int c = 0; c < hd; ++c) mean[c] += x[((size_t)t * nh + h) * hd + c];
    for (auto& m : mean) m /= n_tokens;
    for (int t = 0; t < n_tokens; ++t)
      for (int c = 0; c < hd; ++c) {
        const double d = x[((size_t)t * nh + h) * hd + c] - mean[c];
        rms[c] += d * d;
      }
    double mx = 0.0;
    for (auto& r : rms) mx = std::max(mx, r = std::sqrt(r / n_tokens));
    float* lam = lambda + (size_t)h * hd;
    float* mu_h = mu + (size_t)h * hd;
    for (int c = 0; c < hd; ++c) mu_h[c] = f16_to_f32(f32_to_f16((float)mean[c]));
    if (!(mx > 0.0)) {
      std::fill(lam, lam + hd, 1.0f);
      continue;
    }
    std::vector<int> e(hd);
    double mean_e = 0.0;
    for (int c = 0; c < hd; ++c) {
      e[c] = (int)std::lround(std::log2(std::max(rms[c], mx * 1e-3)));
      mean_e += e[c];
    }
    const int shift = (int)std::lround(mean_e / hd);
    for (int c = 0; c < hd; ++c) lam[c] = std::ldexp(1.0f, std::clamp(e[c] - shift, -20, 20));
  }
}

}  // namespace kvq
