// The KV cache interface. The model never touches cache storage: it appends each layer's new K/V
// and asks the cache to attend for that layer's queries. f32/f16/bf16 are dense baselines; the
// compressed formats (per-token int8/int4/int3/int2 in a rotated basis, KIVI, exact sink/recent
// windows) live behind the same interface and attend directly on the compressed form.
// (Interface shape after llama.cpp's llama_memory_i, STYLE.md habit 7.)
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvq/quant.h"
#include "kvq/rotation.h"
#include "kvq/thread_pool.h"

namespace kvq {

// The attention geometry of one layer (kv_cache_params::layers).
struct kv_layer_geometry {
  // Sliding-window attention: a query at position p of this layer sees keys [p - window + 1, p]
  // (attn_spec::window; Gemma 2/3, Mistral); 0 = global (causal only). The cache applies it in
  // attend, and a windowed layer keeps a ring of window - 1 + n_ubatch positions only (docs/formats.md,
  // "Sliding-window layers"), so its memory does not grow with n_ctx.
  int window = 0;
  int n_kv_head = 0;  // 0 = the cache-wide value (other values: unsupported for now)
  int head_dim = 0;   // 0 = the cache-wide value (other values: unsupported for now)
};

// The cache type of one side (-ctk / -ctv): a storage format of quant.h (same values, in the same
// order) or `certified` (the certified cache with its default format on that side, certified.h).
enum class kv_cache_type : uint8_t {
  f32, f16, bf16, q8, q4, q3, q2, q8a, q4a, q3a, q2a, kivi8, kivi4, kivi2, q4nl, q3nl, q2nl,
  certified,
  count
};
static_assert((int)kv_cache_type::certified == (int)kv_format::count);

// The attention path of the compressed formats: compressed-domain kernels, or dequantize-then-
// attend (a baseline for benchmarks and tests only).
enum class attn_path : uint8_t { fused, dequant, count };

// Parsing at the edge (CLI, tools): the names kv_type_names() lists, "fused" / "dequant", and
// none|hadamard|srht|srft|auto (auto: std::nullopt). Errors: invalid_input naming the field and
// value, e.g. "[kv_cache] unknown K cache type 'q5' (supported: f32, f16, ...)", with a hint for
// llama.cpp's names (q8_0, q4_0, ...). `side` is "K" or "V".
kv_cache_type parse_kv_cache_type(const std::string& name, const char* side = "K");
attn_path parse_attn_path(const std::string& name);
std::optional<rotation_kind> parse_kv_rotation(const std::string& name);
// An on / off / auto switch such as k_channel_scale: "on" -> true, "off" -> false, "auto" ->
// std::nullopt. Throws invalid_input naming `field` and the value otherwise.
std::optional<bool> parse_kv_switch(const std::string& name, const char* field);
const char* kv_cache_type_name(kv_cache_type t);
const char* attn_path_name(attn_path a);
std::string kv_rotation_name(const std::optional<rotation_kind>& r);  // "auto" for nullopt
// The storage format of t; false for certified (whose format depends on the side).
bool kv_cache_type_format(kv_cache_type t, kv_format* f);

struct kv_cache_params {
  using kv_layer_geometry = kvq::kv_layer_geometry;
  int n_layer = 0;
  int n_kv_head = 0;
  int head_dim = 0;
  int n_ctx = 0;  // positions per sequence (tokens); append past it is an error
  int n_seq = 1;  // independent sequences (seq_id in [0, n_seq))
  std::vector<kv_layer_geometry> layers;  // empty, or [n_layer]
  // Most tokens one append may bring to a sliding-window layer: its ring holds window - 1 + n_ubatch
  // positions (llama.cpp sizes its SWA cache the same way); a larger append to such a layer is
  // refused. Unused without windowed layers.
  int n_ubatch = 512;
  float attn_softcap = 0.0f;  // logit soft-cap of every layer (attn_spec::softcap; Gemma 2); 0 = none
  kv_cache_type type_k = kv_cache_type::f16;
  kv_cache_type type_v = kv_cache_type::f16;
  // Options of the compressed formats (ignored by f32/f16/bf16):
  int group_size = 0;               // elements per scale along head_dim; 0 = default (32 or head_dim)
  // rotation of the compressed sides; std::nullopt = auto (the format's rotate_by_default, quant.h)
  std::optional<rotation_kind> rotation;
  // Exact windows (kept in f16 beside the compressed body; storage only, unrelated to the
  // sliding-window attention of kv_layer_geometry::window):
  int sink = 0;                     // first `sink` tokens kept exact
  int exact_recent = 0;             // last `exact_recent` tokens kept exact (the CLI's --kv-exact-recent)
  int kivi_group = 32;              // KIVI: tokens per per-channel K group
  int kivi_residual = 32;           // KIVI: max exact recent tokens before a group is quantized
  // per-channel scale λ (and mean μ) calibrated per layer, sequence and kv head on the sequence's
  // first channel_calib positions (channel_calib below); clear / truncate below them reset them (no
  // sequence depends on another's)
  bool channel_scale = false;
  // K channel scale: channel_scale for K only (per layer, sequence, kv head and channel, the mean
  // μ_K and the power-of-two scale λ_K of the sequence's first channel_calib positions; K stored as
  // R((K - μ_K) / λ_K), queries scaled by λ_K). Exact for attention up to rounding: softmax ignores
  // the constant q·μ_K added to all of a query's scores, and the exact windows store the same
  // transformed rows. It keeps per-token K usable where a K bias puts a large constant on a few
  // channels (Qwen2.5: |μ| up to 210 against a spread of ~1; docs/quality.md). std::nullopt = auto:
  // on for the per-token compressed K formats (q8 .. q2a), off for KIVI (its per-channel scale and
  // zero already do it) and the dense types. channel_scale = true turns it on for K and V regardless.
  std::optional<bool> k_channel_scale;
  // Positions the channel statistics (channel_scale, k_channel_scale) are calibrated on: the first
  // channel_calib of each (layer, sequence), a fixed count, so that μ / λ are a function of those
  // positions only, not of how they were split into appends (-b, chunked prefill, one token at a
  // time, a loaded prefix; issue 15 item 5). Until all of them have arrived the cache keeps them as
  // given ("staging" rows, the sides' exact element type, counted in bytes(); a paged cache keeps
  // them in pages of its pool and returns those once calibrated, see stage_pages_for) and compresses
  // nothing: queries at positions below channel_calib attend them exactly. The append that brings
  // position channel_calib - 1 calibrates on positions [max(1, sink), channel_calib) (position 0
  // and the exact sink left out: on real models the attention sink's K is far from the rest) and
  // stores them like one append. Min(channel_calib, n_ctx) is used; >= 1. 256 keeps Qwen2.5 q4
  // within issue 14's target (docs/formats.md, "Channel scale"; docs/quality.md).
  int channel_calib = 256;
  uint64_t seed = 0x6b7671;         // seed of random signs (srht/srft)
  attn_path attn = attn_path::fused;  // of the compressed formats
  // Certified attention (include/kvq/certified.h, docs/certified.md): type "certified" on K/V, or
  // certify = true on a per-token compressed format.
  bool certify = false;
  double certify_tol = 1e-2;     // fall back when the bound > tol * ||output||; 0 = always exact
  std::string host_dir;          // host tier (exact f16 originals) file-backed here; "" = in RAM
  bool certify_adapt = true;     // raise a head's precision for new tokens when its bound keeps failing
  bool certify_measure = false;  // debug: also compute exact attention and record bound / actual error
  // Byte budget of the fast tier, a fraction of the f16 cache's bytes per token (0 = no limit):
  // adaptive precision raises a head's formats only while the fast tier's bytes per token stay
  // <= certify_budget * f16's; the other heads keep falling back to the host tier. The base
  // formats must fit it (docs/certified.md, "Byte budget").
  double certify_budget = 0;
  // Paged storage (dense and compressed caches; docs/architecture.md, "Paged KV cache"): page_size > 0
  // stores the rows of every global layer (the compressed body; every position of a dense cache) in
  // one pool of n_pages pages shared by all sequences, a page holding page_size consecutive rows of
  // one sequence for every global layer, kv head, K and V. A sequence takes pages on demand as it
  // appends and returns them on clear / truncate; pages are refcounted, so sequences can share a
  // prefix's full pages (kv_cache::save_prefix / load_prefix). Sliding-window rings, exact sink / tail rows and
  // channel statistics stay per sequence; the channel-calibration staging rows of the paged layers
  // take pages of the pool (stage_pages_for), so a truncate below the calibrated positions is
  // refused. Attention over pages equals the contiguous cache's bit for bit. page_size 0: contiguous per-sequence storage. A KIVI side needs page_size % kivi_group == 0.
  int page_size = 0;  // rows (tokens) per page; 0 = contiguous
  int n_pages = 0;    // pages in the pool; 0 = enough for every sequence at n_ctx
};

// The page pool of a paged cache (kv_cache::page_info); all zeros for a contiguous cache.
struct kv_page_info {
  int page_size = 0;          // rows per page
  int n_pages = 0;            // pages in the pool
  int n_free = 0;             // pages nobody references
  int n_seq_held = 0;         // pages referenced by at least one sequence
  int max_pages_per_seq = 0;  // pages one sequence at n_ctx holds
  size_t page_bytes = 0;      // bytes of one page (kv_page_bytes)
};

// One sequence's queries in a batched attend (kv_cache::attend_batch), as the arguments of
// kv_cache::attend.
struct attend_seq {
  int seq_id = 0;            // in [0, n_seq), at most once per batch
  int pos0 = 0;              // position (tokens) of the first query; query t attends [0, pos0 + t] (or its window)
  int n_tokens = 0;          // queries (tokens), >= 1
  const float* q = nullptr;  // [n_tokens, n_head, head_dim] f32 after RoPE
  float* out = nullptr;      // [n_tokens, n_head, head_dim]; must not overlap another sequence's q or out
};

// Per-step statistics a cache may report (certified mode fills these; others leave zeros).
struct kv_cache_stats {
  uint64_t attend_calls = 0;
  uint64_t heads_certified = 0, heads_partial = 0, heads_exact = 0;
};

// A sequence's state at one length, kept for prefix reuse (kv_cache::save_prefix): references to
// the pages that hold its rows and a copy of what it keeps outside pages (exact sink / recent rows,
// KIVI's residual, channel statistics, sliding-window rings). It keeps its pages referenced
// (pinned) until destroyed; the cache that made it must outlive it.
class kv_prefix {
 public:
  virtual ~kv_prefix() = default;
  virtual int n_pos() const = 0;         // positions (tokens) of the sequence it holds
  virtual int n_pages() const = 0;       // pages it references
  virtual int n_full_pages() const = 0;  // of those, the pages a load shares (a partly filled last one is copied)
  virtual size_t bytes() const = 0;      // bytes it holds outside the page pool
};

class kv_cache {
 public:
  virtual ~kv_cache() = default;
  virtual const kv_cache_params& params() const = 0;

