// Private: the KIVI decode kernel (attn_decode_kivi.cu) as decode_plan (attn_decode.cu) launches it.
#pragma once
#include "cuda/common.cuh"

namespace kvq::cuda::detail {

// As attn_decode.cu's decode_args: work = item * n_kv_head + h over the plan's split-KV items; the
// states go to ws_o [n_items][n_kv_head][ng][HD] (unnormalised, V's rotated basis) and ws_md {m in
// log2 units, d}, which merge_kernel folds with the exact rows.
struct kivi_decode_args {
  const uint8_t* pool;
  dev_geom geo;
  const int32_t* indices;
  const int4* items;  // [n_items] {seq, tok_begin, tok_end, indptr[seq]}
  const void* q;      // [batch][n_head][HD] f16 / bf16
  float* ws_o;
  float2* ws_md;
  int n_work;
  int q_bf16;
  int n_head, n_kv_head, ng;
  float sm_scale_log2, softcap_log2;
  const int* seq_lo;  // [batch] first visible token, or nullptr
};

constexpr int kKiviDecodeThreads = 128;
// Blocks per SM of the kernel for head_dim hd (64, 96, 128, 256) with its shared memory.
int kivi_decode_blocks_per_sm(int hd);
void kivi_decode_launch(int hd, const kivi_decode_args& a, int grid, cudaStream_t st);

}  // namespace kvq::cuda::detail
