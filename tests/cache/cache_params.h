// Test helper: the parameters of a one-layer cache.
#pragma once
#include <string>

#include "kvq/kv_cache.h"

namespace kvq::test {

// One layer, n_kv_head kv heads of head_dim hd, n_ctx positions, K and V types by name.
inline kv_cache_params one_layer_params(const std::string& tk, const std::string& tv, int hd, int n_kv_head,
                                        int n_ctx) {
  kv_cache_params p;
  p.n_layer = 1;
  p.n_kv_head = n_kv_head;
  p.head_dim = hd;
  p.n_ctx = n_ctx;
  p.type_k = parse_kv_cache_type(tk);
  p.type_v = parse_kv_cache_type(tv, "V");
  return p;
}

}  // namespace kvq::test
