// CUDA backend: a paged, compressed KV cache on the GPU with
//   - a fused append kernel (f16/bf16 K,V -> block-diagonal Hadamard rotation -> per-token scales ->
//     q8/q4 codes -> pages, one launch; codes bit-identical to kvq::quantize_row_ref), and
//   - flash-decoding attention computed on the packed codes (split-KV over thread blocks, int8 Q x
//     int4/int8 K on the tensor cores, online softmax in f32, P·V from packed V, attn_state merge
//     with an exact f16 sink/recent window), plus the f16 paged kernel of the same design and a
//     dequantize-then-attend path as baselines.
// Sources: PagedAttention (Kwon et al. 2023, vLLM, §4.1: block tables); FlashInfer (Ye et al. 2025,
// §3: page table as CSR indptr/indices/last_page_len, plan/run); Flash-Decoding (Dao et al. 2023:
// split-KV + log-sum-exp merge); QuaRot (arXiv:2404.00456, §3: Hadamard before quantizing K/V);
// KIVI/QServe-style fused int4 attention. Docs: docs/cuda.md (layout diagrams, design, numbers).
//
// Without KVQ_BUILD_CUDA every function exists: available() is false and the rest throw
// kvq::error(unsupported) "[cuda] not supported: kvq was built without KVQ_BUILD_CUDA" (MLX's
// no_gpu pattern). With CUDA but no visible GPU, require() throws unsupported "[cuda] no GPU ...".
// All pointers named "device" are device memory; all sizes are bytes unless named otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvq/attention.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq::cuda {

bool available();           // built with CUDA and a GPU is visible
std::string device_name();  // e.g. "NVIDIA H200 (sm_90, 132 SMs, driver 13.0)"
void require();             // throws kvq::error(unsupported) unless available()

// ---- device memory (thin wrappers; throw kvq::error(internal) "[cuda] ..." on failure) --------
void* device_alloc(size_t bytes);
void device_free(void* p);  // nullptr is a no-op
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void device_fill(void* dst, uint8_t byte, size_t bytes);
void synchronize();
// Free and total bytes of the current device (cudaMemGetInfo).
void memory_info(size_t* free_bytes, size_t* total_bytes);
// Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (2 x bytes per
// copy): the median of `repeats` cudaMemcpy of `bytes` between two fresh buffers, timed with events
// after one untimed copy. The ceiling of memory-bound kernels measured on this device (METHOD:
// "measure the two ceilings once"). invalid_input for bytes < 1 MiB or repeats < 1.
double copy_bandwidth(size_t bytes, int repeats = 10);

// ---- paged KV layout ---------------------------------------------------------------------------
// A pool of fixed-size pages. A page holds page_size consecutive tokens of one sequence for every
// kv head: [n_kv_head] blocks of head_bytes, each
//     K codes  [page_size][code_bytes]      (the CPU row format of docs/formats.md, unchanged)
//     V codes  [page_size][code_bytes]
//     K scales [page_size][n_scales] f16    (per-token formats only)
//     V scales [page_size][n_scales] f16
// every section 16-byte aligned. Token j of sequence b lives in page indices[indptr[b] + j /
// page_size], row j % page_size; the sequence holds (indptr[b+1] - indptr[b] - 1) * page_size +
// last_page_len[b] tokens (0 when it has no page). All offsets are 64-bit (a pool may exceed 2^31
// bytes); page ids are int32.
//
// kivi4 pages (the CPU's -ctk kivi4 -ctv q4a / kivi4; KIVI, Liu et al. 2024, arXiv:2402.02750, §3.2):
// K per-channel asymmetric 4-bit over groups of kivi_group = 32 consecutive page rows, never rotated;
// V per-token asymmetric q4a (group 32), rotated by `rotation`. A (page, kv head) block holds
//     K codes  [page_size][head_dim / 2]                 (q4a code rows, docs/formats.md)
//     V codes  [page_size][head_dim / 2]
//     K scales [page_size / 32][2][head_dim] f16         (per group: the channel scales, then zeros)
//     V scales [page_size][2][head_dim / 32] f16         (per row: scales, then zeros)
// page_size 32 or 64 (whole groups), head_dim % 32 == 0. The pages hold the compressed body only;
// the exact sink and residual rows live in exact_window_view rows (docs/cuda.md "KIVI").
struct paged_kv_format {
  kv_format format = kv_format::q4;  // q8, q4 (rotated, per-token symmetric), f16 or kivi4
  int head_dim = 128;                // 64, 80, 96, 128 or 256 (kivi4: 64, 96, 128, 256)
  int n_kv_head = 1;
  int page_size = 16;                                // 16 or 64 tokens (kivi4: 32 or 64)
  rotation_kind rotation = rotation_kind::hadamard;  // none or hadamard (block = largest 2^k | head_dim);
                                                     // kivi4: V's rotation (K is never rotated)
};