  // Appends n_tokens new positions [n_pos(seq_id), n_pos(seq_id) + n_tokens) to layer il.
  // k, v: [n_tokens, n_kv_head, head_dim] f32, K after RoPE. Every layer must receive the same
  // tokens; n_pos() advances when the last layer has appended. Throws invalid_input when the
  // sequence would exceed n_ctx, or for non-finite values if the format cannot store them.
  // Order contract of the compressed caches with exact windows (sink / exact_recent / KIVI residual):
  // an append of n > 1 tokens may compress rows that the batch's own earlier queries still have in
  // their exact window; it keeps exact copies of those (at most n + U - 2 rows per kv head, U the
  // KIVI group or 1) in one scratch per sequence that the next such append to the sequence, of any
  // layer, replaces. attend of layer il then shows each query what a one-token decode at its position
  // would see, so outputs do not depend on how a prompt is split into appends (docs/formats.md,
  // "Exact windows"), when layer il's attend comes after its own append and before another layer's
  // append of n > 1 tokens to the sequence, as the model runs (append then attend, layer by layer).
  // Out of that order the attend is still valid but sees those rows compressed (as a query of an
  // earlier batch would); it never reads another layer's copies. The scratch (at most
  // n_seq x (n_ubatch + U - 2) x n_kv_head x head_dim f16 per side) is grown on first use and is not
  // in bytes() / kv_bytes_at_ctx, like the other per-call scratch.
  virtual void append(int il, int seq_id, int n_tokens, const float* k, const float* v) = 0;

