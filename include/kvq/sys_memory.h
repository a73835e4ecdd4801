// The machine's memory, as the library sizes its allocations against it.
#pragma once
#include <cstddef>

namespace kvq {

// Bytes of memory available to new allocations without swapping (Linux /proc/meminfo
// MemAvailable, in bytes), 0 when unknown. make_kv_cache refuses a cache larger than this up front.
size_t mem_available_bytes();

}  // namespace kvq
