#include "kvq/cpu.h"

#include <cpuid.h>

#include <cstdint>

#include <cstdlib>
#include <cstring>

namespace kvq {

static cpu_features detect() {
  cpu_features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = ((uint64_t)hi << 32) | lo;
  }
  const bool ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = ymm && (b & (1u << 5));
  f.avx512f = zmm && (b & (1u << 16));
  f.avx512bw = zmm && (b & (1u << 30));
  f.avx512vl = zmm && (b & (1u << 31));
  f.avx512vnni = zmm && (c & (1u << 11));
  return f;
}

const cpu_features& cpu() {
  static const cpu_features f = detect();
  return f;
}

isa best_isa() {
  static const isa chosen = [] {
    const cpu_features& f = cpu();
    isa best = isa::scalar;
    if (f.avx2 && f.fma && f.f16c) best = isa::avx2;
    if (best == isa::avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni) best = isa::avx512;
    if (const char* env = std::getenv("KVQ_ISA")) {
      isa want = best;
      if (!std::strcmp(env, "scalar")) want = isa::scalar;
      else if (!std::strcmp(env, "avx2")) want = isa::avx2;
      else if (!std::strcmp(env, "avx512")) want = isa::avx512;
      if ((int)want < (int)best) best = want;  // can only lower the tier
    }
    return best;
  }();
  return chosen;
}

const char* isa_name(isa i) {
  switch (i) {
    case isa::scalar: return "scalar";
    case isa::avx2: return "avx2";
    case isa::avx512: return "avx512";
    default: return "?";
  }
}

}  // namespace kvq
