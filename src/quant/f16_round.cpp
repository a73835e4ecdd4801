#include "quant/f16_round.h"

#include "kvq/cpu.h"
#include "kvq/f16.h"

namespace kvq {

void round_to_f16_n(float* x, size_t n) {
  if (best_isa() >= isa::avx2) return round_to_f16_n_avx2(x, n);
  for (size_t i = 0; i < n; ++i) x[i] = f16_to_f32(f32_to_f16(x[i]));
}

}  // namespace kvq
