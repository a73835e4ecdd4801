#include "core/gguf_prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace kvq {

size_t gguf_prefault(const gguf_file& f) {
  const uint8_t* lo = nullptr;
  const uint8_t* hi = nullptr;
  for (const gguf_tensor_info& t : f.tensors()) {
    if (t.n_bytes == 0) continue;
    lo = lo ? std::min(lo, t.data) : t.data;
    hi = hi ? std::max(hi, t.data + t.n_bytes) : t.data + t.n_bytes;
  }
  if (!lo) return 0;
  const uintptr_t page = (uintptr_t)::sysconf(_SC_PAGESIZE);
  const uintptr_t first = (uintptr_t)lo & ~(page - 1);
  // readahead of a cold file; a failure only leaves the faults below to read the pages one by one
  ::madvise((void*)first, (uintptr_t)hi - first, MADV_WILLNEED);
  uint8_t sink = 0;
  for (uintptr_t p = first; p < (uintptr_t)hi; p += page)
    sink ^= *reinterpret_cast<const volatile uint8_t*>(p);  // faults its page in
  (void)sink;
  return (size_t)(hi - lo);
}

}  // namespace kvq
