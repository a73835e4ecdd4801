// Host-only parts of the GPU model path (include/kvq/cuda_model.h), built with and without CUDA so
// that what the GPU refuses is tested everywhere: the device names and check_supported.
#include <algorithm>
#include <string>

#include "kvq/cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "model_cuda/runner_format.h"

namespace kvq {

compute_device parse_compute_device(const std::string& name) {
  if (name == "cpu") return compute_device::cpu;
  if (name == "cuda") return compute_device::cuda;
  fail_input("[device] unknown device '" + name + "' (supported: cpu, cuda)");
}

const char* compute_device_name(compute_device d) { return d == compute_device::cuda ? "cuda" : "cpu"; }

namespace cuda {

namespace {
constexpr int kMaxChannelCalib = 8192;  // staged_attention keeps a query's scores in shared memory
constexpr int kMaxSink = 1024;          // exact_window_view::cap
[[noreturn]] void refuse(const std::string& what) { fail_unsupported("[cuda model] " + what); }
}  // namespace

// The GPU's KIVI cache (-ctk kivi4 -ctv q4a / kivi4; docs/cuda.md "KIVI"): K per-channel in groups of
// 32 positions, unrotated; V q4a, rotated as the CPU's auto rotation does (q4a: Hadamard; kivi4's V:
// none); exact sink and residual. Refuses what it does not run, naming it.
paged_kv_format runner_kivi_format(const model_hparams& hp, const kv_cache_params& cp) {
  const std::string types = std::string("-ctk kivi4 -ctv ") + kv_cache_type_name(cp.type_v);
  if (hp.head_dim % 32 != 0)
    refuse(types + ": head_dim " + std::to_string(hp.head_dim) + " (the GPU's KIVI pages need a multiple of 32)");
  if (cp.kivi_group != 32)
    refuse(types + ": --kv-kivi-group " + std::to_string(cp.kivi_group) + " (the GPU's KIVI groups are 32 positions)");
  if (cp.kivi_residual < 1 || cp.kivi_residual > 256)
    refuse(types + ": --kv-residual " + std::to_string(cp.kivi_residual) + " (the GPU keeps 1 .. 256 residual rows)");
  if (cp.sink < 0 || cp.exact_recent < 0)
    fail_input("[cuda model] --kv-sink " + std::to_string(cp.sink) + " / --kv-exact-recent " +
               std::to_string(cp.exact_recent) + " must be >= 0");
  if (cp.exact_recent > 256)
    refuse(types + ": --kv-exact-recent " + std::to_string(cp.exact_recent) + " (the GPU keeps at most 256)");
  if (cp.sink > 256)
    refuse(types + ": --kv-sink " + std::to_string(cp.sink) + " (the GPU keeps at most 256 with KIVI)");
  rotation_kind rot = cp.type_v == kv_cache_type::q4a ? rotation_kind::hadamard : rotation_kind::none;
  if (cp.rotation) {
    if (*cp.rotation != rotation_kind::none)
      refuse(types + ": --kv-rot " + rotation_name(*cp.rotation) +
             " would rotate K as well (an explicit rotation applies to both sides); the GPU's KIVI K is unrotated "
             "(use the default rotation, or none)");
    rot = rotation_kind::none;
  }
  const int def_group = 32;
  if (cp.group_size != 0 && cp.group_size != def_group)
    refuse("group size " + std::to_string(cp.group_size) + " (the GPU's q4a V uses the default, 32)");
  if (cp.channel_scale)
    refuse(types + ": the channel scale (--kv-channel-scale) is not implemented for KIVI on the GPU");
  if (cp.k_channel_scale.value_or(false))
    refuse(types + ": the K channel scale (per-channel K needs none; it is off for KIVI on the CPU too)");
  if (cp.attn != attn_path::fused) refuse("the dequantize attention path is a CPU baseline only");
  if (cp.certify) refuse("certified attention is CPU only");
  if (cp.attn_softcap > 0.0f) refuse("attention logit soft-capping is not supported on the GPU yet");
  paged_kv_format f;
  f.format = kv_format::kivi4;
  f.head_dim = hp.head_dim;
  f.n_kv_head = hp.n_kv_head;
  f.page_size = 32;
  f.rotation = rot;
  paged_kv_geometry_of(f);
  if (hp.n_head % hp.n_kv_head != 0 || hp.n_head / hp.n_kv_head > 8)
    refuse("n_head " + std::to_string(hp.n_head) + " / n_kv_head " + std::to_string(hp.n_kv_head) +
           ": the decode kernel takes whole GQA groups of at most 8 query heads");
  return f;
}

paged_kv_format runner_kv_format(const model_hparams& hp, const kv_cache_params& cp, int max_batch) {
  if (max_batch < 1) fail_input("[cuda model] max_batch must be >= 1, got " + std::to_string(max_batch));
  if (cp.n_ctx < 1) fail_input("[cuda model] n_ctx must be >= 1, got " + std::to_string(cp.n_ctx));
  if (cp.n_seq < 1) fail_input("[cuda model] n_seq must be >= 1, got " + std::to_string(cp.n_seq));
  // the model
  if (hp.arch != "llama" && hp.arch != "mistral" && hp.arch != "qwen2")
    refuse("architecture '" + hp.arch +
           "' does not run on the GPU yet (supported: llama, mistral, qwen2; use --device cpu)");
  if (hp.qk_norm || hp.post_norms || hp.ffn != ffn_type::swiglu || hp.embd_scale != 1.0f)
    refuse("this " + hp.arch +
           " model has per-head q/k norms, post-norms, GeGLU or scaled embeddings (not on the GPU yet)");
  if (hp.final_logit_softcap > 0.0f) refuse("final logit soft-capping is not supported on the GPU");
  for (int il = 0; il < hp.n_layer; ++il)
    if (hp.layers[il].window > 0)
      refuse("layer " + std::to_string(il) + " attends over a sliding window of " +
             std::to_string(hp.layers[il].window) + " tokens (not supported on the GPU yet)");
  if (hp.n_rot < 2 || hp.n_rot % 2 != 0 || hp.n_rot > hp.head_dim)
    refuse("rope.dimension_count " + std::to_string(hp.n_rot) + " must be even and in [2, head_dim " +
           std::to_string(hp.head_dim) + "]");
  // the cache
  if (cp.type_k == kv_cache_type::kivi4 && (cp.type_v == kv_cache_type::q4a || cp.type_v == kv_cache_type::kivi4))
    return runner_kivi_format(hp, cp);
  kv_format fk{}, fv{};
  if ((kv_cache_type_format(cp.type_k, &fk) && kv_traits(fk).layout == kv_layout::per_channel) ||
      (kv_cache_type_format(cp.type_v, &fv) && kv_traits(fv).layout == kv_layout::per_channel))
    refuse(std::string("-ctk ") + kv_cache_type_name(cp.type_k) + " -ctv " + kv_cache_type_name(cp.type_v) +
           ": the GPU's KIVI cache is -ctk kivi4 with -ctv q4a or kivi4 (other KIVI types have no GPU kernels)");
  if (cp.type_k != cp.type_v)
    refuse(std::string("-ctk ") + kv_cache_type_name(cp.type_k) + " -ctv " + kv_cache_type_name(cp.type_v) +
           ": K and V must have the same type on the GPU (supported: f16, q8, q4; or -ctk kivi4 -ctv q4a / kivi4)");
  kv_format fmt{};
  if (!kv_cache_type_format(cp.type_k, &fmt) || (fmt != kv_format::f16 && fmt != kv_format::q8 && fmt != kv_format::q4))
    refuse(std::string("cache type '") + kv_cache_type_name(cp.type_k) +
           "' has no GPU kernels (supported: f16, q8, q4)");
  const bool compressed = fmt != kv_format::f16;
  rotation_kind rot = rotation_kind::none;
  if (compressed) {
    rot = cp.rotation.value_or(kv_traits(fmt).rotate_by_default ? rotation_kind::hadamard : rotation_kind::none);
    if (rot != rotation_kind::none && rot != rotation_kind::hadamard)
      refuse(std::string("rotation '") + rotation_name(rot) + "' has no GPU kernels (supported: none, hadamard)");
    const int def_group = hp.head_dim % 32 == 0 ? 32 : hp.head_dim;
    if (cp.group_size != 0 && cp.group_size != def_group)
      refuse("group size " + std::to_string(cp.group_size) + " (the GPU pages use the default, " +
             std::to_string(def_group) + ")");
    // K channel scale (on by default, as on the CPU): supported; V's (--kv-channel-scale) not yet
    if (cp.channel_scale)
      refuse("the V channel scale (--kv-channel-scale) is not implemented on the GPU (the K channel scale, on by "
             "default, is)");
    if (cp.k_channel_scale.value_or(true)) {
      if (cp.channel_calib < 1)
        fail_input("[cuda model] channel_calib " + std::to_string(cp.channel_calib) + " must be >= 1");
      if (std::min(cp.channel_calib, cp.n_ctx) > kMaxChannelCalib)
        refuse("--kv-channel-calib " + std::to_string(cp.channel_calib) + ": the GPU attends at most " +
               std::to_string(kMaxChannelCalib) + " staged positions");
    }
    if (cp.attn != attn_path::fused) refuse("the dequantize attention path is a CPU baseline only");
  } else if (cp.channel_scale) {
    refuse("channel scale on an f16 cache");
  }
  // exact windows (docs/formats.md "Exact windows"): the sink of a q8 / q4 cache, not yet the recent window
  if (cp.sink < 0 || cp.exact_recent < 0)
    fail_input("[cuda model] --kv-sink " + std::to_string(cp.sink) + " / --kv-exact-recent " +
               std::to_string(cp.exact_recent) + " must be >= 0");
  if ((cp.sink > 0 || cp.exact_recent > 0) && !compressed)
    refuse("exact windows (--kv-sink " + std::to_string(cp.sink) + ", --kv-exact-recent " +
           std::to_string(cp.exact_recent) + ") on an f16 cache, whose positions are all exact (use 0)");
  if (cp.exact_recent > 0)
    refuse("exact recent windows (--kv-exact-recent " + std::to_string(cp.exact_recent) +
           ") are not supported on the GPU yet (--kv-sink is; use --kv-exact-recent 0)");
  if (cp.sink > kMaxSink)
    refuse("--kv-sink " + std::to_string(cp.sink) + ": the GPU keeps at most " + std::to_string(kMaxSink) +
           " exact sink positions");
  if (cp.certify) refuse("certified attention is CPU only");
  if (cp.attn_softcap > 0.0f) refuse("attention logit soft-capping is not supported on the GPU yet");
  paged_kv_format f;
  f.format = fmt;
  f.head_dim = hp.head_dim;
  f.n_kv_head = hp.n_kv_head;
  f.page_size = 16;
  f.rotation = rot;
  paged_kv_geometry_of(f);  // head_dim, n_kv_head (unsupported names the value and the supported list)
  if (hp.n_head % hp.n_kv_head != 0 || hp.n_head / hp.n_kv_head > 8)
    refuse("n_head " + std::to_string(hp.n_head) + " / n_kv_head " + std::to_string(hp.n_kv_head) +
           ": the decode kernel takes whole GQA groups of at most 8 query heads");
  return f;
}

runner_state_layout runner_layout(const model_hparams& hp, const kv_cache_params& cp, int max_batch) {
  const paged_kv_format f = runner_kv_format(hp, cp, max_batch);
  const bool compressed = f.format != kv_format::f16;
  const bool kivi = f.format == kv_format::kivi4;
  runner_state_layout l;
  l.cal_n = compressed && !kivi && cp.k_channel_scale.value_or(true) ? std::min(cp.channel_calib, cp.n_ctx) : 0;
  l.sink = compressed ? cp.sink : 0;  // (runner_kv_format refuses windows on an f16 cache)
  const size_t rows = (size_t)hp.n_layer * cp.n_seq * hp.n_kv_head * hp.head_dim;  // one position of every sequence
  if (kivi) {
    l.kv_min_tail = std::max(cp.exact_recent, cp.kivi_residual - 32 + 1);
    // a step of one sequence adds at most kv_chunk rows to its residual of < min_tail + 32
    l.kv_chunk = std::min(max_batch, 1024 - l.sink - (l.kv_min_tail + 31));
    l.kv_cap = l.sink + l.kv_min_tail + 31 + l.kv_chunk;
    KVQ_ASSERT(l.kv_chunk >= 1 && l.kv_cap <= 1024);  // runner_kivi_format bounds sink and the residual
    l.fixed_bytes = 2 * rows * l.kv_cap * sizeof(uint16_t);  // K and V exact rows, f16
  } else {
    if (l.cal_n > 0) l.fixed_bytes += (2 * (size_t)l.cal_n + 2) * rows * sizeof(float);  // staged K, V; mu, lambda
    if (l.sink > 0) l.fixed_bytes += 2 * rows * l.sink * sizeof(uint16_t);                // sink K, V, f16
  }
  return l;
}

size_t runner_fixed_kv_bytes(const model_hparams& hp, const kv_cache_params& cp, int max_batch) {
  return runner_layout(hp, cp, max_batch).fixed_bytes;
}

size_t runner_page_bytes(const model_hparams& hp, const kv_cache_params& cp) {
  return (size_t)hp.n_layer * paged_kv_geometry_of(runner_kv_format(hp, cp, 1)).page_bytes;
}

void check_supported(const model& m, const kv_cache_params& cp, int max_batch) {
  runner_kv_format(m.hparams(), cp, max_batch);
}
void check_supported(const model_hparams& hp, const kv_cache_params& cp, int max_batch) {
  runner_kv_format(hp, cp, max_batch);
}

}  // namespace cuda
}  // namespace kvq
