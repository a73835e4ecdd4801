// make_kv_cache(): validates params and picks the implementation (STYLE.md habit 7).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "cache/kv_cache_impl.h"
#include "kvq/attention.h"
#include "kvq/certified.h"
#include "kvq/error.h"
#include "kvq/sys_memory.h"
#include "kvq/quant.h"
#include "kvq/rotation.h"

namespace kvq {

static std::string joined_type_names() {
  std::string s;
  for (const auto& t : kv_type_names()) s += (s.empty() ? "" : ", ") + t;
  return s;
}

std::vector<std::string> kv_type_names() {
  std::vector<std::string> names;
  for (int t = 0; t < (int)kv_cache_type::count; ++t) names.push_back(kv_cache_type_name((kv_cache_type)t));
  return names;
}

const char* kv_cache_type_name(kv_cache_type t) {
  if (t == kv_cache_type::certified) return "certified";  // the tiered certified cache (certified.h)
  if (t > kv_cache_type::certified) return "?";  // (unsigned underlying type: never < 0)
  return kv_traits((kv_format)t).name;
}

bool kv_cache_type_format(kv_cache_type t, kv_format* f) {
  if (t >= kv_cache_type::certified) return false;
  *f = (kv_format)t;
  return true;
}

kv_cache_type parse_kv_cache_type(const std::string& name, const char* side) {
  for (int t = 0; t < (int)kv_cache_type::count; ++t)
    if (name == kv_cache_type_name((kv_cache_type)t)) return (kv_cache_type)t;
  // llama.cpp's --cache-type names, for users coming from there (q4_0 is per-token symmetric 4-bit
  // with an f16 scale per 32 elements, as kvq's q4; q4_1 adds a minimum, as q4a)
  static const char* const llama[][2] = {{"q8_0", "q8"}, {"q4_0", "q4"}, {"q4_1", "q4a"},
                                         {"q5_0", "q4 or q8"}, {"q5_1", "q4a or q8a"}, {"iq4_nl", "q4"}};
  std::string hint;
  for (const auto& l : llama)
    if (name == l[0]) hint = std::string("; llama.cpp's ") + l[0] + " is closest to kvq's " + l[1];
  fail_input(std::string("[kv_cache] unknown ") + side + " cache type '" + name + "' (supported: " +
             joined_type_names() + ")" + hint);
}

const char* attn_path_name(attn_path a) {
  switch (a) {
    case attn_path::fused: return "fused";
    case attn_path::dequant: return "dequant";
    default: return "?";
  }
}

attn_path parse_attn_path(const std::string& name) {
  for (int a = 0; a < (int)attn_path::count; ++a)
    if (name == attn_path_name((attn_path)a)) return (attn_path)a;
  fail_input("[kv_cache] unknown attn_impl '" + name + "' (supported: fused, dequant)");
}

std::optional<rotation_kind> parse_kv_rotation(const std::string& name) {
  if (name == "auto") return std::nullopt;
  for (int k = 0; k < (int)rotation_kind::count; ++k)
    if (name == rotation_name((rotation_kind)k)) return (rotation_kind)k;
  fail_input("[kv_cache] unknown rotation '" + name + "' (supported: none, hadamard, srht, srft, auto)");
}

std::optional<bool> parse_kv_switch(const std::string& name, const char* field) {
  if (name == "auto") return std::nullopt;
  if (name == "on" || name == "off") return name == "on";
  fail_input(std::string("[kv_cache] ") + field + " must be on, off or auto, got '" + name + "'");
}

std::string kv_rotation_name(const std::optional<rotation_kind>& r) { return r ? rotation_name(*r) : "auto"; }

kv_format side_format(const kv_cache_params& p, bool is_v) {
  const kv_cache_type t = is_v ? p.type_v : p.type_k;
  kv_format f;
  if (kv_cache_type_format(t, &f)) return f;
  return is_v ? kCertifiedDefaultV : kCertifiedDefaultK;
}

kv_elem dense_elem_of(kv_cache_type t) {
  switch (t) {
    case kv_cache_type::f32: return kv_elem::f32;
    case kv_cache_type::f16: return kv_elem::f16;
    case kv_cache_type::bf16: return kv_elem::bf16;
    default: return kv_elem::count;
  }
}

rotation_kind side_rotation(const kv_cache_params& p, kv_format f, bool certified) {
  if (kv_traits(f).layout == kv_layout::dense) return rotation_kind::none;
  if (p.rotation) return *p.rotation;
  // auto: the format's default; the certified cache rotates every per-token side (per-channel K
  // stays in the original basis, as KIVI: its per-channel scale and zero handle outlier channels)
  return (certified && kv_traits(f).layout == kv_layout::per_token) || kv_traits(f).rotate_by_default
             ? rotation_kind::hadamard
             : rotation_kind::none;
}

void validate(const kv_cache_params& p) {
  auto need = [](int v, const char* field) {
    if (v < 1) fail_input(std::string("[kv_cache] ") + field + " must be >= 1, got " + std::to_string(v));
  };
  need(p.n_layer, "n_layer");
  need(p.n_kv_head, "n_kv_head");
  need(p.head_dim, "head_dim");
  need(p.n_ctx, "n_ctx");
  need(p.n_seq, "n_seq");
  if (!p.layers.empty() && (int)p.layers.size() != p.n_layer)
    fail_input("[kv_cache] layers must be empty or hold n_layer " + std::to_string(p.n_layer) + " entries, got " +
               std::to_string(p.layers.size()));
  for (size_t il = 0; il < p.layers.size(); ++il) {
    const kv_layer_geometry& g = p.layers[il];
    const std::string at = "[kv_cache] layers[" + std::to_string(il) + "].";
    if (g.window < 0) fail_input(at + "window must be >= 0 (0 = global), got " + std::to_string(g.window));
    if (g.n_kv_head < 0 || g.head_dim < 0)
      fail_input(at + "n_kv_head and head_dim must be >= 0 (0 = the cache-wide value), got " +
                 std::to_string(g.n_kv_head) + " and " + std::to_string(g.head_dim));
    if ((g.n_kv_head && g.n_kv_head != p.n_kv_head) || (g.head_dim && g.head_dim != p.head_dim))
      fail_unsupported(at + "n_kv_head " + std::to_string(g.n_kv_head) + " / head_dim " + std::to_string(g.head_dim) +
                       " differ from the cache-wide " + std::to_string(p.n_kv_head) + " / " +
                       std::to_string(p.head_dim) + ": per-layer head shapes are not supported yet");
  }
  if (p.n_ubatch < 1) fail_input("[kv_cache] n_ubatch must be >= 1, got " + std::to_string(p.n_ubatch));
  if (!(p.attn_softcap >= 0.0f) || !std::isfinite(p.attn_softcap))
    fail_input("[kv_cache] attn_softcap must be finite and >= 0 (0 = none), got " + std::to_string(p.attn_softcap));
  for (const auto& [t, side] : {std::pair{p.type_k, "type_k"}, std::pair{p.type_v, "type_v"}})
    if (t >= kv_cache_type::count)
      fail_input(std::string("[kv_cache] ") + side + " " + std::to_string((int)t) + " is not a kv_cache_type");
  if (p.attn >= attn_path::count)
    fail_input("[kv_cache] attn " + std::to_string((int)p.attn) + " is not an attn_path");
  if (p.rotation && ((int)*p.rotation < 0 || *p.rotation >= rotation_kind::count))
    fail_input("[kv_cache] rotation " + std::to_string((int)*p.rotation) + " is not a rotation_kind");
  if (p.sink < 0 || p.exact_recent < 0)
    fail_input("[kv_cache] sink and exact_recent must be >= 0, got sink " + std::to_string(p.sink) + ", exact_recent " +
               std::to_string(p.exact_recent));
  const int hd = p.head_dim;
  const bool cert = is_certified(p);
  const std::string who = cert ? "[kv_cache] certified cache: " : "[kv_cache] ";
  if (cert) {
    if (!(p.certify_tol >= 0))
      fail_input("[kv_cache] certify_tol (--kv-tol) must be >= 0, got " + std::to_string(p.certify_tol));
    if (p.exact_recent != 0 || p.channel_scale)
      fail_unsupported("[kv_cache] certified cache: exact recent windows and channel_scale are not supported "
                       "(every token is exact in the host tier already; the sink window is: its rows are f16 in the "
                       "fast tier)");
    if (p.k_channel_scale.value_or(false))
      fail_unsupported("[kv_cache] certified cache: k_channel_scale (--kv-k-channel-scale on) is not supported (the "
                       "bound is for K itself, not K - mu); for K with large channel offsets (Qwen2.5) use a "
                       "per-channel K format: -ctk kivi4 or kivi2 --kv-certify");
    if (!(p.certify_budget >= 0) || !std::isfinite(p.certify_budget))
      fail_input("[kv_cache] certify_budget (--kv-cert-budget) must be a finite fraction >= 0 (0 = no limit), got " +
                 std::to_string(p.certify_budget));
    if (hd > 1024) fail_unsupported("[kv_cache] certified cache: head_dim " + std::to_string(hd) + " > 1024");
  }
  bool kivi = false;
  for (const bool is_v : {false, true}) {
    const kv_format f = side_format(p, is_v);
    const auto& t = kv_traits(f);
    const char* side = is_v ? "V" : "K";
    const std::string type = kv_cache_type_name(is_v ? p.type_v : p.type_k);
    if (t.layout == kv_layout::dense) continue;
    kivi = kivi || t.layout == kv_layout::per_channel;
    if (hd % 8 != 0)
      fail_unsupported(who + side + " cache type '" + type + "' needs head_dim divisible by 8, got " +
                       std::to_string(hd));
    if (hd > 1024)
      fail_unsupported(who + side + " cache type '" + type + "': head_dim " + std::to_string(hd) +
                       " > 1024 (the compressed formats support head_dim up to 1024)");
    if (cert && t.levels)
      fail_unsupported("[kv_cache] certified cache: " + std::string(side) + " cache type '" + type +
                       "' (non-uniform levels) is not supported: its error bound is that of a uniform step");
    const rotation_kind rk = side_rotation(p, f, cert);
    if (rk == rotation_kind::srft && hd % 2 != 0)
      fail_unsupported("[kv_cache] rotation srft needs an even head_dim, got " + std::to_string(hd));
    if (t.layout == kv_layout::per_token || (is_v && t.layout == kv_layout::per_channel)) {
      const int g = p.group_size == 0 ? (hd % 32 == 0 ? 32 : hd) : p.group_size;
      if (g < 1 || hd % g != 0 || !(g == 32 || g == 64 || g == 128 || g == hd))
        fail_input("[kv_cache] group_size " + std::to_string(p.group_size) +
                   " must be 32, 64, 128 or head_dim and divide head_dim " + std::to_string(hd));
      if (!is_v && !cert && t.bits == 8 && g > kq8_k_group_max) {
        // the hint names only the groups that divide head_dim (576: 32 or 64; 264: none)
        std::vector<std::string> fit;
        for (int c : {32, 64, 128})
          if (hd % c == 0) fit.push_back(std::to_string(c));
        std::string hint = "use group_size ";
        for (size_t i = 0; i < fit.size(); ++i) hint += (i == 0 ? "" : i + 1 == fit.size() ? " or " : ", ") + fit[i];
        if (fit.empty())
          hint = "no 8-bit per-token K group of 32, 64 or 128 divides head_dim " + std::to_string(hd) +
                 ": use kivi8 (per-channel) or a 4-bit type for K";
        fail_unsupported("[kv_cache] group_size " + std::to_string(g) + " (head_dim " + std::to_string(hd) + ") of " +
                         side + " cache type '" + type + "' exceeds " + std::to_string(kq8_k_group_max) +
                         ", the largest 8-bit K group whose integer dot fits in int32; " + hint);
      }
    }
  }
  if (kivi) {
    if (p.kivi_group < 1 || p.kivi_group > 4096)
      fail_input("[kv_cache] kivi_group must be in [1, 4096], got " + std::to_string(p.kivi_group));
    if (p.kivi_residual < 0) fail_input("[kv_cache] kivi_residual must be >= 0, got " + std::to_string(p.kivi_residual));
  }
  if (p.channel_calib < 1)
    fail_input("[kv_cache] channel_calib must be >= 1 (positions the channel statistics are calibrated on), got " +
               std::to_string(p.channel_calib));
  if (p.page_size < 0 || p.n_pages < 0)
    fail_input("[kv_cache] page_size and n_pages must be >= 0 (0 = contiguous / a full pool), got page_size " +
               std::to_string(p.page_size) + ", n_pages " + std::to_string(p.n_pages));
  if (p.page_size > 0) {
    if (cert) fail_unsupported("[kv_cache] certified cache: paged storage (page_size " + std::to_string(p.page_size) +
                               ") is not supported");
    if (kivi && p.page_size % p.kivi_group != 0)
      fail_input("[kv_cache] page_size " + std::to_string(p.page_size) + " must be a multiple of kivi_group " +
                 std::to_string(p.kivi_group) + " (a KIVI group's scales live on one page)");
  }
}

namespace {

enum class cache_impl { certified, dense, quant };

// The implementation serving p (validated).
cache_impl impl_of(const kv_cache_params& p) {
  if (is_certified(p)) return cache_impl::certified;  // tiered certified cache (certified.h)
  if (dense_elem_of(p.type_k) != kv_elem::count && dense_elem_of(p.type_v) != kv_elem::count)
    return cache_impl::dense;
  return cache_impl::quant;
}

}  // namespace

kv_windows kv_auto_windows(const kv_cache_params& p) {
  if (p.certify) return {};
  bool per_token = false;
  for (kv_cache_type t : {p.type_k, p.type_v}) {
    kv_format f;
    if (!kv_cache_type_format(t, &f)) return {};  // certified (or out of range: validate names it)
    if (kv_traits(f).layout == kv_layout::per_channel) return {};
    per_token = per_token || kv_traits(f).layout == kv_layout::per_token;
  }
  if (!per_token) return {};
  return {kv_auto_sink, kv_auto_exact_recent};
}

int kv_layer_window(const kv_cache_params& p, int il) {
  if (il < 0 || il >= p.n_layer)
    fail_input("[kv_cache] layer " + std::to_string(il) + " out of range [0, " + std::to_string(p.n_layer) + ")");
  return p.layers.empty() ? 0 : p.layers[il].window;
}

int kv_ring_positions(const kv_cache_params& p, int il) {
  const int w = kv_layer_window(p, il);
  return w > 0 ? (int)std::min<int64_t>(p.n_ctx, (int64_t)w - 1 + p.n_ubatch) : p.n_ctx;
}

void check_ring_append(const kv_cache_params& p, int il, int n_tokens) {
  if (n_tokens <= p.n_ubatch || kv_ring_positions(p, il) >= p.n_ctx) return;
  fail_input("[kv_cache] append: " + std::to_string(n_tokens) + " tokens at once to layer " + std::to_string(il) +
             " (sliding window " + std::to_string(kv_layer_window(p, il)) + "), more than n_ubatch " +
             std::to_string(p.n_ubatch) + ", which sizes its ring; append in batches of at most n_ubatch or raise it");
}

void check_ring_holds(const kv_cache_params& p, const char* op, int il, int seq_id, int lo, int first) {
  if (lo >= first) return;
  fail_input(std::string("[kv_cache] ") + op + ": layer " + std::to_string(il) + " (sliding window " +
             std::to_string(kv_layer_window(p, il)) + ") of seq " + std::to_string(seq_id) +
             " no longer holds position " + std::to_string(lo) + " (its ring holds positions from " +
             std::to_string(first) + "; the sequence was truncated further back than the ring reaches)");
}

kv_layer_kind_bytes kv_bytes_by_layer_kind(const kv_cache_params& p) {
  const cache_impl impl = impl_of(p);  // validates
  kv_layer_kind_bytes r;
  for (int il = 0; il < p.n_layer; ++il) {
    const bool win = kv_layer_window(p, il) > 0;
    (win ? r.n_windowed : r.n_global) += 1;
    if (impl == cache_impl::certified) continue;
    const size_t b = impl == cache_impl::dense ? kv_layer_bytes_dense(p, il) : kv_layer_bytes_quant(p, il);
    (win ? r.windowed : r.global) += b;
  }
  if (impl == cache_impl::certified) r.global = kv_bytes_at_ctx(p);
  return r;
}

void kv_cache::attend_batch(int il, const attend_seq* seqs, int n_seqs, int n_head, float scale, thread_pool& pool) {
  check_attend_batch("attend_batch", seqs, n_seqs, params().n_seq);
  for (int i = 0; i < n_seqs; ++i)
    attend(il, seqs[i].seq_id, seqs[i].pos0, seqs[i].n_tokens, n_head, seqs[i].q, scale, seqs[i].out, pool);
}

std::vector<int> kv_cache::seq_pages(int seq_id) const {
  check_layer_seq(params(), "seq_pages", 0, seq_id);
  return {};
}
void kv_cache::pin_page(int page) {
  fail_unsupported("[kv_cache] pin_page " + std::to_string(page) + ": not a paged cache (page_size 0)");
}
void kv_cache::unpin_page(int page) {
  fail_unsupported("[kv_cache] unpin_page " + std::to_string(page) + ": not a paged cache (page_size 0)");
}

std::shared_ptr<const kv_prefix> kv_cache::save_prefix(int seq_id) {
  fail_unsupported("[kv_cache] save_prefix: seq " + std::to_string(seq_id) + ": this cache cannot save a prefix (" +
                   describe() + (page_info().page_size == 0 ? ", not paged" : "") + ")");
}
void kv_cache::load_prefix(int seq_id, const kv_prefix&) {
  fail_unsupported("[kv_cache] load_prefix: seq " + std::to_string(seq_id) + ": this cache cannot load a prefix (" +
                   describe() + (page_info().page_size == 0 ? ", not paged" : "") + ")");
}

void check_append_order(int il, int seq_id, int n_tokens, int n_layer, int n_ctx, int held, int held_prev, int n_pos) {
  const std::string where = "layer " + std::to_string(il) + " of seq " + std::to_string(seq_id);
  if (n_tokens < 0) fail_input("[kv_cache] append: n_tokens must be >= 0, got " + std::to_string(n_tokens));
  if (il != n_layer - 1 && held != n_pos)
    fail_input("[kv_cache] append: " + where + " holds " + std::to_string(held) + " positions but the sequence has " +
               std::to_string(n_pos) + " (every layer must append the same tokens, in layer order)");
  if (il > 0 && (int64_t)held + n_tokens > held_prev)
    fail_input("[kv_cache] append: " + where + " would hold " + std::to_string((int64_t)held + n_tokens) +
               " positions, more than layer " + std::to_string(il - 1) + "'s " + std::to_string(held_prev) +
               " (every layer must append the same tokens, in layer order)");
  if ((int64_t)held + n_tokens > n_ctx)
    fail_input("[kv_cache] append: seq " + std::to_string(seq_id) + " would hold " +
               std::to_string((int64_t)held + n_tokens) + " positions, n_ctx is " + std::to_string(n_ctx));
}

void check_layer_seq(const kv_cache_params& p, const char* op, int il, int seq_id) {
  if (il < 0 || il >= p.n_layer)
    fail_input(std::string("[kv_cache] ") + op + ": layer " + std::to_string(il) + " out of range [0, " +
               std::to_string(p.n_layer) + ")");
  if (seq_id < 0 || seq_id >= p.n_seq)
    fail_input(std::string("[kv_cache] ") + op + ": seq_id " + std::to_string(seq_id) + " out of range [0, " +
               std::to_string(p.n_seq) + ")");
}

void fail_attend_positions(const char* op, int il, const attend_seq& a, int held) {
  fail_input(std::string("[kv_cache] ") + op + ": queries at positions [" + std::to_string(a.pos0) + ", " +
             std::to_string((int64_t)a.pos0 + a.n_tokens) + ") need appended positions, layer " + std::to_string(il) +
             " of seq " + std::to_string(a.seq_id) + " holds " + std::to_string(held));
}

void fail_attend_heads(const char* op, int n_head, int n_kv_head) {
  fail_input(std::string("[kv_cache] ") + op + ": n_head " + std::to_string(n_head) +
             " is not a multiple of n_kv_head " + std::to_string(n_kv_head));
}

void check_attend_batch(const char* op, const attend_seq* seqs, int n_seqs, int n_seq) {
  const std::string tag = std::string("[kv_cache] ") + op + ": ";
  if (n_seqs < 0 || (n_seqs > 0 && seqs == nullptr))
    fail_input(tag + std::to_string(n_seqs) + " sequences" + (seqs ? "" : " and no array"));
  std::vector<uint8_t> seen((size_t)std::max(n_seq, 0), 0);
  for (int i = 0; i < n_seqs; ++i) {
    const int s = seqs[i].seq_id;
    if (s < 0 || s >= n_seq)
      fail_input(tag + "seq_id " + std::to_string(s) + " out of range [0, " + std::to_string(n_seq) + ")");
    if (seen[(size_t)s]++) fail_input(tag + "seq_id " + std::to_string(s) + " appears twice in one call");
  }
}

std::unique_ptr<kv_cache> make_kv_cache(const kv_cache_params& p) {
  validate(p);
  const cache_impl impl = impl_of(p);
  // Refused up front rather than left to the allocator (an OOM kill, or std::bad_alloc as an
  // internal error): a cache larger than the memory available now.
  const size_t need = kv_bytes_at_ctx(p), avail = mem_available_bytes();
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  auto gib = [&](size_t bytes) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f GiB", (double)bytes / kGiB);
    return std::string(b);
  };
  auto too_big = [&](const std::string& why) {
    fail_input("[kv_cache] a cache of n_ctx " + std::to_string(p.n_ctx) + " x n_seq " + std::to_string(p.n_seq) +
               " (K " + kv_cache_type_name(p.type_k) + " / V " + kv_cache_type_name(p.type_v) + ") needs " + gib(need) + ", " + why +
               "; lower -c or use a smaller KV type");
  };
  if (avail > 0 && need > avail) too_big("more than the " + gib(avail) + " of memory available (MemAvailable)");
  try {
    switch (impl) {
      case cache_impl::certified: return make_kv_cache_certified(p);
      case cache_impl::dense: return make_kv_cache_dense(p);
      default: return make_kv_cache_quant(p);
    }
  } catch (const std::bad_alloc&) {
    too_big("and its allocation failed");
  }
  return nullptr;  // not reached: too_big throws
}

