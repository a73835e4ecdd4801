// Dense f32/f16/bf16 KV cache: contiguous, allocated up front, bytes() exact. A sliding-window
// layer holds a ring of kv_ring_positions() positions per (sequence, kv head): position p in slot
// p % ring.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cache/kv_cache_impl.h"
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

// Rows of one side of layer il: every sequence and kv head at its ring's positions.
size_t dense_rows(const kv_cache_params& p, int il) { return (size_t)p.n_seq * p.n_kv_head * kv_ring_positions(p, il); }
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
      window_.push_back(kv_layer_window(p, il));
      row0_[il + 1] = row0_[il] + dense_rows(p, il);
    }
    const size_t rows = row0_[p.n_layer];
    k_.assign(rows * p.head_dim * kv_elem_bytes(ek_), 0);
    v_.assign(rows * p.head_dim * kv_elem_bytes(ev_), 0);
    pos_.assign((size_t)p.n_layer * p.n_seq, 0);
    first_.assign((size_t)p.n_layer * p.n_seq, 0);
  }

  const kv_cache_params& params() const override { return p_; }

  void append(int il, int seq_id, int n_tokens, const float* k, const float* v) override {
    check_layer_seq("append", il, seq_id);
    int& pos = pos_[(size_t)il * p_.n_seq + seq_id];
    check_append_order(il, seq_id, n_tokens, p_.n_layer, p_.n_ctx, pos,
                       il > 0 ? pos_[(size_t)(il - 1) * p_.n_seq + seq_id] : 0, n_pos(seq_id));
    check_ring_append(p_, il, n_tokens);
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
    check_layer_seq("attend", il, seq_id);
    const int have = pos_[(size_t)il * p_.n_seq + seq_id];
    if (n_tokens < 1 || pos0 < 0 || (int64_t)pos0 + n_tokens > have)
      fail_input("[kv_cache] attend: queries at positions [" + std::to_string(pos0) + ", " +
                 std::to_string((int64_t)pos0 + n_tokens) + ") need appended positions, layer " +
                 std::to_string(il) + " of seq " + std::to_string(seq_id) + " holds " + std::to_string(have));
    if (n_head < p_.n_kv_head || n_head % p_.n_kv_head != 0)
      fail_input("[kv_cache] attend: n_head " + std::to_string(n_head) + " is not a multiple of n_kv_head " +
                 std::to_string(p_.n_kv_head));
    attn_spec spec;
    spec.scale = scale;
    spec.window = window_[il];
    spec.softcap = p_.attn_softcap;
    check_ring_holds(p_, "attend", il, seq_id, spec.key_range(pos0).lo, first_[(size_t)il * p_.n_seq + seq_id]);
    const int hd = p_.head_dim, n_group = n_head / p_.n_kv_head, ring = ring_[il];
    const int64_t n_items = (int64_t)p_.n_kv_head * n_tokens;
    const int64_t keys = spec.window > 0 ? std::min<int64_t>(spec.window, (int64_t)pos0 + n_tokens) : (int64_t)pos0 + n_tokens;
    const int64_t work = n_items * keys * hd * n_group * 2;  // multiply-adds
    pool.parallel_for(n_items, work, [&](int64_t item, int) {
      const int h = (int)(item / n_tokens), t = (int)(item % n_tokens);
      kv_dense_view kv;
      kv.type_k = ek_;
      kv.type_v = ev_;
      kv.row_stride = hd;
      kv.head_dim = hd;
      attn_query_view qv;
      qv.q = q + ((int64_t)t * n_head + (int64_t)h * n_group) * hd;
      qv.stride_t = (int64_t)n_head * hd;
      qv.n_tokens = 1;
      qv.n_group = n_group;
      qv.head_dim = hd;
      qv.pos0 = pos0 + t;
      qv.spec = spec;
      attn_state st[64];
      float* o = out + ((int64_t)t * n_head + (int64_t)h * n_group) * hd;
      for (int g0 = 0; g0 < n_group; g0 += 64) {
        const int ng = std::min(64, n_group - g0);
        for (int g = 0; g < ng; ++g) st[g] = attn_state::empty(o + (int64_t)(g0 + g) * hd, hd);
        attn_query_view qg = qv;
        qg.q += (int64_t)g0 * hd;
        qg.n_group = ng;
        // the keys of the query, in at most two contiguous pieces of the ring
        const key_span span = spec.key_range(pos0 + t);
        for (int a = span.lo; a < span.hi;) {
          const int slot = a % ring, b = std::min(span.hi, a + ring - slot);
          kv.k = k_.data() + row_index(il, seq_id, h, a) * hd * kv_elem_bytes(ek_);
          kv.v = v_.data() + row_index(il, seq_id, h, a) * hd * kv_elem_bytes(ev_);
          kv.pos_begin = a;
          kv.n_pos = b - a;
          attn_dense(kv, qg, st);
          a = b;
        }
        for (int g = 0; g < ng; ++g) st[g].finalize(st[g].o);
      }
    });
  }

  int n_pos(int seq_id) const override {
    if (seq_id < 0 || seq_id >= p_.n_seq) return 0;
    return pos_[(size_t)(p_.n_layer - 1) * p_.n_seq + seq_id];
  }
  void clear(int seq_id) override { truncate(seq_id, 0); }
  void truncate(int seq_id, int n) override {
    check_layer_seq("truncate", 0, seq_id);
    if (n < 0) fail_input("[kv_cache] truncate: n_pos must be >= 0, got " + std::to_string(n));
    for (int il = 0; il < p_.n_layer; ++il) {
      int& pos = pos_[(size_t)il * p_.n_seq + seq_id];
      pos = std::min(pos, n);
      int& first = first_[(size_t)il * p_.n_seq + seq_id];
      first = std::min(first, pos);  // (first > pos: nothing below pos is held any more)
    }
  }
  size_t bytes() const override { return k_.size() + v_.size(); }
  size_t bytes_used() const override {
    size_t rows = 0;
    for (int il = 0; il < p_.n_layer; ++il)
      for (int s = 0; s < p_.n_seq; ++s) rows += (size_t)std::min(pos_[(size_t)il * p_.n_seq + s], ring_[il]);
    return rows * p_.n_kv_head * p_.head_dim * (size_t)(kv_elem_bytes(ek_) + kv_elem_bytes(ev_));
  }
  std::string describe() const override {
    return std::string("K ") + elem_name(ek_) + " / V " + elem_name(ev_) + " (dense)";
  }

 private:
  void check_layer_seq(const char* op, int il, int seq_id) const {
    if (il < 0 || il >= p_.n_layer)
      fail_input(std::string("[kv_cache] ") + op + ": layer " + std::to_string(il) + " out of range [0, " +
                 std::to_string(p_.n_layer) + ")");
    if (seq_id < 0 || seq_id >= p_.n_seq)
      fail_input(std::string("[kv_cache] ") + op + ": seq_id " + std::to_string(seq_id) + " out of range [0, " +
                 std::to_string(p_.n_seq) + ")");
  }
  // Row of position pos: layer il's rows start at row0_[il], then [n_seq, n_kv_head, ring]
  int64_t row_index(int il, int seq, int h, int pos) const {
    return (int64_t)row0_[il] + ((int64_t)seq * p_.n_kv_head + h) * ring_[il] + pos % ring_[il];
  }

  kv_cache_params p_;
  kv_elem ek_, ev_;
  std::vector<int> ring_;       // [n_layer] positions held per (seq, kv head): n_ctx, or a window's ring
  std::vector<int> window_;     // [n_layer] attn_spec::window
  std::vector<size_t> row0_;    // [n_layer + 1] first row of each layer
  std::vector<uint8_t> k_;      // per layer [n_seq, n_kv_head, ring, head_dim] of ek_
  std::vector<uint8_t> v_;      // per layer [n_seq, n_kv_head, ring, head_dim] of ev_
  std::vector<int> pos_;        // [n_layer, n_seq] positions stored per layer
  std::vector<int> first_;      // [n_layer, n_seq] oldest position still held (ring layers)
};

}  // namespace

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