struct paged_kv_geometry {
  int group = 0;            // elements per scale: 32 when head_dim % 32 == 0, else head_dim (CPU default)
  int n_scales = 0;         // f16 scales per row (0 for f16)
  int64_t code_bytes = 0;   // bytes of one row of codes (f16: 2 * head_dim)
  int64_t k_codes = 0, v_codes = 0, k_scales = 0, v_scales = 0;  // section offsets in a block
  int64_t head_bytes = 0;   // one (page, kv head) block
  int64_t page_bytes = 0;   // one page = n_kv_head * head_bytes
  int kivi_group = 0;       // kivi4: rows per K scale group (32); 0 otherwise
  int rot_block = 0;        // Hadamard block (0: no rotation)
  float rot_scale = 1.0f;   // 1 / sqrt(rot_block), as kvq::fwht_radix2 rounds it

  int64_t block_offset(int64_t page, int kv_head) const { return page * page_bytes + (int64_t)kv_head * head_bytes; }
  int64_t k_code_offset(int64_t page, int kv_head, int row) const { return block_offset(page, kv_head) + k_codes + row * code_bytes; }
  int64_t v_code_offset(int64_t page, int kv_head, int row) const { return block_offset(page, kv_head) + v_codes + row * code_bytes; }
  int64_t k_scale_offset(int64_t page, int kv_head, int row) const { return block_offset(page, kv_head) + k_scales + (int64_t)row * n_scales * 2; }
  int64_t v_scale_offset(int64_t page, int kv_head, int row) const { return block_offset(page, kv_head) + v_scales + (int64_t)row * n_scales * 2; }
  // kivi4: the K scales (then zeros) of group grp (rows [32 grp, 32 grp + 32)) of a page
  int64_t k_group_offset(int64_t page, int kv_head, int grp) const {
    return block_offset(page, kv_head) + k_scales + (int64_t)grp * code_bytes * 8;
  }
};
// Validates the format (host only, works without a GPU); throws unsupported
// "[cuda paged_kv] unsupported head_dim 72 (supported: 64, 80, 96, 128, 256)" and the like.
paged_kv_geometry paged_kv_geometry_of(const paged_kv_format& f);

// A paged cache on the device (views, passed by value; STYLE.md habit 3).
struct paged_kv_view {
  paged_kv_format format;
  uint8_t* pool = nullptr;                 // device [n_pages][page_bytes]
  int64_t n_pages = 0;
  const int32_t* indptr = nullptr;         // device [batch + 1]
  const int32_t* indices = nullptr;        // device [indptr[batch]] page ids < n_pages
  const int32_t* last_page_len = nullptr;  // device [batch], in [1, page_size]
  int batch = 0;
  // K channel scale (kv_cache_params::k_channel_scale; docs/formats.md "Rotation and channel scale"),
  // or all nullptr: K stored as R((k - mu) / lambda), queries rotated as R(q * lambda), per row r of
  // k_mu / k_lambda [n_rows][n_kv_head][head_dim] f32 (device; lambda powers of two, from
  // channel_stats). stat_row (device) gives the row: append_paged [n_tokens], one per input token;
  // decode_plan::run and prefill_plan::run [batch], one per sequence. V is unchanged.
  const float* k_mu = nullptr;
  const float* k_lambda = nullptr;
  const int32_t* stat_row = nullptr;
};

// Exact rows attended in f16 beside the paged body (the cache's exact sink, docs/formats.md "Exact
// windows"), stored as the pages store their rows before quantizing: the transformed (K channel
// scale), rotated row rounded to f16. Device k, v [n_slots][n_kv_head][cap][head_dim] f16 bits;
// entry b of the attention (a decode sequence, a prefill sequence) reads slot slot[b] (device
// [batch]; nullptr: slot b) and its rows [0, len[b]) (device [batch]). decode_plan::run shows a
// query every one of them; prefill_plan::run treats row j as position j (the sink: positions [0,
// len)) and shows a query at position p the rows j <= p.
//
// gap_lo / gap_hi (decode_plan only; device [batch], or nullptr): entry b skips rows [gap_lo[b],
// gap_hi[b]) of [0, len[b]) (gap_lo <= gap_hi <= len). A KIVI cache's slot holds the sink, then the
// residual rows from a group boundary on; a query skips those its pages already hold compressed.
struct exact_window_view {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const int32_t* len = nullptr;
  int cap = 0;                    // rows per slot, <= 1024
  const int32_t* slot = nullptr;  // device [batch], or nullptr (entry b reads slot b)
  const int32_t* gap_lo = nullptr;
  const int32_t* gap_hi = nullptr;
};

