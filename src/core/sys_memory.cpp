#include "kvq/sys_memory.h"

#include <fstream>
#include <string>

namespace kvq {

size_t mem_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  size_t kib = 0;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

}  // namespace kvq
