// cuda::model_runner (include/kvq/cuda_model.h): weights uploaded once in f16, the forward as
// cuBLAS products + the kernels of model_kernels.cu + kvq/cuda.h's paged append and decode.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvq/cuda.h"
#include "kvq/cuda_model.h"
#include "kvq/error.h"
#include "kvq/f16.h"
#include "model/arch.h"
#include "model_cuda/model_kernels.h"
#include "model_cuda/runner_format.h"

namespace kvq::cuda {

namespace {

void check_cuda(cudaError_t e, const char* op) {
  if (e != cudaSuccess) fail(errc::internal, std::string("[cuda model] ") + op + ": " + cudaGetErrorString(e));
}
void check_blas(cublasStatus_t s, const char* op) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(errc::internal, std::string("[cuda model] ") + op + ": cuBLAS status " + std::to_string((int)s));
}

}  // namespace

struct model_runner::impl {
  const model* m = nullptr;
  model_hparams hp;
  paged_kv_format fmt;
  paged_kv_geometry geo;
  bool compressed = false;
  int n_ctx = 0, max_batch = 0, n_pos = 0, n_pages = 0;
  int64_t dq = 0, dkv = 0, dqkv = 0;
  cublasHandle_t blas = nullptr;
  std::vector<void*> allocs;
  size_t weight_bytes = 0, kv_bytes = 0;

  struct layer_w {
    uint16_t *wqkv = nullptr, *wo = nullptr, *wgu = nullptr, *wdown = nullptr;  // f16 [n_out][n_in]
    float *attn_norm = nullptr, *ffn_norm = nullptr, *bqkv = nullptr;           // f32
  };
  std::vector<layer_w> layers;
  uint16_t *emb = nullptr, *w_out = nullptr;  // [n_vocab][n_embd] f16 (w_out == emb when tied)
  float *out_norm = nullptr, *inv_freq = nullptr;
  int n_rot = 0;
  bool neox = false;
  uint8_t* pool = nullptr;  // [n_layer][n_pages][page_bytes]

  // per-forward device buffers, sized for max_batch
  int32_t *tokens = nullptr, *rows = nullptr, *indptr = nullptr, *indices = nullptr, *last = nullptr;
  int64_t* slots = nullptr;
  float *x = nullptr, *o = nullptr, *qkv = nullptr, *gu = nullptr, *logits = nullptr;
  uint16_t *h = nullptr, *q16 = nullptr, *k16 = nullptr, *v16 = nullptr, *attn16 = nullptr, *act = nullptr;

  // host staging
  std::vector<int32_t> h_indptr, h_indices, h_last, h_rows;
  std::vector<int64_t> h_slots;

  ~impl() {
    if (blas) cublasDestroy(blas);
    for (void* p : allocs) cudaFree(p);
  }