// Where append_paged also writes a token's exact row (exact_window_view's layout): token i, kv head
// h goes to row slots[i] % cap of slot slots[i] / cap of k / v (device int64 [n_tokens]; negative:
// none). The row is the f16-rounded transformed, rotated row the codes are quantized from.
struct exact_rows_out {
  uint16_t* k = nullptr;  // device [n_slots][n_kv_head][cap][head_dim] f16 bits
  uint16_t* v = nullptr;
  const int64_t* slots = nullptr;
  int cap = 0;
};

// Fused append: k, v device [n_tokens][n_kv_head][head_dim] f16, bf16 or f32; token i goes to slot
// slots[i] = page * page_size + row (device int64; a negative slot skips the token). Per (token, kv
// head, side) one warp: with the view's K channel scale (k_mu, k_lambda, stat_row[i]) K becomes
// (k - mu) / lambda (f32, as kv_cache_quant::transform_side), then rotate (FWHT), round to f16,
// per-group min/max -> signed f16 scale rounded up (quant.h) -> codes -> pack; f16 format stores
// the rotated, f16-rounded row. Codes and scales equal quantize_row_ref on the same input, and a
// kv_cache_quant's stored codes for the same f32 rows, mu and lambda (|transformed x| <= 65504
// assumed; the CPU cache checks this, the kernel does not). With `exact` (q8 / q4 only), the tokens
// with a page slot and a non-negative exact slot also write their exact rows there. One launch.
void append_paged(const paged_kv_view& kv, const void* k, const void* v, kv_elem elem, const int64_t* slots,
                  int n_tokens, void* stream = nullptr, const exact_rows_out* exact = nullptr);

// ---- KIVI (kivi4 pages; kv_cache_quant's -ctk kivi4 -ctv q4a / kivi4, docs/cuda.md "KIVI") ------
// Append of a KIVI cache: k, v device [n_tokens][n_kv_head][head_dim] f16, bf16 or f32. Per (token,
// kv head) one warp: K rounded to f16 (unrotated) -> exact.k row exact.slots[i]; V -> FWHT (the
// view's rotation) -> rounded to f16 -> exact.v row exact.slots[i] and, when slots[i] >= 0, q4a codes
// + scale + zero (quantize_row_ref's, bit for bit) into V row slots[i] % page_size of page slots[i] /
// page_size. K codes wait for their group (quantize_kivi_groups). exact.slots[i] < 0 writes no exact
// row. The same values as kv_cache_quant::transform_side (|x| <= 65504 assumed, the CPU checks).
// Errors: unsupported for a format other than kivi4; invalid_input for missing pointers. One launch.
void append_kivi(const paged_kv_view& kv, const void* k, const void* v, kv_elem elem, const int64_t* slots,
                 int n_tokens, const exact_rows_out& exact, void* stream = nullptr);

// K per-channel quantization of n_groups whole KIVI groups from exact rows: group j's kivi_group
// (32) consecutive f16 K rows start at row src_rows[j] % cap of slot src_rows[j] / cap of exact_k
// ([n_slots][n_kv_head][cap][head_dim] f16 bits, device), and go to page slot dst_slots[j] (page *
// page_size + row0, row0 a multiple of 32; device int64 [n_groups]): codes, channel scales and zeros
// of quantize_channel_group_ref (least squared error clipping and refits, kv_quantize_ref.cpp),
// bit for bit (compiled without FMA contraction, one thread per channel). An entry with
// dst_slots[j] < 0 is padding and writes nothing (a step's launches then do not depend on how many
// groups it completes: CUDA graphs). One launch.
void quantize_kivi_groups(const paged_kv_view& kv, const uint16_t* exact_k, int cap, const int64_t* src_rows,
                          const int64_t* dst_slots, int n_groups, void* stream = nullptr);

// Moves exact rows down within their slots (the KIVI residual after its groups were quantized): for
// each of n moves (device int32 [n][4] {slot, dst_row, src_row, n_rows}, dst_row <= src_row) the
// rows [src_row, src_row + n_rows) of k and v ([n_slots][n_kv_head][cap][head_dim] f16, device) of
// every kv head go to [dst_row, ..), in row order (overlap allowed); a move of 0 rows is padding.
// One launch.
void move_exact_rows(uint16_t* k, uint16_t* v, int n_kv_head, int head_dim, int cap, const int32_t* moves, int n,
                     void* stream = nullptr);

