// Private: the KV cache implementations behind make_kv_cache().
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"

namespace kvq {

// Validates the shape fields shared by every cache ("[kv_cache] n_layer must be >= 1, got 0").
void validate_cache_shape(const kv_cache_params& p);
// Validates the sequence list of kv_cache::attend_batch: seq_id in [0, n_seq), each at most once.
// op ("attend" or "attend_batch") starts the error message.
void check_attend_batch(const char* op, const attend_seq* seqs, int n_seqs, int n_seq);
// Dense element type of a baseline cache type name, or kv_elem::count when not dense.
kv_elem dense_elem_of(const std::string& type);

// Positions layer il holds per (sequence, kv head): n_ctx, or for a sliding-window layer a ring
// of min(n_ctx, window - 1 + n_ubatch) (the rows its queries see plus one batch).
int kv_ring_positions(const kv_cache_params& p, int il);
// invalid_input when n_tokens appended at once to layer il would overrun its ring (> n_ubatch).
void check_ring_append(const kv_cache_params& p, int il, int n_tokens);
// invalid_input when a query of layer il needs position lo but the ring holds positions from `first` only.
void check_ring_holds(const kv_cache_params& p, const char* op, int il, int seq_id, int lo, int first);

std::unique_ptr<kv_cache> make_kv_cache_dense(const kv_cache_params& p);
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