  template <class T>
  T* alloc(size_t n, size_t* counter = nullptr) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T))), "cudaMalloc");
    allocs.push_back(p);
    if (counter) *counter += n * sizeof(T);
    return static_cast<T*>(p);
  }

  float* upload_f32(const std::vector<float>& v) {
    float* d = alloc<float>(v.size(), &weight_bytes);
    check_cuda(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy weights");
    return d;
  }

  // The rows of the given weights, concatenated ([sum n_out][n_in]), dequantized to f32 by the CPU
  // dequantizers and rounded to f16. A value outside the f16 range is refused (no silent inf).
  uint16_t* upload_f16(std::initializer_list<const weight_view*> parts) {
    const int64_t n_in = (*parts.begin())->n_in;
    int64_t n_rows = 0;
    for (const weight_view* w : parts) n_rows += w->n_out;
    std::vector<uint16_t> buf((size_t)(n_rows * n_in));
    std::vector<float> row((size_t)n_in);
    int64_t r0 = 0;
    for (const weight_view* w : parts) {
      KVQ_ASSERT(w->n_in == n_in);
      for (int64_t r = 0; r < w->n_out; ++r) {
        weight_row_to_f32(*w, r, row.data());
        uint16_t* dst = &buf[(size_t)((r0 + r) * n_in)];
        for (int64_t i = 0; i < n_in; ++i) {
          dst[i] = f32_to_f16(row[i]);
          if (!std::isfinite(f16_to_f32(dst[i])))
            fail_unsupported("[cuda model] weight '" + w->name + "' row " + std::to_string(r) + " holds " +
                             std::to_string(row[i]) + ", outside the f16 range of the GPU weights");
        }
      }
      r0 += w->n_out;
    }
    uint16_t* d = alloc<uint16_t>(buf.size(), &weight_bytes);
    check_cuda(cudaMemcpy(d, buf.data(), buf.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy weights");
    return d;
  }

  // y [n][n_out] f32 = x [n][n_in] f16 . W^T, W [n_out][n_in] f16 (column-major: W is n_in x n_out).
  void gemm(const uint16_t* w, int64_t n_out, int64_t n_in, const uint16_t* xin, int n, float* y) {
    const float alpha = 1.0f, beta = 0.0f;
    check_blas(
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n_out, n, (int)n_in, &alpha, w, CUDA_R_16F, (int)n_in, xin,
                     CUDA_R_16F, (int)n_in, &beta, y, CUDA_R_32F, (int)n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }
};

model_runner::model_runner(const model& m, const kv_cache_params& cp, int max_batch) : p_(std::make_unique<impl>()) {
  impl& s = *p_;
  s.fmt = runner_kv_format(m, cp, max_batch);
  require();
  s.m = &m;
  s.hp = m.hparams();
  const model_hparams& hp = s.hp;
  s.geo = paged_kv_geometry_of(s.fmt);
  s.compressed = s.fmt.format != kv_format::f16;
  s.n_ctx = cp.n_ctx;
  s.max_batch = max_batch;
  s.n_pages = (cp.n_ctx + s.fmt.page_size - 1) / s.fmt.page_size;
  s.dq = (int64_t)hp.n_head * hp.head_dim;
  s.dkv = (int64_t)hp.n_kv_head * hp.head_dim;
  s.dqkv = s.dq + 2 * s.dkv;
  check_blas(cublasCreate(&s.blas), "cublasCreate");

  // weights (the tensors the CPU graph reads, src/model/arch/llama.cpp)
  const gguf_file& f = m.gguf();
  model_hparams hq = hp;
  const load::io_weights io = load::io(f, hq);
  const int64_t E = hp.n_embd, F = hp.n_ff;
  s.emb = s.upload_f16({&io.tok_embd});
  s.w_out = hq.tied_output ? s.emb : s.upload_f16({&io.output});
  s.out_norm = s.upload_f32(io.output_norm);
  const build::rope_table rope = build::make_rope(hp, hp.layers[0], load::rope_factors(f, hp));
  s.n_rot = rope.n_rot;
  s.neox = rope.neox;
  s.inv_freq = s.upload_f32(rope.inv_freq);
  s.layers.resize(hp.n_layer);
  for (int il = 0; il < hp.n_layer; ++il) {
    impl::layer_w& L = s.layers[il];
    const std::string b = "blk." + std::to_string(il) + ".";
    const weight_view wq = load::matrix(f, b + "attn_q.weight", E, s.dq),
                      wk = load::matrix(f, b + "attn_k.weight", E, s.dkv),
                      wv = load::matrix(f, b + "attn_v.weight", E, s.dkv);
    const weight_view wo = load::matrix(f, b + "attn_output.weight", s.dq, E);
    const weight_view wg = load::matrix(f, b + "ffn_gate.weight", E, F),
                      wu = load::matrix(f, b + "ffn_up.weight", E, F);
    const weight_view wd = load::matrix(f, b + "ffn_down.weight", F, E);
    L.wqkv = s.upload_f16({&wq, &wk, &wv});
    L.wo = s.upload_f16({&wo});
    L.wgu = s.upload_f16({&wg, &wu});
    L.wdown = s.upload_f16({&wd});
    L.attn_norm = s.upload_f32(load::vector_f32(f, b + "attn_norm.weight", E));
    L.ffn_norm = s.upload_f32(load::vector_f32(f, b + "ffn_norm.weight", E));
    if (hp.qkv_bias) {
      std::vector<float> bias = load::vector_f32(f, b + "attn_q.bias", s.dq);
      for (const char* nm : {"attn_k.bias", "attn_v.bias"}) {
        const std::vector<float> p = load::vector_f32(f, b + nm, s.dkv);
        bias.insert(bias.end(), p.begin(), p.end());
      }
      L.bqkv = s.upload_f32(bias);
    }
  }

  // the paged cache: page p of layer il holds positions [16p, 16p + 16) of the one sequence
  s.pool = s.alloc<uint8_t>((size_t)hp.n_layer * s.n_pages * s.geo.page_bytes, &s.kv_bytes);
  check_cuda(cudaMemset(s.pool, 0, s.kv_bytes), "cudaMemset pool");

  const int B = max_batch;
  s.tokens = s.alloc<int32_t>(B);
  s.rows = s.alloc<int32_t>(B);
  s.indptr = s.alloc<int32_t>(B + 1);
  s.indices = s.alloc<int32_t>((size_t)B * s.n_pages);
  s.last = s.alloc<int32_t>(B);
  s.slots = s.alloc<int64_t>(B);
  s.x = s.alloc<float>((size_t)B * E);
  s.o = s.alloc<float>((size_t)B * E);
  s.qkv = s.alloc<float>((size_t)B * s.dqkv);
  s.gu = s.alloc<float>((size_t)B * 2 * F);
  s.logits = s.alloc<float>((size_t)B * hp.n_vocab);
  s.h = s.alloc<uint16_t>((size_t)B * E);
  s.q16 = s.alloc<uint16_t>((size_t)B * s.dq);
  s.attn16 = s.alloc<uint16_t>((size_t)B * s.dq);
  s.k16 = s.alloc<uint16_t>((size_t)B * s.dkv);
  s.v16 = s.alloc<uint16_t>((size_t)B * s.dkv);
  s.act = s.alloc<uint16_t>((size_t)B * F);
}

model_runner::~model_runner() = default;

int model_runner::forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output, float* logits) {
  impl& s = *p_;
  const model_hparams& hp = s.hp;
  const int n = (int)tokens.size();
  // ---- validate (nothing appended on error) ----
  if (n == 0) fail_input("[cuda model] forward called with no tokens");
  if (n > s.max_batch)
    fail_input("[cuda model] batch of " + std::to_string(n) + " tokens exceeds the runner's max_batch " +
               std::to_string(s.max_batch));
  if (!output.empty() && (int)output.size() != n)
    fail_input("[cuda model] output flags: " + std::to_string(output.size()) + " for " + std::to_string(n) +
               " tokens (one per token, or empty)");
  for (int t = 0; t < n; ++t)
    if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
      fail_input("[cuda model] token id " + std::to_string(tokens[t]) + " at batch index " + std::to_string(t) +
                 " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
  if (pos0 != s.n_pos)
    fail_input("[cuda model] cache holds " + std::to_string(s.n_pos) + " positions but the batch starts at position " +
               std::to_string(pos0));
  if ((int64_t)pos0 + n > s.n_ctx)
    fail_input("[cuda model] the sequence would hold " + std::to_string((int64_t)pos0 + n) +
               " positions, more than n_ctx " + std::to_string(s.n_ctx));

  // ---- host-side tables ----
  s.h_rows.clear();
  for (int t = 0; t < n; ++t)
    if (output.empty() ? t == n - 1 : output[t] != 0) s.h_rows.push_back(t);
  const int n_out = (int)s.h_rows.size();
  const int P = s.fmt.page_size;
  s.h_indptr.assign(n + 1, 0);
  s.h_last.assign(n, 0);
  s.h_indices.clear();
  for (int b = 0; b < n; ++b) {
    // query b attends positions [0, pos0 + b] through their pages (all of them compressed, as
    // the CPU cache without an exact tail: kv_cache_quant's comp_rule with min_tail 0)
    const int len = pos0 + b + 1;
    const int np = (len + P - 1) / P;
    for (int p = 0; p < np; ++p) s.h_indices.push_back(p);
    s.h_indptr[b + 1] = (int32_t)s.h_indices.size();
    s.h_last[b] = np > 0 ? len - (np - 1) * P : 0;
  }
  s.h_slots.resize(n);
  for (int t = 0; t < n; ++t) s.h_slots[t] = (int64_t)pos0 + t;
  auto up = [](void* d, const void* h, size_t bytes) {
    if (bytes) check_cuda(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy tables");
  };
  up(s.tokens, tokens.data(), n * sizeof(int32_t));
  up(s.rows, s.h_rows.data(), n_out * sizeof(int32_t));
  up(s.indptr, s.h_indptr.data(), (n + 1) * sizeof(int32_t));
  up(s.indices, s.h_indices.data(), s.h_indices.size() * sizeof(int32_t));
  up(s.last, s.h_last.data(), n * sizeof(int32_t));
  up(s.slots, s.h_slots.data(), n * sizeof(int64_t));

  decode_params dp;
  dp.n_head = hp.n_head;
  dp.spec = attn_spec{hp.attn_scale};
  dp.q_elem = kv_elem::f16;
  dp.out_elem = kv_elem::f16;
  const decode_plan plan(s.fmt, dp, s.h_indptr.data(), s.h_last.data(), n);

  // ---- the graph (src/model/arch/llama.cpp) ----
  const int64_t E = hp.n_embd, F = hp.n_ff;
  mk::embed(s.tokens, s.emb, n, (int)E, s.x, nullptr);
  for (int il = 0; il < hp.n_layer; ++il) {
    const impl::layer_w& L = s.layers[il];
    mk::add_rmsnorm(s.x, il == 0 ? nullptr : s.o, L.attn_norm, nullptr, n, (int)E, hp.rms_eps, s.h, nullptr);
    s.gemm(L.wqkv, s.dqkv, E, s.h, n, s.qkv);
    mk::qkv_rope(s.qkv, L.bqkv, s.inv_freq, s.n_rot, s.neox, pos0, n, hp.n_head, hp.n_kv_head, hp.head_dim, s.q16,
                 s.k16, s.v16, nullptr);
    paged_kv_view kv;
    kv.format = s.fmt;
    kv.pool = s.pool + (size_t)il * s.n_pages * s.geo.page_bytes;
    kv.n_pages = s.n_pages;
    kv.indptr = s.indptr;
    kv.indices = s.indices;
    kv.last_page_len = s.last;
    kv.batch = n;
    append_paged(kv, s.k16, s.v16, kv_elem::f16, s.slots, n, nullptr);
    plan.run(kv, s.q16, s.attn16, nullptr, nullptr);
    s.gemm(L.wo, E, s.dq, s.attn16, n, s.o);
    mk::add_rmsnorm(s.x, s.o, L.ffn_norm, nullptr, n, (int)E, hp.rms_eps, s.h, nullptr);
    s.gemm(L.wgu, 2 * F, E, s.h, n, s.gu);
    mk::swiglu(s.gu, n, (int)F, s.act, nullptr);
    s.gemm(L.wdown, E, F, s.act, n, s.o);
  }
  // x += the last FFN output and the final norm, for the output rows only
  mk::add_rmsnorm(s.x, s.o, s.out_norm, s.rows, n_out, (int)E, hp.rms_eps, s.h, nullptr);
  if (n_out > 0) s.gemm(s.w_out, hp.n_vocab, E, s.h, n_out, s.logits);
  const size_t n_logits = (size_t)n_out * hp.n_vocab;
  check_cuda(cudaMemcpy(logits, s.logits, n_logits * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy logits");
  s.n_pos = pos0 + n;
  for (size_t i = 0; i < n_logits; ++i)
    if (!std::isfinite(logits[i]))
      fail_input("[cuda model] non-finite logits (NaN/Inf) for the batch at positions " + std::to_string(pos0) + ".." +
                 std::to_string(pos0 + n - 1) + " (f16 overflow of an activation?)");
  return n_out;
}

void model_runner::clear() { p_->n_pos = 0; }
int model_runner::n_pos() const { return p_->n_pos; }
int model_runner::n_ctx() const { return p_->n_ctx; }
int model_runner::max_batch() const { return p_->max_batch; }
size_t model_runner::kv_bytes() const { return p_->kv_bytes; }
size_t model_runner::weight_bytes() const { return p_->weight_bytes; }
size_t model_runner::kv_bytes_used() const {
  const impl& s = *p_;
  return (size_t)s.hp.n_layer * ((s.n_pos + s.fmt.page_size - 1) / s.fmt.page_size) * s.geo.page_bytes;
}

std::string model_runner::describe() const {
  const impl& s = *p_;
  std::string d = std::string(kv_traits(s.fmt.format).name) + "/" + kv_traits(s.fmt.format).name;
  if (s.compressed) d += std::string(" (") + rotation_name(s.fmt.rotation) + ", g" + std::to_string(s.geo.group) + ")";
  return d + ", " + std::to_string(s.fmt.page_size) + "-token pages, on " + device_name();
}

}  // namespace kvq::cuda
