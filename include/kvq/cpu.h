// Runtime CPU feature detection for ISA dispatch (one decision per process, cached).
#pragma once
#include <string>

namespace kvq {

enum class isa { scalar, avx2, avx512, count };

struct cpu_features {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false;
};

const cpu_features& cpu();
// Best tier this CPU supports, lowered by the environment variable KVQ_ISA=scalar|avx2|avx512.
isa best_isa();
const char* isa_name(isa i);

}  // namespace kvq