// The channel statistics of kv_channel_stats_ref (include/kvq/kv_cache.h) on the device, equal to
// it bit for bit: x device [n_tokens][n_kv_head][head_dim] f32, mu and lambda device
// [n_kv_head][head_dim] f32. One block per kv head, one thread per channel (sums in double in token
// order). invalid_input for n_tokens < 1; head_dim as paged_kv_format. One launch.
void channel_stats(const float* x, int n_tokens, int n_kv_head, int head_dim, float* mu, float* lambda,
                   void* stream = nullptr);

// Baseline only: dequantizes the pages src.indices[0, n_entries) (n_entries = indptr[batch], from the
// host copy) into the f16 pool of dst: same page ids, head_dim, n_kv_head and page_size; values
// scale * (code - offset) rounded to f16, in the rotated basis as stored. One launch.
void dequantize_paged(const paged_kv_view& src, const paged_kv_view& dst, int n_entries, void* stream = nullptr);

struct decode_params {
  int n_head = 0;                     // query heads; n_head / n_kv_head in [1, 8]
  // Logits = spec.logit(spec.scale * q·k) (attention.h; scale usually 1/sqrt(head_dim)). A sliding
  // window (spec.window > 0) applies to the paged body with the decode query at its last token
  // (len - 1: it sees tokens [len - window, len)); refused together with an exact window, whose rows
  // carry no positions.
  attn_spec spec{0.0f};
  // First position of the paged body of every sequence (>= 0): tokens below it are not read from
  // the pages (the exact sink of exact_window_view holds them). The body's end is the page table's
  // length. A sequence whose body is empty attends its exact rows only.
  int body_lo = 0;
  kv_elem q_elem = kv_elem::f16;      // f16 or bf16 queries [batch][n_head][head_dim]
  kv_elem out_elem = kv_elem::f32;    // f32 or f16 output  [batch][n_head][head_dim]
  int split_tokens = 0;               // tokens per split-KV work item (multiple of 16); 0 = auto
  // kivi4 pages, head_dim <= 128: the entries are the queries of one sequence's prompt chunk (entry
  // b reads the first rows of the last entry's pages; body lengths non-decreasing, checked on the
  // host copy): attend them in tiles of 64 / GQA-group entries that read each 32-row key tile once
  // (K and V dequantized in shared memory), one work item per entry (split_tokens ignored). Same
  // values as the per-entry kernel up to float summation order. Ignored for other formats.
  bool kivi_tiles = false;
};

// Decode attention (one query token per sequence, attending to its tokens as params.spec says), FlashInfer-style
// plan/run: the plan validates, reads the host copy of the page table's lengths, splits every
// sequence into work items (split-KV) and owns the device workspace; run() launches two kernels
// (fused attention per (item, kv head); merge of the items' attn_states with the exact window,
// normalisation and the inverse rotation of the output) and never allocates.
class decode_plan {
 public:
  // indptr_host [batch + 1], last_page_len_host [batch]: host copies of the view's page table.
  decode_plan(const paged_kv_format& f, const decode_params& p, const int32_t* indptr_host,
              const int32_t* last_page_len_host, int batch, int exact_cap = 0);
  ~decode_plan();
  decode_plan(const decode_plan&) = delete;
  decode_plan& operator=(const decode_plan&) = delete;

  // q device [batch][n_head][head_dim] (q_elem); out device [batch][n_head][head_dim] (out_elem).
  // kv must have the plan's format and batch; exact may be nullptr. With kv's K channel scale
  // (k_lambda, stat_row[b]; q8 / q4 only) query b is multiplied by lambda in f32 before its rotation,
  // as kv_cache_quant's attend (K's mu shifts every score of a query alike, which softmax ignores);
  // exact-window rows must then be stored as the pages are.
  void run(const paged_kv_view& kv, const void* q, void* out, const exact_window_view* exact = nullptr,
           void* stream = nullptr) const;

  // Keeps the plan's launch for new lengths of the same batch (the next decode step): recomputes the
  // work items with the plan's split and copies them into its own buffers on `stream` (synchronised
  // before returning) when their number is unchanged, so that run() launches with the same
  // arguments (a captured CUDA graph of run() stays valid). Returns false, changing nothing, when the
  // number of items would change, for a sliding window, or for a malformed table: make a new plan.
  bool update(const int32_t* indptr_host, const int32_t* last_page_len_host, void* stream = nullptr);

