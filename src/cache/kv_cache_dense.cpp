// Dense f32/f16/bf16 KV cache: contiguous, allocated up front, bytes() exact. A sliding-window
// layer holds a ring of kv_ring_positions() positions per (sequence, kv head): position p in slot
// p % ring. Paged (page_size > 0): the global layers' rows live in the page pool
// (kv_page_pool.h), position p of a sequence on page table[p / page_size], slot p % page_size.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cache/attend_plan.h"
#include "cache/kv_cache_impl.h"
#include "cache/kv_page_pool.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

const char* elem_name(kv_elem e) {
  switch (e) {
    case kv_elem::f32: return "f32";
    case kv_elem::f16: return "f16";
    default: return "bf16";
  }
}

void store_row(void* dst, kv_elem e, const float* src, int n) {
  switch (e) {
    case kv_elem::f32: std::memcpy(dst, src, (size_t)n * 4); break;
    case kv_elem::f16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      break;
    }
    default: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      break;
    }
  }
}

bool paged_layer(const kv_cache_params& p, int il) { return p.page_size > 0 && kv_layer_window(p, il) == 0; }
int pages_per_seq(const kv_cache_params& p) { return (p.n_ctx + p.page_size - 1) / p.page_size; }
int pool_pages(const kv_cache_params& p) { return p.n_pages > 0 ? p.n_pages : p.n_seq * pages_per_seq(p); }
// Rows of one side of layer il: every sequence and kv head at its ring's positions, or the pool's pages.
size_t dense_rows(const kv_cache_params& p, int il) {
  if (paged_layer(p, il)) return (size_t)pool_pages(p) * p.n_kv_head * p.page_size;
  return (size_t)p.n_seq * p.n_kv_head * kv_ring_positions(p, il);
}
size_t dense_rows(const kv_cache_params& p) {
  size_t r = 0;
  for (int il = 0; il < p.n_layer; ++il) r += dense_rows(p, il);
  return r;
}

class kv_cache_dense final : public kv_cache {
 public:
  explicit kv_cache_dense(const kv_cache_params& p)
      : p_(p), ek_(dense_elem_of(p.type_k)), ev_(dense_elem_of(p.type_v)) {
    row0_.assign(p.n_layer + 1, 0);
    for (int il = 0; il < p.n_layer; ++il) {
      ring_.push_back(kv_ring_positions(p, il));
      row0_[il + 1] = row0_[il] + dense_rows(p, il);
    }
    const size_t rows = row0_[p.n_layer];
    k_.assign(rows * p.head_dim * kv_elem_bytes(ek_), 0);
    v_.assign(rows * p.head_dim * kv_elem_bytes(ev_), 0);
    pos_.assign((size_t)p.n_layer * p.n_seq, 0);
    first_.assign((size_t)p.n_layer * p.n_seq, 0);
    if (p.page_size > 0) {
      pool_.init(p.page_size, pool_pages(p), p.n_seq, pages_per_seq(p));
      for (int il = 0; il < p.n_layer; ++il) {
        paged_.push_back(paged_layer(p, il));
        page_bytes_ += paged_.back() ? (size_t)p.n_kv_head * p.page_size * p.head_dim *
                                           (kv_elem_bytes(ek_) + kv_elem_bytes(ev_))
                                     : 0;
      }
    } else {
      paged_.assign(p.n_layer, false);
    }
  }

