// Private: how certified caches reach the live certified_collector objects (include/kvq/certified.h).
#pragma once
#include "kvq/certified.h"

namespace kvq::cert_collect {

// Registers c with every collector alive now (make_kv_cache_certified calls it once per cache).
void attach(const kv_cache_certified* c);
// Stores c->report() as c's final report in every collector that holds c (the cache's destructor
// calls it while its members are still alive). A no-op for a cache no collector holds.
void detach(const kv_cache_certified* c);

}  // namespace kvq::cert_collect
