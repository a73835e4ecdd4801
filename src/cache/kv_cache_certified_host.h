// Private: the host tier of the certified cache, a flat byte region that is either anonymous
// memory (pages appear on first write) or an unlinked file in a directory, mmap'd shared so that
// the kernel can write it back and evict it: the host tier need not fit in RAM.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvq {

class host_region {
 public:
  // bytes > 0. dir empty: anonymous memory; else a file created (and unlinked at once) in dir.
  // Errors: io "[kv_cache] host tier: cannot create a file in '<dir>': <reason>" (and for
  // ftruncate / mmap failures).
  host_region(size_t bytes, const std::string& dir);
  ~host_region();
  host_region(const host_region&) = delete;
  host_region& operator=(const host_region&) = delete;

  uint8_t* data() const { return base_; }
  size_t size() const { return bytes_; }
  bool file_backed() const { return fd_ >= 0; }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

}  // namespace kvq