  const kv_cache_params& params() const override { return p_; }

  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override {
    check_layer_seq("append", il, seq_id);
    int& pos = pos_[(size_t)il * p_.n_seq + seq_id];
    check_append_order(il, seq_id, n_tokens, p_.n_layer, p_.n_ctx, pos,
                       il > 0 ? pos_[(size_t)(il - 1) * p_.n_seq + seq_id] : 0, n_pos(seq_id));
    check_ring_append(p_, il, n_tokens);
    if (paged_[il]) {  // pages first: nothing is written when the pool is out of pages
      pool_.check_grow("append", seq_id, pos + n_tokens);
      pool_.grow(seq_id, pos + n_tokens);
    }
    const int hd = p_.head_dim;
    for (int t = 0; t < n_tokens; ++t)
      for (int h = 0; h < p_.n_kv_head; ++h) {
        const int64_t r = row_index(il, seq_id, h, pos + t);
        const float* ks = k + ((int64_t)t * p_.n_kv_head + h) * hd;
        const float* vs = v + ((int64_t)t * p_.n_kv_head + h) * hd;
        store_row(k_.data() + r * hd * kv_elem_bytes(ek_), ek_, ks, hd);
        store_row(v_.data() + r * hd * kv_elem_bytes(ev_), ev_, vs, hd);
      }
    pos += n_tokens;
    int& first = first_[(size_t)il * p_.n_seq + seq_id];
    first = std::max(first, pos - ring_[il]);
  }