  // Causal attention for layer il: query t (t < n_tokens) sits at position pos0 + t and attends
  // to cache positions [0, pos0 + t] of seq_id (which must already be appended), or with a sliding
  // window W (params().layers[il].window) to [pos0 + t - W + 1, pos0 + t]; logits soft-capped when
  // params().attn_softcap > 0. Throws invalid_input when a windowed layer no longer holds a
  // position the queries need (truncated further back than its ring reaches).
  // q: [n_tokens, n_head, head_dim] f32 after RoPE; GQA: query head h uses kv head
  // h / (n_head / n_kv_head). scale: usually 1/sqrt(head_dim). out: [n_tokens, n_head, head_dim].
  virtual void attend(int il, int seq_id, int pos0, int n_tokens, int n_head, const float* q,
                      float scale, float* out, thread_pool& pool) = 0;

  // attend() for several sequences of layer il in one call (e.g. one decode step of a batch), each
  // as if attended alone: the same outputs bit for bit (a sequence's split-K chunks depend on its
  // own length and the thread count only). The CPU caches thread over (sequence, kv head, query
  // tile, key chunk) at once through one planner (src/cache/attend_plan.h), so a batch of short
  // sequences keeps every thread busy. Each seq_id at most once per call (invalid_input otherwise).
  // Throws as attend(), validating every sequence before computing any. Like every kv_cache call,
  // one call at a time per cache (the caches keep scratch buffers).
  virtual void attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale, thread_pool& pool);