  int n_items() const;       // split-KV work items (thread blocks per kv head)
  int split_tokens() const;  // tokens per item
  size_t workspace_bytes() const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

struct prefill_params {
  int n_head = 0;                   // query heads, a multiple of n_kv_head (any GQA ratio)
  // Logits = spec.logit(spec.scale * q·k) with full causal attention: spec.window must be 0
  // (sliding windows are refused), spec.softcap is applied.
  attn_spec spec{0.0f};
  // Positions below body_lo (>= 0) are not read from the pages (the exact sink of the run's
  // exact_window_view holds them); a query at p sees the pages' positions [body_lo, p].
  int body_lo = 0;
  kv_elem q_elem = kv_elem::f16;    // f16 or bf16 queries [n_q][n_head][head_dim]
  kv_elem out_elem = kv_elem::f32;  // f32 or f16 output  [n_q][n_head][head_dim]
};

// Causal prefill attention over the paged cache (FlashAttention-2, Dao 2023, Sec. 3.1-3.2, on the
// decode kernel's integer-domain arithmetic; docs/cuda.md "Prefill kernel"), FlashInfer-style
// plan/run. Sequence b has q_len[b] = qo_indptr[b+1] - qo_indptr[b] queries, rows qo_indptr[b] ..
// of q and out; they are the last q_len[b] positions of its pages (appended before run(), as
// FlashInfer's append prefill): query i sits at position kv_len[b] - q_len[b] + i and sees the
// positions up to its own, the history and the chunk's earlier tokens alike, read from the codes
// (never a dequantized copy). The queries of a kv head's GQA group share a tile: one block per
// (64 query rows = tokens x group heads, kv head), key tiles past a block's last position never
// loaded; when the tiles alone would leave block slots idle (a short chunk after a long history),
// long tiles are split over the keys into parts whose states a second kernel merges (split-KV).
// q8 / q4 queries are rotated and quantized per K scale group exactly as decode_plan (and
// kv_cache_quant) does, so a query's output equals decode_plan's for the same query over the
// positions it sees, up to float summation order.
// Errors (constructor; run() only checks the view against the plan): unsupported for a format /
// head_dim / page size / rotation paged_kv_geometry_of refuses, n_head not a multiple of
// n_kv_head, a sliding window, f32 queries, bf16 output; invalid_input for a malformed table
// (indptr or qo_indptr decreasing, qo_indptr[0] != 0, last_page_len outside [1, page_size]) or a
// sequence with more queries than positions. All messages start with "[cuda attn_prefill]".
class prefill_plan {
 public:
  // qo_indptr_host [batch + 1], indptr_host [batch + 1], last_page_len_host [batch]: host copies.
  // exact_cap: the largest exact_window_view::cap run() takes (0: none; at most 1024).
  prefill_plan(const paged_kv_format& f, const prefill_params& p, const int32_t* qo_indptr_host,
               const int32_t* indptr_host, const int32_t* last_page_len_host, int batch, int exact_cap = 0);
  ~prefill_plan();
  prefill_plan(const prefill_plan&) = delete;
  prefill_plan& operator=(const prefill_plan&) = delete;

  // q device [qo_indptr[batch]][n_head][head_dim] (q_elem); out device, same shape (out_elem).
  // kv: the plan's format and batch, the page table the plan was made from. With kv's K channel
  // scale (k_lambda, stat_row[b]; q8 / q4 only) the queries of sequence b are multiplied by lambda
  // in f32 before their rotation, as decode_plan::run does (invalid_input for k_lambda without
  // stat_row or on an f16 cache). exact: the sink rows (exact_window_view; nullptr: none), merged
  // with the body's state per query row; a plan made with exact_cap > 0 merges in a second kernel.
  // No allocation (capturable in a CUDA graph): one launch, two with split tiles or exact rows.
  void run(const paged_kv_view& kv, const void* q, void* out, const exact_window_view* exact = nullptr,
           void* stream = nullptr) const;

  // Keeps the plan's launch for new tables of the same batch (the next prompt piece of the same
  // length and shape): recomputes the work items as the constructor would (same split rule, same
  // GPU) and copies them into the plan's own buffers on `stream` (synchronised before returning)
  // when the numbers of tiles, items, merges and workspace slots are unchanged, so that run()
  // launches with the same arguments and the result equals a new plan's. Returns false, changing
  // nothing, otherwise or for a malformed table (the constructor names the error): make a new plan.
  bool update(const int32_t* qo_indptr_host, const int32_t* indptr_host, const int32_t* last_page_len_host,
              void* stream = nullptr);

  int n_tiles() const;            // query tiles of 64 rows (per kv head)
  int n_items() const;            // work items (thread blocks per kv head): tiles, or parts of split tiles
  size_t workspace_bytes() const;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace kvq::cuda
