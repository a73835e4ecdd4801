// Weight types as data (STYLE.md habit 2, after ggml's type_traits and CPU type traits): one row
// per GGUF weight type kvq computes with. A new type is a block struct (blocks_*.h), a reference
// dequantizer (dequant_ref.cpp), a reference dot (dot_ref.cpp) and one row in traits.cpp; SIMD
// tiers fill in their entries of the row when they land (tested against the reference).
#pragma once
#include <cstdint>
#include <string>

#include "core/weight_types/act_blocks.h"
#include "kvq/cpu.h"
#include "kvq/gguf.h"

namespace kvq {

namespace detail {
struct matmul_task;
}

// y[n] = the n values (a whole number of blocks) stored at v.
using to_float_fn = void (*)(const void* v, float* y, int64_t n);
// Dot of one weight row (n elements) with one activation row in the type's vec_dot_type.
using vec_dot_fn = float (*)(int64_t n, const void* w, const void* x);
// Matrix-matrix kernel: rows [r0, r1) of y for every token of the task (prefill and decode).
using rows_fn = void (*)(const detail::matmul_task& task, int64_t r0, int64_t r1);

struct weight_type_traits {
  ggml_type type;
  int64_t blk;               // elements per block
  int64_t bytes;             // bytes per block
  act_type vec_dot_type;     // activation format the dot and the rows kernels take
  to_float_fn to_float;      // reference dequantizer (bit-exact with gguf-py)
  vec_dot_fn vec_dot[(int)isa::count];  // per tier; [scalar] is the reference (null for f32 types)
  rows_fn rows[(int)isa::count];        // per tier matrix-matrix kernel
};

// The row of `t`, or nullptr when kvq does not compute with that type.
const weight_type_traits* find_weight_traits(ggml_type t);
// "f32, f16, bf16, q4_0, ..." for error messages.
const std::string& supported_weight_type_names();

}  // namespace kvq