  virtual int n_pos(int seq_id) const = 0;          // positions stored (all layers)
  virtual void clear(int seq_id) = 0;               // forget every position of seq_id
  virtual void truncate(int seq_id, int n_pos) = 0; // keep positions [0, n_pos)

  virtual size_t bytes() const = 0;        // bytes allocated now (all layers, K and V, all tiers)
  virtual size_t bytes_used() const = 0;   // bytes holding stored positions (of a paged cache: the pages sequences hold)
  virtual kv_cache_stats stats() const { return {}; }

  // ---- paged caches (kv_cache_params::page_size > 0); the defaults serve contiguous caches ----
  virtual kv_page_info page_info() const { return {}; }
  // Page ids of seq_id's rows, in row order (page j holds rows [j * page_size, (j + 1) * page_size)).
  virtual std::vector<int> seq_pages(int seq_id) const;
  // Pages seq_id takes to hold n_pos positions (an upper bound: exact rows take none), at most
  // max_pages_per_seq; 0 for a contiguous cache.
  virtual int pages_for(int n_pos) const { (void)n_pos; return 0; }
  // Staging pages: a compressed cache with channel statistics (k_channel_scale, the q8 / q4
  // default) keeps a sequence's first channel_calib positions as given (f16 and the residual to
  // the value given, 4 bytes an element) until they have all arrived (24,576 bytes a position on
  // Qwen2.5-0.5B, twice f16's; queries attend the f16 half); a paged cache keeps them in pages of
  // its pool (page_size * code bytes / 4 bytes of them a page: 8 positions a 64-row q4 page, taken
  // in blocks of up to 4 pages that hold one kv head's rows in one run: 32 positions for q4 on
  // Qwen2.5-0.5B), taken as they arrive and returned once the sequence is calibrated, so that they
  // come out of the pool like the body (issue 16). stage_pages_for(n): the most
  // staging pages a sequence growing to n positions holds (the body's pages_for(n) come on top);
  // seq_stage_pages(seq): those it holds now. 0 for caches without staging in pages.
  virtual int stage_pages_for(int n_pos) const { (void)n_pos; return 0; }
  virtual int seq_stage_pages(int seq_id) const { (void)seq_id; return 0; }
  // References a page from outside the sequences (a prefix cache), so that it is not reused while
  // held; unpin_page drops it (the page returns to the pool when nothing references it).
  // invalid_input for a page id out of range or not referenced by anyone (pin) / not pinned (unpin).
  virtual void pin_page(int page);
  virtual void unpin_page(int page);
  // Prefix reuse for every format (the server's prefix cache; docs/server.md): save_prefix(seq)
  // keeps seq's whole state as it is now, load_prefix gives it to an empty sequence, which then
  // holds exactly that state: what it appends and attends next gives the bits seq would give (so a
  // request that continues a saved prompt prefix with the same chunks as a cold run returns the
  // cold run's result). True for the paged caches (page_size > 0).
  virtual bool can_save_prefix() const { return false; }
  // The state of seq_id (n_pos(seq_id) > 0 positions): its pages, pinned, and a copy of its rows and
  // statistics outside pages. Throws unsupported unless can_save_prefix(), invalid_input for an
  // empty sequence.
  virtual std::shared_ptr<const kv_prefix> save_prefix(int seq_id);
  // The empty sequence seq_id takes prefix p: it references p's full pages (never written while
  // shared), gets a copy of p's partly filled last page on a free page, and a copy of the rest.
  // Throws unsupported unless can_save_prefix(), invalid_input for a non-empty sequence, a prefix
  // saved by another cache, or no free page for the copy (nothing is changed then).
  virtual void load_prefix(int seq_id, const kv_prefix& p);
  virtual std::string describe() const = 0;  // e.g. "K q4 (hadamard, g32) / V q4 (hadamard, g32)"
};