  void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q, float scale,
              float* out, thread_pool& pool) override {
    const attend_seq one{seq_id, pos0, n_tokens, q, out};
    attend_seqs("attend", il, &one, 1, n_head, scale, pool);
  }
  void attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                    thread_pool& pool) override {
    attend_seqs("attend_batch", il, seqs, n_seqs, n_head, scale, pool);
  }
  int n_pos(int seq_id) const override {
    if (seq_id < 0 || seq_id >= p_.n_seq) return 0;
    return pos_[(size_t)(p_.n_layer - 1) * p_.n_seq + seq_id];
  }
  void clear(int seq_id) override { truncate(seq_id, 0); }
  void truncate(int seq_id, int n) override {
    check_layer_seq("truncate", 0, seq_id);
    if (n < 0) fail_input("[kv_cache] truncate: n_pos must be >= 0, got " + std::to_string(n));
    int rows = 0;  // positions any layer keeps
    for (int il = 0; il < p_.n_layer; ++il) rows = std::max(rows, std::min(pos_[(size_t)il * p_.n_seq + seq_id], n));
    if (pool_.on() && pool_.needs_copy(seq_id, rows) && pool_.n_free() == 0)
      fail_input("[kv_cache] truncate: seq " + std::to_string(seq_id) + " keeps part of a shared page, whose copy needs a "
                 "free page; the pool has none");
    for (int il = 0; il < p_.n_layer; ++il) {
      int& pos = pos_[(size_t)il * p_.n_seq + seq_id];
      pos = std::min(pos, n);
      int& first = first_[(size_t)il * p_.n_seq + seq_id];
      first = std::min(first, pos);  // (first > pos: nothing below pos is held any more)
    }
    if (pool_.on()) {
      const auto [from, to] = pool_.shrink(seq_id, rows);
      if (from >= 0) copy_page(from, to);
    }
  }
  size_t bytes() const override { return k_.size() + v_.size(); }
  size_t bytes_used() const override {
    size_t rows = 0;
    for (int il = 0; il < p_.n_layer; ++il)
      if (!paged_[il])
        for (int s = 0; s < p_.n_seq; ++s) rows += (size_t)std::min(pos_[(size_t)il * p_.n_seq + s], ring_[il]);
    const size_t pages = pool_.on() ? (size_t)pool_.n_seq_held() : 0;  // (not those only pinned)
    return rows * p_.n_kv_head * p_.head_dim * (size_t)(kv_elem_bytes(ek_) + kv_elem_bytes(ev_)) + pages * page_bytes_;
  }
  kv_page_info page_info() const override { return pool_.info(page_bytes_); }
  std::vector<int> seq_pages(int seq_id) const override {
    check_layer_seq("seq_pages", 0, seq_id);
    return pool_.on() ? pool_.table(seq_id) : std::vector<int>{};
  }
  int pages_for(int n) const override { return pool_.pages_for(n, p_.n_ctx); }
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
    return kv_save_paged_prefix(this, pool_, seq_id, n_pos(seq_id), paged_rows(seq_id), seq_regions(seq_id));
  }
  void load_prefix(int seq_id, const kv_prefix& p) override {
    check_layer_seq("load_prefix", 0, seq_id);
    if (!can_save_prefix()) kv_cache::load_prefix(seq_id, p);
    const auto [from, to] = kv_load_paged_prefix(this, pool_, seq_id, n_pos(seq_id), p, seq_regions(seq_id));
    if (from >= 0) copy_page(from, to);
  }
  std::string describe() const override {
    return std::string("K ") + elem_name(ek_) + " / V " + elem_name(ev_) + " (dense)";
  }

 private:
  void check_layer_seq(const char* op, int il, int seq_id) const { kvq::check_layer_seq(p_, op, il, seq_id); }
  // attend / attend_batch through the planner (attend_plan.h): items (sequence, kv head, query
  // tile, key chunk), the chunks splitting the positions the sequence's queries see (split-K).
  void attend_seqs(const char* op, int il, const attend_seq* seqs, int n_seqs, int n_head, float scale,
                   thread_pool& pool) {
    check_attend_seqs(p_, op, il, seqs, n_seqs, n_head, [&](int seq) { return pos_[(size_t)il * p_.n_seq + seq]; });
    const attn_spec spec = kv_layer_spec(p_, il, scale);
    for (int b = 0; b < n_seqs; ++b)
      check_ring_holds(p_, op, il, seqs[b].seq_id, spec.key_range(seqs[b].pos0).lo,
                       first_[(size_t)il * p_.n_seq + seqs[b].seq_id]);
    if (n_seqs == 0) return;
    const int hd = p_.head_dim, nh = p_.n_kv_head, ng = n_head / nh, ring = ring_[il];
    plan_in_.resize(n_seqs);
    int64_t work = 0;  // multiply-adds: decides whether threads pay at all
    for (int b = 0; b < n_seqs; ++b) {
      const attend_seq& a = seqs[b];
      plan_in_[b].n_tokens = a.n_tokens;
      plan_in_[b].split_lo = spec.key_range(a.pos0).lo;
      plan_in_[b].split_hi = a.pos0 + a.n_tokens;
      const int64_t keys = plan_in_[b].split_hi - plan_in_[b].split_lo;
      work += (int64_t)a.n_tokens * n_head * keys * hd * 2;
    }
    plan_.plan(plan_in_.data(), n_seqs, nh, n_head, hd, pool.size());
    plan_.run(pool, work, [&](const attend_item& w) {
      const attend_seq& a = seqs[w.seq];
      attn_query_view qv;
      qv.q = a.q + ((int64_t)w.ta * n_head + (int64_t)w.kv_head * ng) * hd;
      qv.stride_t = (int64_t)n_head * hd;
      qv.n_tokens = w.tb - w.ta;
      qv.n_group = ng;
      qv.head_dim = hd;
      qv.pos0 = a.pos0 + w.ta;
      qv.spec = spec;
      attn_state* sts = plan_.begin(w, a.out);
      // the chunk's keys that the tile's queries see, one state per segment (the canonical merge
      // order, attend_plan.h), each in at most two contiguous pieces of the ring
      const int lo_all = std::max(w.row_lo, spec.key_range(a.pos0 + w.ta).lo);
      const int hi_all = std::min(w.row_hi, a.pos0 + w.tb);
      plan_.for_each_segment(lo_all, hi_all, [&](int lo, int hi) {
      plan_.accumulate(w, sts, [&](attn_state* ls) {
        kv_dense_view kv;
        kv.type_k = ek_;
        kv.type_v = ev_;
        kv.row_stride = hd;
        kv.head_dim = hd;
        if (paged_[il]) {
          // One view over rows [lo, hi), as the contiguous cache passes it (the kernels' results
          // depend on the view's rows and bounds only): pages gathered into per-thread rows when
          // the view spans several.
          kv.k = gather(il, a.seq_id, w.kv_head, lo, hi, k_, ek_, gk_);
          kv.v = gather(il, a.seq_id, w.kv_head, lo, hi, v_, ev_, gv_);
          kv.pos_begin = lo;
          kv.n_pos = hi - lo;
          attn_dense(kv, qv, ls);
          return;
        }
        for (int r = lo; r < hi;) {
          const int r1 = std::min(hi, r + ring - r % ring);
          kv.k = k_.data() + row_index(il, a.seq_id, w.kv_head, r) * hd * kv_elem_bytes(ek_);
          kv.v = v_.data() + row_index(il, a.seq_id, w.kv_head, r) * hd * kv_elem_bytes(ev_);
          kv.pos_begin = r;
          kv.n_pos = r1 - r;
          attn_dense(kv, qv, ls);
          r = r1;
        }
      });
      });
    });
    const int n_tok = plan_.n_tokens();
    pool.parallel_for(n_tok, (int64_t)n_tok * n_head * hd * 8,
                      [&](int64_t tg, int) { plan_.finish_token((int)tg, seqs[plan_.seq_of_token((int)tg)].out); });
  }
  // Positions of seq_id the paged layers hold (rows [0, n) of its pages).
  int paged_rows(int seq_id) const {
    int rows = 0;
    for (int il = 0; il < p_.n_layer; ++il)
      if (paged_[il]) rows = std::max(rows, pos_[(size_t)il * p_.n_seq + seq_id]);
    return rows;
  }
  // What seq_id holds outside pages (save_prefix / load_prefix): per layer its position counters
  // and, for a sliding-window layer, its ring of rows (K and V, every kv head).
  std::vector<kv_seq_region> seq_regions(int seq_id) {
    std::vector<kv_seq_region> r;
    for (int il = 0; il < p_.n_layer; ++il) {
      const size_t i = (size_t)il * p_.n_seq + seq_id;
      r.push_back({reinterpret_cast<uint8_t*>(&pos_[i]), sizeof(int)});
      r.push_back({reinterpret_cast<uint8_t*>(&first_[i]), sizeof(int)});
      if (paged_[il]) continue;
      const size_t rows = (size_t)p_.n_kv_head * ring_[il], hd = p_.head_dim;
      const size_t row0 = row0_[il] + (size_t)seq_id * rows;
      r.push_back({k_.data() + row0 * hd * kv_elem_bytes(ek_), rows * hd * kv_elem_bytes(ek_)});
      r.push_back({v_.data() + row0 * hd * kv_elem_bytes(ev_), rows * hd * kv_elem_bytes(ev_)});
    }
    return r;
  }
  // Row of position pos: layer il's rows start at row0_[il], then [n_seq, n_kv_head, ring], or
  // for a paged layer [n_pages, n_kv_head, page_size]
  int64_t row_index(int il, int seq, int h, int pos) const {
    if (paged_[il]) {
      const int pg = pool_.page_of(seq, (size_t)pos);
      return (int64_t)row0_[il] + ((int64_t)pg * p_.n_kv_head + h) * p_.page_size + pos % p_.page_size;
    }
    return (int64_t)row0_[il] + ((int64_t)seq * p_.n_kv_head + h) * ring_[il] + pos % ring_[il];
  }
  // Rows [lo, hi) of kv head h of a paged layer as one contiguous run: in place when on one page,
  // else copied page by page into the calling thread's buffer `buf`.
  const void* gather(int il, int seq, int h, int lo, int hi, const std::vector<uint8_t>& side, kv_elem e,
                     std::vector<uint8_t>& buf) const {
    const size_t rb = (size_t)p_.head_dim * kv_elem_bytes(e);
    const int P = p_.page_size;
    if (lo / P == (hi - 1) / P) return side.data() + row_index(il, seq, h, lo) * rb;
    buf.resize((size_t)(hi - lo) * rb);
    for (int r = lo; r < hi;) {
      const int r1 = std::min(hi, (r / P + 1) * P);
      std::memcpy(buf.data() + (size_t)(r - lo) * rb, side.data() + row_index(il, seq, h, r) * rb, (size_t)(r1 - r) * rb);
      r = r1;
    }
    return buf.data();
  }
  // Copy on write (truncate into a shared page): page `from`'s rows of every paged layer to page `to`.
  void copy_page(int from, int to) {
    for (int il = 0; il < p_.n_layer; ++il) {
      if (!paged_[il]) continue;
      for (auto [side, e] : {std::pair{&k_, ek_}, std::pair{&v_, ev_}}) {
        const size_t bytes = (size_t)p_.n_kv_head * p_.page_size * p_.head_dim * kv_elem_bytes(e);
        std::memcpy(side->data() + row_index_page(il, to) * p_.head_dim * kv_elem_bytes(e),
                    side->data() + row_index_page(il, from) * p_.head_dim * kv_elem_bytes(e), bytes);
      }
    }
  }
  int64_t row_index_page(int il, int pg) const { return (int64_t)row0_[il] + (int64_t)pg * p_.n_kv_head * p_.page_size; }

  kv_cache_params p_;
  kv_elem ek_, ev_;
  std::vector<int> ring_;       // [n_layer] positions held per (seq, kv head): n_ctx, or a window's ring
  std::vector<size_t> row0_;    // [n_layer + 1] first row of each layer
  std::vector<uint8_t> k_;      // per layer [n_seq, n_kv_head, ring, head_dim] of ek_
  std::vector<uint8_t> v_;      // per layer [n_seq, n_kv_head, ring, head_dim] of ev_
  std::vector<int> pos_;        // [n_layer, n_seq] positions stored per layer
  std::vector<int> first_;      // [n_layer, n_seq] oldest position still held (ring layers)
  std::vector<bool> paged_;     // [n_layer] rows in the page pool (global layers of a paged cache)
  kv_page_pool pool_;
  size_t page_bytes_ = 0;       // one page, every paged layer, K and V
  static thread_local std::vector<uint8_t> gk_, gv_;  // gather buffers (per thread)
  std::vector<attend_plan_seq> plan_in_;  // attend scratch (one call at a time per cache)
  attend_planner plan_;
};

