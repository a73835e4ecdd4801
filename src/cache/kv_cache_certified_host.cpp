// The host tier region of the certified cache (see kv_cache_certified_host.h).
#include "cache/kv_cache_certified_host.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "kvq/error.h"

namespace kvq {

host_region::host_region(size_t bytes, const std::string& dir) : bytes_(bytes) {
  KVQ_ASSERT(bytes > 0);
  if (dir.empty()) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      fail(errc::io, "[kv_cache] host tier: cannot map " + std::to_string(bytes) + " bytes of memory: " +
                         std::strerror(errno));
    base_ = static_cast<uint8_t*>(p);
    return;
  }
  std::string tmpl = dir + (dir.back() == '/' ? "" : "/") + "kvq-host-XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  fd_ = ::mkstemp(name.data());
  if (fd_ < 0)
    fail(errc::io, "[kv_cache] host tier: cannot create a file in '" + dir + "' (--kv-host-dir): " +
                       std::strerror(errno));
  ::unlink(name.data());  // nothing is left behind, whatever happens to the process
  if (::ftruncate(fd_, (off_t)bytes) != 0) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(errc::io, "[kv_cache] host tier: cannot size a " + std::to_string(bytes) + "-byte file in '" + dir +
                       "': " + std::strerror(e));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    fail(errc::io, "[kv_cache] host tier: cannot map a " + std::to_string(bytes) + "-byte file in '" + dir +
                       "': " + std::strerror(e));
  }
  base_ = static_cast<uint8_t*>(p);
}

host_region::~host_region() {
  if (base_) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace kvq
