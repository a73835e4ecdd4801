// Private: the KV cache implementations behind make_kv_cache().
#pragma once
#include <memory>
#include <string>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"

namespace kvq {

// Validates the shape fields shared by every cache ("[kv_cache] n_layer must be >= 1, got 0").
void validate_cache_shape(const kv_cache_params& p);
// Dense element type of a baseline cache type name, or kv_elem::count when not dense.
kv_elem dense_elem_of(const std::string& type);

std::unique_ptr<kv_cache> make_kv_cache_dense(const kv_cache_params& p);
double kv_bytes_per_token_dense(const kv_cache_params& p);

}  // namespace kvq
