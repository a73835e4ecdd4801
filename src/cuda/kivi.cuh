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
// Blocks per SM of the kernel for head_dim hd (64, 96, 128, 256) and GQA group ng (<= 8) with its
// shared memory.
int kivi_decode_blocks_per_sm(int hd, int ng);
void kivi_decode_launch(int hd, const kivi_decode_args& a, int grid, cudaStream_t st);

}  // namespace kvq::cuda::detail

namespace kvq::cuda::detail {

// The tiled form for the queries of one sequence's prompt chunk (decode_params::kivi_tiles): entry
// b reads the first len[b] rows of the last entry's pages (lengths non-decreasing); a block takes
// QT = 64 / ng entries (rows = entries x GQA heads) and one kv head, reads each 32-row key tile once
// (K and V dequantized into shared memory, the codes' values exactly) and writes one attn_state per
// entry (its only work item, item_ptr[b]) for merge_kernel. head_dim 64, 96, 128.
struct kivi_tiles_args {
  const uint8_t* pool;
  dev_geom geo;
  const int32_t* pages;  // the last entry's pages (indices + indptr[batch - 1])
  const int32_t* len;    // [batch] body rows per entry
  const int* item_ptr;   // [batch + 1]
  const void* q;
  float* ws_o;
  float2* ws_md;
  int batch, q_bf16, n_head, n_kv_head, ng, qt;
  float sm_scale_log2, softcap_log2;
};
bool kivi_tiles_supported(int hd);
void kivi_tiles_launch(int hd, const kivi_tiles_args& a, cudaStream_t st);

}  // namespace kvq::cuda::detail