// Checks every field of p before anything is allocated: shapes (>= 1), enum values in range, sink /
// recent >= 0, KIVI group and residual, group_size (32, 64, 128 or head_dim, dividing head_dim),
// head_dim for the formats (compressed: divisible by 8 and <= 1024; srft: even), an 8-bit
// per-token K group of at most kq8_k_group_max elements (the int32 dot bound, quant.h), certified
// options (certify_tol >= 0, certify_budget >= 0; no windows, channel_scale or k_channel_scale on). Throws invalid_input (or
// unsupported for a valid value the format cannot serve) with "[kv_cache] <field> <value> ...".
void validate(const kv_cache_params& p);

// The exact windows a cache gets where its user names none: the tools' --kv-sink / --kv-exact-recent
// "auto" (their default) and the Python API's sink / recent left out. kv_auto_sink (4) first and
// kv_auto_exact_recent (32) last positions of every layer are kept in f16 when a side is a per-token
// compressed format (q8 .. q2a) and neither side is per-channel (KIVI: its exact residual is its
// recent window; the README pairs it with --kv-sink 4) nor certified (which refuses windows, as does
// certify = true); none for f32 / f16 / bf16. The first tokens take most of the attention mass
// (attention sinks: StreamingLLM, Xiao et al. 2023, arXiv:2309.17453, §3) and the last ones large
// weights of local attention, so their quantization error reaches many later scores; the recent
// window plays the role of KIVI's exact residual (Liu et al. 2024, arXiv:2402.02750). What they buy
// on Qwen2.5: docs/quality.md ("Real models"). They cost (sink + exact_recent) x 2 x n_kv_head x
// head_dim x 2 bytes per layer and sequence, independent of n_ctx; kv_bytes_per_token (the body)
// is unchanged. Reads only type_k, type_v and certify of p; the cache itself never applies them
// (kv_cache_params::sink / exact_recent are taken as given, 0 = none).
inline constexpr int kv_auto_sink = 4;
inline constexpr int kv_auto_exact_recent = 32;
struct kv_windows {
  int sink = 0;          // first positions kept exact (kv_cache_params::sink)
  int exact_recent = 0;  // last positions kept exact (kv_cache_params::exact_recent)
};
kv_windows kv_auto_windows(const kv_cache_params& p);

