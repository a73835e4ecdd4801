// Private: the KV cache implementations behind make_kv_cache().
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"

namespace kvq {

// The formats of the "certified" type name.
constexpr kv_format kCertifiedDefaultK = kv_format::q8;
constexpr kv_format kCertifiedDefaultV = kv_format::q4;
// The storage format of one side: the type's format, or the certified default for "certified".
kv_format side_format(const kv_cache_params& p, bool is_v);
// The rotation of a side in format f: none for dense sides, p.rotation, else (auto) the format's
// default (the certified cache rotates every compressed side).
rotation_kind side_rotation(const kv_cache_params& p, kv_format f, bool certified);
// Throws invalid_input unless layer il of seq_id, holding `held` positions, may append n_tokens:
// n_tokens >= 0; every layer but the last holds the sequence's n_pos before appending; a layer il > 0
// never holds more than layer il - 1 (held_prev) afterwards (so the last layer cannot run ahead of
// layer 0); at most n_ctx positions.
void check_append_order(int il, int seq_id, int n_tokens, int n_layer, int n_ctx, int held, int held_prev, int n_pos);
// Validates the sequence list of kv_cache::attend_batch: seq_id in [0, n_seq), each at most once.
// op ("attend" or "attend_batch") starts the error message.
void check_attend_batch(const char* op, const attend_seq* seqs, int n_seqs, int n_seq);
// The attention variant of layer il: scale, its sliding window (kv_layer_window) and p's soft-cap.
inline attn_spec kv_layer_spec(const kv_cache_params& p, int il, float scale) {
  attn_spec a;
  a.scale = scale;
  a.window = kv_layer_window(p, il);
  a.softcap = p.attn_softcap;
  return a;
}
// invalid_input unless il is in [0, p.n_layer) and seq_id in [0, p.n_seq); op starts the message.
void check_layer_seq(const kv_cache_params& p, const char* op, int il, int seq_id);
// The errors of check_attend_seqs (out of line: the messages).
[[noreturn]] void fail_attend_positions(const char* op, int il, const attend_seq& a, int held);
[[noreturn]] void fail_attend_heads(const char* op, int n_head, int n_kv_head);
// Validates an attend / attend_batch call of layer il before any work: the sequence list
// (check_attend_batch), each sequence's layer and seq_id, its queries [pos0, pos0 + n_tokens)
// within the held(seq_id) positions layer il holds, and n_head a multiple of p.n_kv_head.
template <class Held>
void check_attend_seqs(const kv_cache_params& p, const char* op, int il, const attend_seq* seqs, int n_seqs,
                       int n_head, Held&& held) {
  check_attend_batch(op, seqs, n_seqs, p.n_seq);
  for (int b = 0; b < n_seqs; ++b) {
    const attend_seq& a = seqs[b];
    check_layer_seq(p, op, il, a.seq_id);
    const int have = held(a.seq_id);
    if (a.n_tokens < 1 || a.pos0 < 0 || (int64_t)a.pos0 + a.n_tokens > have)
      fail_attend_positions(op, il, a, have);
  }
  if (n_head < p.n_kv_head || n_head % p.n_kv_head != 0) fail_attend_heads(op, n_head, p.n_kv_head);
}

// Dense element type of a baseline cache type, or kv_elem::count when not dense.
kv_elem dense_elem_of(kv_cache_type t);

// Positions layer il holds per (sequence, kv head): n_ctx, or for a sliding-window layer a ring
// of min(n_ctx, window - 1 + n_ubatch) (the rows its queries see plus one batch).
int kv_ring_positions(const kv_cache_params& p, int il);
// invalid_input when n_tokens appended at once to layer il would overrun its ring (> n_ubatch).
void check_ring_append(const kv_cache_params& p, int il, int n_tokens);
// invalid_input when a query of layer il needs position lo but the ring holds positions from `first` only.
void check_ring_holds(const kv_cache_params& p, const char* op, int il, int seq_id, int lo, int first);

std::unique_ptr<kv_cache> make_kv_cache_dense(const kv_cache_params& p);
size_t kv_page_bytes_dense(const kv_cache_params& p);
size_t kv_page_bytes_quant(const kv_cache_params& p);
size_t kv_layer_bytes_dense(const kv_cache_params& p, int il);
double kv_bytes_per_token_dense(const kv_cache_params& p);
size_t kv_bytes_at_ctx_dense(const kv_cache_params& p);
// Compressed formats (either side not f32/f16/bf16).
std::unique_ptr<kv_cache> make_kv_cache_quant(const kv_cache_params& p);
double kv_bytes_per_token_quant(const kv_cache_params& p);
size_t kv_bytes_at_ctx_quant(const kv_cache_params& p);
size_t kv_layer_bytes_quant(const kv_cache_params& p, int il);
// Every stored byte of layer il, seq seq_id of a compressed cache (codes, scales and exact rows
// of the positions held, plus n_pos and n_comp), for tests of arrival-order invariance.
// Throws internal for other caches.
std::vector<uint8_t> kv_cache_stored_bytes(const kv_cache& c, int il, int seq_id);

}  // namespace kvq