double kv_bytes_per_token(const kv_cache_params& p) {
  validate(p);
  switch (impl_of(p)) {
    case cache_impl::certified: return kv_bytes_per_token_certified(p);
    case cache_impl::dense: return kv_bytes_per_token_dense(p);
    default: return kv_bytes_per_token_quant(p);  // sized without allocating
  }
}

size_t kv_page_bytes(const kv_cache_params& p) {
  validate(p);
  if (p.page_size < 1) fail_input("[kv_cache] kv_page_bytes: page_size must be >= 1, got " + std::to_string(p.page_size));
  switch (impl_of(p)) {
    case cache_impl::certified: fail_unsupported("[kv_cache] certified cache: paged storage is not supported");
    case cache_impl::dense: return kv_page_bytes_dense(p);
    default: return kv_page_bytes_quant(p);
  }
}

size_t kv_bytes_at_ctx(const kv_cache_params& p) {
  validate(p);
  switch (impl_of(p)) {
    case cache_impl::certified: return (size_t)std::llround(kv_bytes_per_token_certified(p) * p.n_ctx * p.n_seq);
    case cache_impl::dense: return kv_bytes_at_ctx_dense(p);
    default: return kv_bytes_at_ctx_quant(p);
  }
}

std::string kv_attn_tier(const kv_cache_params& p) {
  kv_format f;
  if (!kv_cache_type_format(p.type_k, &f)) return "scalar (certified reference)";
  kv_quant_view kv;
  kv.head_dim = p.head_dim;
  kv.k.format = f;
  kv.v.format = side_format(p, true);
  const int group = p.group_size ? p.group_size : p.head_dim % 32 == 0 ? 32 : p.head_dim;
  kv.k.group = kv_traits(f).layout == kv_layout::per_channel ? p.kivi_group : group;
  kv.v.group = group;
  return isa_name(attn_quant_tier(kv));
}

}  // namespace kvq