// Creates a cache: validate(p) first, then the memory check, then the allocation.
std::unique_ptr<kv_cache> make_kv_cache(const kv_cache_params& p);

// All type names parse_kv_cache_type accepts, in kv_cache_type order.
std::vector<std::string> kv_type_names();

// Asymptotic storage per token of the whole model (all layers, K and V) in bytes, for a cache
// with these params (exact, as allocated per token away from group/page boundaries). Only global
// layers grow with the context: sliding-window layers (a fixed ring) count 0 here and are in
// kv_bytes_at_ctx / kv_bytes_by_layer_kind.
double kv_bytes_per_token(const kv_cache_params& p);

// The attention window of layer il (0: global); validates il.
int kv_layer_window(const kv_cache_params& p, int il);

// kv_bytes_at_ctx split by layer kind: global layers, and sliding-window layers (each of those
// holds min(n_ctx, ring) positions, independent of n_ctx beyond the ring). Sums to kv_bytes_at_ctx
// except the few bytes not owned by a layer (certified caches: all in `global`).
struct kv_layer_kind_bytes {
  int n_global = 0, n_windowed = 0;  // layers of each kind
  size_t global = 0, windowed = 0;   // bytes at p.n_ctx, all layers of the kind, K and V
};
kv_layer_kind_bytes kv_bytes_by_layer_kind(const kv_cache_params& p);

// The channel statistics of kv_cache_params::channel_scale / k_channel_scale (docs/formats.md,
// "Rotation and channel scale"), as a cache calibrates them on its staged positions: for each kv
// head and channel c of x [n_tokens][n_kv_head][head_dim] f32, mu = the channel mean rounded to f16
// and lambda = 2^e, e the nearest integer to log2 of the RMS of x_c - mean (the RMS floored at 1e-3
// of the head's largest), less the rounded mean e of the head, clamped to [-20, 20]; a head whose
// RMS are all 0 gets lambda 1. mu, lambda: [n_kv_head][head_dim]. Means and RMS are summed in
// double in token order, so cuda::channel_stats reproduces them bit for bit. Per-channel λ after
// the SRFT paper (arXiv:2605.05699); centring K as SageAttention (arXiv:2410.02367, §3.2).
// n_tokens >= 1.
void kv_channel_stats_ref(const float* x, int n_tokens, int n_kv_head, int head_dim, float* mu, float* lambda);

// Bytes that make_kv_cache(p) allocates (its bytes() before any append), computed without
// allocating: every layer, sequence and kv head at p.n_ctx positions, K and V, including what
// kv_bytes_per_token leaves out: the exact f16 rows of the sink and recent windows and of the
// KIVI residual tail, and the per-channel scales. A compressed cache sizes its body for the
// positions that can leave the exact windows (n_ctx - sink - recent, in whole KIVI groups), so the
// total is at most the f16 cache's plus the rows of one partial KIVI group. Certified caches grow
// on demand; for them this is kv_bytes_per_token x n_ctx x n_seq. Throws as make_kv_cache on
// invalid params.
size_t kv_bytes_at_ctx(const kv_cache_params& p);

// Bytes of one page of a paged cache with these params (p.page_size rows of every global layer,
// every kv head, K and V: codes and scales of the compressed body, or the dense rows), so that a
// budget of B bytes is B / kv_page_bytes(p) pages (the server's --kv-budget). Throws as
// make_kv_cache; invalid_input when p.page_size < 1; unsupported for certified caches.
size_t kv_page_bytes(const kv_cache_params& p);

// The attention tier attend() of a cache made from p runs on this machine for its compressed body
// (attn_quant_tier, or the dense tier for f32/f16/bf16): "avx512", "avx2" (best_isa(), lowered by
// KVQ_ISA) when the SIMD engine takes the formats, groups and head_dim (a multiple of 16 up to
// 256), else "scalar", the reference (9-18x slower); "scalar (certified reference)" for the
// certified cache. Reads only the types, groups and head_dim of p (issue 15 item 6: kvq info,
// generate and perplexity name it, so no slow path is silent).
std::string kv_attn_tier(const kv_cache_params& p);

}  // namespace kvq
