// Built when KVQ_BUILD_CUDA is OFF: the GPU model path reports "not supported" (kvq/cuda.h's stub).
#include "kvq/cuda.h"
#include "kvq/cuda_model.h"

namespace kvq::cuda {

struct model_runner::impl {};

model_runner::model_runner(const model&, const kv_cache_params&, int) { require(); }  // throws unsupported
model_runner::model_runner(const model_hparams&, const kv_cache_params&, int, uint64_t) { require(); }
model_runner::~model_runner() = default;
int model_runner::forward(std::span<const int32_t>, int, std::span<const uint8_t>, float*, int) {
  require();
  return 0;
}
void model_runner::decode(std::span<const int32_t>, std::span<const int32_t>, float*, int32_t*) { require(); }
int model_runner::step(std::span<const int32_t>, std::span<const int32_t>, int, std::span<const uint8_t>, float*,
                       int32_t*) {
  require();
  return 0;
}
void model_runner::fill_synthetic(int, int, uint64_t) { require(); }
void model_runner::set_cuda_graphs(bool) {}
bool model_runner::cuda_graphs() const { return false; }
int model_runner::graph_instantiations() const { return 0; }
int model_runner::graph_captures() const { return 0; }
void model_runner::set_step_profile(bool) {}
model_runner::step_profile model_runner::last_step_profile() const { return {}; }
void model_runner::set_tiled_prefill(bool) {}
void model_runner::set_kivi_query_tiles(bool) {}
void model_runner::set_batch_invariant(bool) {}
bool model_runner::batch_invariant() const { return false; }
bool model_runner::tiled_prefill() const { return false; }
int model_runner::tiled_prefills() const { return 0; }
void model_runner::clear() {}
void model_runner::clear_seq(int) {}
int model_runner::n_pos(int) const { return 0; }
int model_runner::n_ctx() const { return 0; }
int model_runner::n_seq() const { return 0; }
int model_runner::max_batch() const { return 0; }
std::string model_runner::describe() const { return "none (kvq built without CUDA)"; }
size_t model_runner::kv_bytes() const { return 0; }
size_t model_runner::kv_bytes_used() const { return 0; }
size_t model_runner::kv_bytes_per_page() const { return 0; }
kv_page_info model_runner::page_info() const { return {}; }
size_t model_runner::weight_bytes() const { return 0; }

}  // namespace kvq::cuda