thread_local std::vector<uint8_t> kv_cache_dense::gk_, kv_cache_dense::gv_;

}  // namespace

size_t kv_page_bytes_dense(const kv_cache_params& p) {
  size_t b = 0;
  for (int il = 0; il < p.n_layer; ++il)
    if (kv_layer_window(p, il) == 0)
      b += (size_t)p.n_kv_head * p.page_size * p.head_dim *
           (kv_elem_bytes(dense_elem_of(p.type_k)) + kv_elem_bytes(dense_elem_of(p.type_v)));
  return b;
}

std::unique_ptr<kv_cache> make_kv_cache_dense(const kv_cache_params& p) {
  return std::make_unique<kv_cache_dense>(p);
}

size_t kv_bytes_at_ctx_dense(const kv_cache_params& p) {
  return dense_rows(p) * p.head_dim * (kv_elem_bytes(dense_elem_of(p.type_k)) + kv_elem_bytes(dense_elem_of(p.type_v)));
}

double kv_bytes_per_token_dense(const kv_cache_params& p) {
  int n_global = 0;
  for (int il = 0; il < p.n_layer; ++il) n_global += kv_layer_window(p, il) == 0;
  return (double)n_global * p.n_kv_head * p.head_dim *
         (kv_elem_bytes(dense_elem_of(p.type_k)) + kv_elem_bytes(dense_elem_of(p.type_v)));
}

size_t kv_layer_bytes_dense(const kv_cache_params& p, int il) {
  return dense_rows(p, il) * p.head_dim * (kv_elem_bytes(dense_elem_of(p.type_k)) + kv_elem_bytes(dense_elem_of(p.type_v)));
}

}  // namespace kvq
