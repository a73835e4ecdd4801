// Built when KVQ_BUILD_CUDA is OFF: the CUDA backend reports "not supported" (MLX's no_gpu).
#include "kvq/cuda.h"

#include "kvq/error.h"

namespace kvq::cuda {

namespace {
[[noreturn]] void no_cuda() { fail_unsupported("[cuda] not supported: kvq was built without KVQ_BUILD_CUDA"); }
}  // namespace

bool available() { return false; }
std::string device_name() { return "none (kvq built without CUDA)"; }
void require() { no_cuda(); }

void* device_alloc(size_t) { no_cuda(); }
void device_free(void* p) {
  if (p) no_cuda();
}
void copy_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_to_host(void*, const void*, size_t) { no_cuda(); }
void device_fill(void*, uint8_t, size_t) { no_cuda(); }
void synchronize() { no_cuda(); }
void memory_info(size_t*, size_t*) { no_cuda(); }
double copy_bandwidth(size_t, int) { no_cuda(); }

void append_paged(const paged_kv_view&, const void*, const void*, kv_elem, const int64_t*, int, void*,
                  const exact_rows_out*) {
  no_cuda();
}
void channel_stats(const float*, int, int, int, float*, float*, void*) { no_cuda(); }
void append_kivi(const paged_kv_view&, const void*, const void*, kv_elem, const int64_t*, int, const exact_rows_out&,
                 void*) {
  no_cuda();
}
void quantize_kivi_groups(const paged_kv_view&, const uint16_t*, int, const int64_t*, const int64_t*, int, void*) {
  no_cuda();
}
void move_exact_rows(uint16_t*, uint16_t*, int, int, int, const int32_t*, int, void*) { no_cuda(); }
void dequantize_paged(const paged_kv_view&, const paged_kv_view&, int, void*) { no_cuda(); }

struct decode_plan::impl {};
decode_plan::decode_plan(const paged_kv_format&, const decode_params&, const int32_t*, const int32_t*, int, int) {
  no_cuda();
}
decode_plan::~decode_plan() = default;
bool decode_plan::update(const int32_t*, const int32_t*, void*) { no_cuda(); }
void decode_plan::run(const paged_kv_view&, const void*, void*, const exact_window_view*, void*) const { no_cuda(); }
int decode_plan::n_items() const { return 0; }
int decode_plan::split_tokens() const { return 0; }
size_t decode_plan::workspace_bytes() const { return 0; }

struct prefill_plan::impl {};
prefill_plan::prefill_plan(const paged_kv_format&, const prefill_params&, const int32_t*, const int32_t*,
                           const int32_t*, int, int) {
  no_cuda();
}
prefill_plan::~prefill_plan() = default;
bool prefill_plan::update(const int32_t*, const int32_t*, const int32_t*, void*) { no_cuda(); }
void prefill_plan::run(const paged_kv_view&, const void*, void*, const exact_window_view*, void*) const { no_cuda(); }
int prefill_plan::n_tiles() const { return 0; }
int prefill_plan::n_items() const { return 0; }
size_t prefill_plan::workspace_bytes() const { return 0; }

}  // namespace kvq::cuda
