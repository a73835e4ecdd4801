// Shared pieces of the kvq Python bindings (nanobind): the cache options as Python keyword
// arguments, text conversion, and the definitions of each bound class.
#pragma once
#include <nanobind/nanobind.h>

#include <string>

#include "kvq/kv_cache.h"

namespace kvq::py {

namespace nb = nanobind;

// The cache options a Python call takes as keyword arguments, spelled as the CLI's KV flags:
//   type_k (-ctk), type_v (-ctv): "f16", "q8", "q4", "kivi4", ... (kv_type_names())
//   rotation (--kv-rot): "none" | "hadamard" | "srht" | "srft" | "auto"
//   group_size (--kv-group), sink (--kv-sink), recent (--kv-exact-recent),
//   kivi_group (--kv-kivi-group), kivi_residual (--kv-residual): int
//   channel_scale (--kv-channel-scale): bool
//   k_channel_scale (--kv-k-channel-scale): "on" | "off" | "auto", True, False or None (auto)
//   kv_seed (--kv-seed): int
//   certify (--kv-certify), certify_measure (--kv-certify-measure), certify_adapt (not
//   --kv-certify-no-adapt): bool; certify_tol (--kv-tol): float; host_dir (--kv-host-dir): str
// Options left out keep kv_cache_params' defaults (the CLI's; sink / recent: see auto_windows below). Errors: TypeError for an unknown
// option name ("<op>() got an unexpected keyword argument 'x' (cache options: ...)") or a value of
// the wrong Python type; ValueError (kvq's message) for an unknown type or rotation name.
// auto_windows (Model.generate / stream / perplexity, as the CLI): sink / recent not given (or None)
// take kv_auto_windows (4 / 32 for per-token types unless a side is KIVI); false (KVCache, the
// low-level cache, as kv_cache_params): 0 unless given.
kv_cache_params cache_options(const nb::kwargs& kw, const char* op, bool auto_windows = false);

// A Python str from UTF-8 bytes that may be cut inside a character (a token's piece): invalid
// bytes become U+FFFD, as the CLI's --json output does.
nb::str utf8_str(const std::string& s);

void bind_model(nb::module_& m);
void bind_kv_cache(nb::module_& m);

}  // namespace kvq::py
