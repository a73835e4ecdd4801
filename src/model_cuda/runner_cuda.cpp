// cuda::model_runner (include/kvq/cuda_model.h): weights uploaded once in f16, the forward as
// cuBLAS products + the kernels of model_kernels.cu + kvq/cuda.h's paged append and decode.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
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
  model_hparams hp;
  paged_kv_format fmt;
  paged_kv_geometry geo;
  bool compressed = false;
  int n_ctx = 0, n_seq = 0, max_batch = 0, n_pages = 0, pages_per_seq = 0;
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

  // sequences: seq_pages[s][j] = the page holding positions [16j, 16j + 16) of sequence s (in every
  // layer); free_pages: the pool's unused page ids (a stack)
  std::vector<std::vector<int32_t>> seq_pages;
  std::vector<int> seq_pos;
  std::vector<int32_t> free_pages;

  // K channel scale (kv_cache_params::k_channel_scale, on by default for q8 / q4 K; docs/cuda.md "K
  // channel scale"), as kv_cache_quant: a sequence's first cal_n positions are kept as given (f32
  // staging rows) and attended exactly until the forward that brings position cal_n - 1, which
  // calibrates mu / lambda of every layer on positions [cal_skip, cal_n) (channel_stats) and stores
  // the staged rows in the pages; later K is stored as R((k - mu) / lambda), queries as R(q lambda).
  int cal_n = 0, cal_skip = 0;  // cal_n = min(channel_calib, n_ctx), 0 without the channel scale
  float* stage = nullptr;       // [n_layer][2 (K, V)][n_seq][cal_n][dkv] f32
  float *k_mu = nullptr, *k_lam = nullptr;  // [n_layer][n_seq][dkv] f32
  float *k32 = nullptr, *v32 = nullptr;     // [max_batch][dkv] f32: the forward's K / V before f16 rounding
  int32_t* tok_seq = nullptr;               // [max_batch] the sequence of each token (its stats row)
  int32_t* cal_rows = nullptr;              // [n_seq * cal_n] the calibrated sequences' ...
  int64_t* cal_slots = nullptr;             // ... staged rows: stats row and page slot
  std::vector<int32_t> h_cross, h_cal_rows;  // sequences this step calibrates
  std::vector<int64_t> h_cal_slots;
  // Exact sink (kv_cache_params::sink; docs/formats.md "Exact windows"), as kv_cache_quant keeps it:
  // positions [0, sink) of every sequence also stay exact, as the f16-rounded transformed rows the
  // append quantizes (append_paged's exact_rows_out; for staged positions at calibration), and every
  // query attends them in f16 beside the pages' body [sink, pos] (decode_params / prefill_params::
  // body_lo). The pages still hold them quantized (unread).
  int sink = 0;
  uint16_t *sink_k = nullptr, *sink_v = nullptr;  // [n_layer][n_seq][n_kv_head][sink][head_dim] f16
  int32_t* ex_len = nullptr;                      // [max_batch] exact rows each attention entry sees
  int64_t* ex_slots = nullptr;                    // [max_batch] the step's tokens' sink rows (seq * sink + pos, or -1)
  int64_t* cal_ex_slots = nullptr;                // [n_seq * cal_n] the calibrated sequences' staged rows' sink rows
  std::vector<int32_t> h_ex_len;
  std::vector<int64_t> h_ex_slots, h_cal_ex_slots;
  int64_t* fill_ex_slots = nullptr;  // fill_synthetic's [kFillChunk]
  // The sink row of position pos of sequence seq in a layer's [n_seq][sink] rows, or -1 past the sink.
  int64_t sink_slot(int seq, int pos) const { return pos < sink ? (int64_t)seq * sink + pos : -1; }
  exact_rows_out sink_out(int il, const int64_t* slots_d) const {
    exact_rows_out e;
    e.k = sink_k + (size_t)il * n_seq * dkv * sink;
    e.v = sink_v + (size_t)il * n_seq * dkv * sink;
    e.slots = slots_d;
    e.cap = sink;
    return e;
  }
  // A part of a step's attention (run()): query rows [row0, row0 + rows) through one plan whose
  // page-table entries start at indptr[ptr0], indices[ind0] and last / ex_len[ent0]; per token (one
  // entry a row) or tiled (one entry: the rows are a prompt chunk of one sequence).
  struct attn_part {
    int row0 = 0, rows = 0, entries = 0, ptr0 = 0, ind0 = 0, ent0 = 0;
    bool tiled = false;
    bool paged = false;  // a query at or past the K channel scale's window (or none): a plan; else
                         // every query is staged and staged_attention writes the part's rows
    const decode_plan* dplan = nullptr;
    const prefill_plan* pplan = nullptr;
  };
  attn_part parts[2];
  int n_parts = 0;
  int n_dec = 0;  // model_runner::step: the batch's leading decode rows (their own part); 0 otherwise
  exact_window_view sink_view(int il, const attn_part& a) const {
    exact_window_view w;
    w.k = sink_k + (size_t)il * n_seq * dkv * sink;
    w.v = sink_v + (size_t)il * n_seq * dkv * sink;
    w.len = ex_len + a.ent0;
    w.cap = sink;
    w.slot = tok_seq + a.row0;  // entry t: token t's sequence (decode_plan), entry 0: the chunk's (prefill_plan)
    return w;
  }
  float* stage_k(int il) const { return stage + (size_t)il * 2 * n_seq * cal_n * dkv; }
  float* stage_v(int il) const { return stage_k(il) + (size_t)n_seq * cal_n * dkv; }

  // KIVI (-ctk kivi4 -ctv q4a / kivi4; docs/cuda.md "KIVI"), as kv_cache_quant keeps it: positions
  // [0, sink) exact; body rows r = pos - sink compressed in whole groups of 32 (n_comp = 32 floor((n -
  // sink - min_tail) / 32), min_tail = max(exact_recent, kivi_residual - 31)); the rest exact. The
  // pages hold body rows (row r at page seq_pages[s][r / 32], row r % 32: V's q4a codes from the
  // append on, K's codes once its group is quantized); the exact slot of (layer, sequence) holds the
  // sink in rows [0, sink) and body rows from kv_base[s] (a group boundary) on in rows sink + r -
  // kv_base[s]. A query at position p sees the pages' rows [0, n_comp(p + 1)) and the exact rows of
  // the sink and of body rows [n_comp(p + 1), p - sink] (exact_window_view's gap skips the others),
  // so a prompt chunk's queries keep their own exact residual, as the CPU cache's attend does. After
  // each step the residual's rows move down to row sink (move_exact_rows) and kv_base advances.
  bool kivi = false;
  int kv_min_tail = 0, kv_cap = 0, kv_chunk = 0;  // exact rows per slot; tokens per step of a sequence
  std::vector<int> kv_base;                       // [n_seq] body row of exact row `sink`
  uint16_t *kx_k = nullptr, *kx_v = nullptr;      // [n_layer][n_seq][n_kv_head][kv_cap][head_dim] f16
  int32_t *kx_glo = nullptr, *kx_ghi = nullptr, *kx_moves = nullptr;  // [B], [B], [B][4]
  int64_t *kx_src = nullptr, *kx_dst = nullptr;                       // [kv_groups_max] groups quantized this step
  int kv_groups_max = 0;
  std::vector<int32_t> h_glo, h_ghi, h_moves;
  std::vector<int64_t> h_src, h_dst;
  std::vector<std::pair<int, int>> h_new_base;  // (sequence, kv_base after the step)
  int kivi_comp(int n) const { return std::max(0, n - sink - kv_min_tail) / 32 * 32; }
  uint16_t* kx_layer(uint16_t* b, int il) const { return b + (size_t)il * n_seq * dkv * kv_cap; }

  // per-forward device buffers, sized for max_batch
  int32_t *tokens = nullptr, *pos = nullptr, *rows = nullptr, *indptr = nullptr, *indices = nullptr, *last = nullptr,
          *argmax = nullptr;
  int64_t* slots = nullptr;
  float *x = nullptr, *o = nullptr, *qkv = nullptr, *gu = nullptr, *logits = nullptr;
  uint16_t *h = nullptr, *q16 = nullptr, *k16 = nullptr, *v16 = nullptr, *attn16 = nullptr, *act = nullptr;
  // fill_synthetic's buffers, allocated on first use: K/V [kFillChunk][n_kv_head][head_dim] f16, slots
  static constexpr int kFillChunk = 4096;
  uint16_t *fill_k = nullptr, *fill_v = nullptr;
  int64_t* fill_slots = nullptr;
  float *fill_k32 = nullptr, *fill_v32 = nullptr;  // with the channel scale: [kFillChunk][dkv] f32
  int32_t *fill_seq = nullptr, *fill_pos = nullptr;  // [kFillChunk]

  // host staging
  std::vector<int32_t> h_tok, h_seq, h_pos, h_indptr, h_indices, h_last, h_rows, h_argmax;
  std::vector<int64_t> h_slots;
  // the step's tables in pinned memory (asynchronous uploads on `stream`): [pin_bytes]
  uint8_t* pin = nullptr;
  size_t pin_bytes = 0;

  // all work of forward / decode / step runs on `stream`, but for a mixed step's prompt rows under a
  // CUDA graph (use_side, while capturing), whose products (own cuBLAS handle and workspace: the
  // same kernels) and attention run on `side` beside the decode rows' (fork / join through two
  // events: parallel branches of the graph). Run directly, a step is bound by the host's launches,
  // which a second stream only adds to (measured: docs/perf.md, "Where a GPU server step's time
  // goes, and mixed steps as CUDA graphs").
  cudaStream_t stream = nullptr, side = nullptr;
  bool use_side = false;
  cublasHandle_t blas_side = nullptr;
  cudaEvent_t ev_fork = nullptr, ev_join = nullptr;
  static constexpr size_t kBlasWs = size_t(32) << 20;
  // the side stream, its cuBLAS handle and workspace, made when a mixed step is first captured (the
  // runners that never capture one keep the memory)
  void init_side() {
    if (blas_side) return;
    check_blas(cublasCreate(&blas_side), "cublasCreate");
    check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
    check_blas(cublasSetStream(blas_side, side), "cublasSetStream");
    check_blas(cublasSetWorkspace(blas_side, alloc<uint8_t>(kBlasWs), kBlasWs), "cublasSetWorkspace");
    check_cuda(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&ev_join, cudaEventDisableTiming), "cudaEventCreate");
  }
  void fork() {
    check_cuda(cudaEventRecord(ev_fork, stream), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(side, ev_fork, 0), "cudaStreamWaitEvent");
  }
  void join() {
    check_cuda(cudaEventRecord(ev_join, side), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream, ev_join, 0), "cudaStreamWaitEvent");
  }
  // The attention plans of a step's parts (part i: d[i] with entries[i] entries, or p when tiled),
  // kept from one step to the next and updated in place where that gives a new plan's launch.
  struct plan_set {
    std::unique_ptr<decode_plan> d[2];
    int entries[2] = {0, 0};
    std::unique_ptr<prefill_plan> p;
  };
  plan_set direct_plans;  // those of the steps run directly
  // CUDA graphs (set_cuda_graphs) for decode() and step(): one per step shape (graph_key), its
  // plans with it (the graph reads their buffers); replayed after the plans are updated in place,
  // else the step is captured anew and applied by cudaGraphExecUpdate (instantiated when that is
  // refused). A shape's first step runs directly (capturing and instantiating cost more than
  // running it directly: a shape seen once is not worth it), its second is captured. At most
  // kGraphs shapes whose plans hold at most kGraphPlanBytes of device workspace (a decode plan of 16
  // sequences at 32K holds ~33 MB), the least recently used ones dropped.
  struct graph_key {
    int n = 0, n_dec = 0, n_out = 0, entries[2] = {0, 0};
    bool ids = false, staged = false, part_paged[2] = {false, false}, tiled[2] = {false, false};
    bool operator==(const graph_key&) const = default;
  };
  struct graph_entry {
    graph_key key;
    cudaGraphExec_t exec = nullptr;
    plan_set plans;
    uint64_t used = 0;
  };
  static constexpr size_t kGraphs = 64, kGraphPlanBytes = size_t(256) << 20;
  std::vector<std::unique_ptr<graph_entry>> graph_cache;
  uint64_t graph_clock = 0;
  bool graphs = false;
  // what this step's tokens need (run()): step_staged, a token below cal_n (staging rows and
  // staged_attention); step_paged, a token at or past cal_n (or no channel scale: the append into
  // the pages and the paged attention kernel), i.e. one of the parts is paged. Kernels with nothing
  // to do are not launched: below the window a q8 / q4 step launches what an f16 step does (issues
  // 16 / 19: each launch over nothing cost a step its launch and its pass over the batch's tables).
  bool step_staged = false, step_paged = true;
  int n_instantiated = 0, n_captured = 0;
  // set_step_profile: the last run()'s host phases and its span on the stream (two events)
  bool profile = false;
  cudaEvent_t pev[2] = {nullptr, nullptr};
  model_runner::step_profile prof;
  std::chrono::steady_clock::time_point t_in, t_launch;
  void prof_begin() {
    if (!profile) return;
    t_in = std::chrono::steady_clock::now();
    check_cuda(cudaEventRecord(pev[0], stream), "cudaEventRecord");
  }
  void prof_launch() {
    if (profile) t_launch = std::chrono::steady_clock::now();
  }
  void prof_launched() {
    if (!profile) return;
    const auto t = std::chrono::steady_clock::now();
    prof.prep_ms = std::chrono::duration<double, std::milli>(t_launch - t_in).count();
    prof.launch_ms = std::chrono::duration<double, std::milli>(t - t_launch).count();
    t_launch = t;
    check_cuda(cudaEventRecord(pev[1], stream), "cudaEventRecord");
  }
  void prof_end() {
    if (!profile) return;
    prof.finish_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_launch).count();
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, pev[0], pev[1]), "cudaEventElapsedTime");
    prof.gpu_ms = ms;
  }
  void* blas_ws = nullptr;
  // prompts of >= kTiledMin tokens attend through prefill_plan (set_tiled_prefill); shorter ones, and
  // every token when it is off, through decode_plan with one "sequence" per token
  static constexpr int kTiledMin = 64;
  static constexpr int kKiviTilesMin = 16;  // KIVI with set_kivi_query_tiles: forwards of >= 16 tokens in query tiles
  bool tiled_prefill = true;
  bool kivi_query_tiles = false;  // set_kivi_query_tiles
  int n_tiled = 0;
  // set_batch_invariant: split-KV items of this many tokens in every decode plan (0: the plan's
  // choice, which weighs the whole batch)
  static constexpr int kInvariantSplit = 256;
  int split_fixed = 0;

  ~impl() {
    for (auto& g : graph_cache)
      if (g->exec) cudaGraphExecDestroy(g->exec);
    graph_cache.clear();
    direct_plans = plan_set{};
    for (cudaEvent_t e : pev)
      if (e) cudaEventDestroy(e);
    if (blas) cublasDestroy(blas);
    if (blas_side) cublasDestroy(blas_side);
    if (stream) cudaStreamDestroy(stream);
    if (side) cudaStreamDestroy(side);
    for (cudaEvent_t e : {ev_fork, ev_join})
      if (e) cudaEventDestroy(e);
    if (pin) cudaFreeHost(pin);
    for (void* p : allocs) cudaFree(p);
  }

  template <class T>
  T* alloc(size_t n, size_t* counter = nullptr) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(1, n * sizeof(T)));
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t fr = 0, tot = 0;
      cudaMemGetInfo(&fr, &tot);
      fail(errc::invalid_input, "[cuda model] out of device memory: " + std::to_string(n * sizeof(T)) +
                                    " bytes asked, " + std::to_string(fr) + " of " + std::to_string(tot) + " free");
    }
    check_cuda(e, "cudaMalloc");
    allocs.push_back(p);
    if (counter) *counter += n * sizeof(T);
    return static_cast<T*>(p);
  }

  float* upload_f32(const std::vector<float>& v, bool is_weight = true) {
    float* d = alloc<float>(v.size(), is_weight ? &weight_bytes : nullptr);
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

  // Random weights on the device (the synthetic GGUF's distribution, src/runtime/synthetic_model.cpp).
  uint64_t seed = 0, n_drawn = 0;
  uint16_t* random_f16(int64_t n_out, int64_t n_in) {
    uint16_t* d = alloc<uint16_t>((size_t)(n_out * n_in), &weight_bytes);
    mk::fill_uniform_f16(d, n_out * n_in, std::sqrt(3.0f / (float)n_in), seed + (++n_drawn), nullptr);
    return d;
  }
  float* random_f32(int64_t n, float lo, float hi) {
    float* d = alloc<float>((size_t)n, &weight_bytes);
    mk::fill_uniform_f32(d, n, lo, hi, seed + (++n_drawn), nullptr);
    return d;
  }

  // y [n][n_out] f32 = x [n][n_in] f16 . W^T, W [n_out][n_in] f16 (column-major: W is n_in x n_out).
  void gemm(const uint16_t* w, int64_t n_out, int64_t n_in, const uint16_t* xin, int n, float* y,
            cublasHandle_t h = nullptr) {
    const float alpha = 1.0f, beta = 0.0f;
    check_blas(
        cublasGemmEx(h ? h : blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n_out, n, (int)n_in, &alpha, w, CUDA_R_16F, (int)n_in, xin,
                     CUDA_R_16F, (int)n_in, &beta, y, CUDA_R_32F, (int)n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

  // Everything but the weights: format, cache pool, sequences, activations.
  void init(const model_hparams& hp_in, const kv_cache_params& cp, int mb) {
    fmt = runner_kv_format(hp_in, cp, mb);
    require();
    hp = hp_in;
    geo = paged_kv_geometry_of(fmt);
    compressed = fmt.format != kv_format::f16;
    kivi = fmt.format == kv_format::kivi4;
    // (check_supported refuses the V channel scale; the K one is on unless turned off, as on the CPU;
    // KIVI takes none): the staging rows, sink and KIVI exact rows as runner_layout sizes them
    const runner_state_layout lay = runner_layout(hp_in, cp, mb);
    cal_n = lay.cal_n;
    cal_skip = std::min(std::max(1, cp.sink), cal_n - 1);  // position 0 and the exact sink left out
    sink = lay.sink;
    n_ctx = cp.n_ctx;
    n_seq = cp.n_seq;
    max_batch = mb;
    pages_per_seq = (cp.n_ctx + fmt.page_size - 1) / fmt.page_size;
    if (kivi) {
      kv_min_tail = lay.kv_min_tail;
      kv_chunk = lay.kv_chunk;
      kv_cap = lay.kv_cap;
      pages_per_seq = (std::max(0, cp.n_ctx - sink) + fmt.page_size - 1) / fmt.page_size;
      pages_per_seq = std::max(pages_per_seq, 1);
    }
    if ((int64_t)pages_per_seq * n_seq > INT32_MAX)
      fail_input("[cuda model] n_seq " + std::to_string(n_seq) + " x n_ctx " + std::to_string(n_ctx) +
                 " needs more than 2^31 pages");
    n_pages = pages_per_seq * n_seq;
    // a smaller pool shared by the sequences (a server's --kv-budget): appends that would need more
    // pages than are free are refused (forward / decode validate before appending)
    if (cp.n_pages < 0) fail_input("[cuda model] n_pages " + std::to_string(cp.n_pages) + " must be >= 0 (0: every sequence at n_ctx)");
    if (cp.n_pages > 0) n_pages = std::min(n_pages, cp.n_pages);
    dq = (int64_t)hp.n_head * hp.head_dim;
    dkv = (int64_t)hp.n_kv_head * hp.head_dim;
    dqkv = dq + 2 * dkv;
    check_blas(cublasCreate(&blas), "cublasCreate");
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_blas(cublasSetStream(blas, stream), "cublasSetStream");
    // a fixed cuBLAS workspace, so that a captured product allocates nothing (one per handle: the
    // side stream's products run beside the main stream's; the same size, so the same kernels)
    blas_ws = alloc<uint8_t>(kBlasWs);
    check_blas(cublasSetWorkspace(blas, blas_ws, kBlasWs), "cublasSetWorkspace");
    const build::rope_table rope = build::make_rope(hp, hp.layers[0], {});
    n_rot = rope.n_rot;
    neox = rope.neox;

    // the paged cache: page p of layer il holds 16 positions of one sequence (seq_pages)
    pool = alloc<uint8_t>((size_t)hp.n_layer * n_pages * geo.page_bytes, &kv_bytes);
    check_cuda(cudaMemset(pool, 0, kv_bytes), "cudaMemset pool");
    seq_pages.assign(n_seq, {});
    seq_pos.assign(n_seq, 0);
    free_pages.resize(n_pages);
    for (int p = 0; p < n_pages; ++p) free_pages[p] = n_pages - 1 - p;  // page 0 on top

    const int B = max_batch;
    const int64_t E = hp.n_embd, F = hp.n_ff;
    tokens = alloc<int32_t>(B);
    pos = alloc<int32_t>(B);
    rows = alloc<int32_t>(B);
    argmax = alloc<int32_t>(B);
    indptr = alloc<int32_t>(B + 2);  // a mixed step's two parts: B entries, 2 leading zeros
    indices = alloc<int32_t>((size_t)B * pages_per_seq);
    last = alloc<int32_t>(B);
    slots = alloc<int64_t>(B);
    x = alloc<float>((size_t)B * E);
    o = alloc<float>((size_t)B * E);
    qkv = alloc<float>((size_t)B * dqkv);
    gu = alloc<float>((size_t)B * 2 * F);
    logits = alloc<float>((size_t)B * hp.n_vocab);
    h = alloc<uint16_t>((size_t)B * E);
    q16 = alloc<uint16_t>((size_t)B * dq);
    attn16 = alloc<uint16_t>((size_t)B * dq);
    k16 = alloc<uint16_t>((size_t)B * dkv);
    v16 = alloc<uint16_t>((size_t)B * dkv);
    act = alloc<uint16_t>((size_t)B * F);
    layers.resize(hp.n_layer);
    if (cal_n > 0) {
      stage = alloc<float>((size_t)hp.n_layer * 2 * n_seq * cal_n * dkv, &kv_bytes);
      k_mu = alloc<float>((size_t)hp.n_layer * n_seq * dkv, &kv_bytes);
      k_lam = alloc<float>((size_t)hp.n_layer * n_seq * dkv, &kv_bytes);
      const std::vector<float> one((size_t)hp.n_layer * n_seq * dkv, 1.0f);  // (read only after calibration)
      check_cuda(cudaMemcpy(k_lam, one.data(), one.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy lambda");
      check_cuda(cudaMemset(k_mu, 0, one.size() * 4), "cudaMemset mu");
      k32 = alloc<float>((size_t)B * dkv);
      v32 = alloc<float>((size_t)B * dkv);
      cal_rows = alloc<int32_t>((size_t)n_seq * cal_n);
      cal_slots = alloc<int64_t>((size_t)n_seq * cal_n);
    }
    tok_seq = alloc<int32_t>(B);
    if (kivi) {
      const size_t n = (size_t)hp.n_layer * n_seq * dkv * kv_cap;
      kx_k = alloc<uint16_t>(n, &kv_bytes);
      kx_v = alloc<uint16_t>(n, &kv_bytes);
      check_cuda(cudaMemset(kx_k, 0, n * 2), "cudaMemset exact rows");
      check_cuda(cudaMemset(kx_v, 0, n * 2), "cudaMemset exact rows");
      kx_glo = alloc<int32_t>(B);
      kx_ghi = alloc<int32_t>(B);
      kx_moves = alloc<int32_t>((size_t)B * 4);
      kv_groups_max = B / 32 + 2 * B;  // per sequence of the step: its new rows / 32 + 1
      kx_src = alloc<int64_t>(kv_groups_max);
      kx_dst = alloc<int64_t>(kv_groups_max);
      ex_len = alloc<int32_t>(B);
      ex_slots = alloc<int64_t>(B);
      kv_base.assign(n_seq, 0);
    }
    if (sink > 0 && !kivi) {
      sink_k = alloc<uint16_t>((size_t)hp.n_layer * n_seq * dkv * sink, &kv_bytes);
      sink_v = alloc<uint16_t>((size_t)hp.n_layer * n_seq * dkv * sink, &kv_bytes);
      check_cuda(cudaMemset(sink_k, 0, (size_t)hp.n_layer * n_seq * dkv * sink * 2), "cudaMemset sink");
      check_cuda(cudaMemset(sink_v, 0, (size_t)hp.n_layer * n_seq * dkv * sink * 2), "cudaMemset sink");
      ex_len = alloc<int32_t>(B);
      ex_slots = alloc<int64_t>(B);
      if (cal_n > 0) cal_ex_slots = alloc<int64_t>((size_t)n_seq * cal_n);
    }
    // the server sizes its pool from a --kv-budget with runner_layout's fixed bytes: they must be these
    KVQ_ASSERT(kv_bytes == (size_t)hp.n_layer * n_pages * geo.page_bytes + lay.fixed_bytes);
    // tokens, pos, rows, last, tok_seq, ex_len [B] + indptr [B + 2] int32; slots, ex_slots [B] int64;
    // indices [B * pages_per_seq]; the calibrated sequences' rows, slots and sink slots [n_seq * cal_n]
    pin_bytes =
        (size_t)(7 * B + 2) * 4 + (size_t)B * 16 + (size_t)B * pages_per_seq * 4 + (size_t)n_seq * cal_n * 20 + 160;
    if (kivi) pin_bytes += (size_t)B * 24 + (size_t)kv_groups_max * 16 + 64;  // gaps, moves, groups
    check_cuda(cudaMallocHost(&pin, pin_bytes), "cudaMallocHost");
  }

  paged_kv_view layer_view(int il, int batch) const {
    paged_kv_view kv;
    kv.format = fmt;
    kv.pool = pool + (size_t)il * n_pages * geo.page_bytes;
    kv.n_pages = n_pages;
    kv.indptr = indptr;
    kv.indices = indices;
    kv.last_page_len = last;
    kv.batch = batch;
    return kv;
  }
  paged_kv_view layer_view(int il, const attn_part& a) const {
    paged_kv_view kv = layer_view(il, a.entries);
    kv.indptr = indptr + a.ptr0;
    kv.indices = indices + a.ind0;
    kv.last_page_len = last + a.ent0;
    return kv;
  }

  // The page of position p of sequence sq, taken from the free list when p opens a new page.
  int32_t page_for(int sq, int p) {
    std::vector<int32_t>& pg = seq_pages[sq];
    const size_t j = (size_t)(p / fmt.page_size);
    while (pg.size() <= j) {
      KVQ_ASSERT(!free_pages.empty());  // check_pages ran before (forward, decode, fill_synthetic)
      pg.push_back(free_pages.back());
      free_pages.pop_back();
    }
    return pg[j];
  }

  // Pages sequence sq needs beyond those it holds to store positions up to end (exclusive).
  int pages_needed(int sq, int64_t end) const {
    if (kivi) end = std::max<int64_t>(0, end - sink);  // the pages hold body rows
    return std::max<int>(0, (int)((end + fmt.page_size - 1) / fmt.page_size) - (int)seq_pages[sq].size());
  }
  // Refuses (nothing appended) a batch whose new positions need more pages than the pool has free.
  void check_pages(int need) const {
    if (need > (int)free_pages.size())
      fail_input("[cuda model] the page pool is full: the batch needs " + std::to_string(need) + " more pages of " +
                 std::to_string(fmt.page_size) + " positions, " + std::to_string(free_pages.size()) + " of " +
                 std::to_string(n_pages) + " are free (clear a sequence or allocate a larger pool)");
  }

  // Host tables to the device through the pinned buffer `pin`, asynchronously on the stream
  // (ordered before the step): each call of the returned function takes the next 8-byte-aligned
  // piece of `pin`, from its start.
  auto pinned_uploader() {
    return [this, off = (size_t)0](void* d, const void* src, size_t bytes) mutable {
      if (!bytes) return;
      off = (off + 7) / 8 * 8;
      KVQ_ASSERT(off + bytes <= pin_bytes);
      std::memcpy(pin + off, src, bytes);
      check_cuda(cudaMemcpyAsync(d, pin + off, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync tables");
      off += bytes;
    };
  }

  // KIVI: the tables of the step h_seq / h_pos (each sequence's tokens consecutive, at most kv_chunk
  // of them): page and exact slots of the appended rows, the groups the step completes, each token's
  // attention entry (body pages, exact rows and gap), the residual's moves; uploaded with `up`. pad > 0
  // (a decode step under a CUDA graph: one token per sequence, so at most one group and one move
  // each): the groups and moves padded with no-op entries to `pad` each, so that the step's launches
  // are the same whichever sequences complete a group.
  template <class Up>
  void kivi_tables(bool attention, Up&& up, int pad = 0) {
    const int n = (int)h_seq.size();
    const int P = fmt.page_size;
    h_slots.resize(n);
    h_ex_slots.resize(n);
    h_src.clear();
    h_dst.clear();
    h_moves.clear();
    h_new_base.clear();
    for (int t = 0; t < n; ++t) {
      const int sq = h_seq[t], p = h_pos[t], r = p - sink;
      h_slots[t] = r >= 0 ? (int64_t)page_for(sq, r) * P + r % P : -1;
      const int row = p < sink ? p : sink + r - kv_base[sq];
      KVQ_ASSERT(row < kv_cap);
      h_ex_slots[t] = (int64_t)sq * kv_cap + row;
      const bool last = t + 1 == n || h_seq[t + 1] != sq;
      if (!last) continue;
      // the sequence's step ends here: the groups it completes, its residual's move
      const int n0 = seq_pos[sq], n1 = p + 1;
      const int c0 = kivi_comp(n0), c1 = kivi_comp(n1);
      KVQ_ASSERT(c0 == kv_base[sq]);
      for (int g0 = c0; g0 < c1; g0 += 32) {
        h_src.push_back((int64_t)sq * kv_cap + sink + g0 - kv_base[sq]);
        h_dst.push_back((int64_t)seq_pages[sq][g0 / P] * P + g0 % P);
      }
      const int rest = n1 - sink - c1;  // residual rows after the step
      if (c1 > c0 && rest > 0) h_moves.insert(h_moves.end(), {sq, sink, sink + c1 - kv_base[sq], rest});
      h_new_base.emplace_back(sq, c1);
    }
    if (pad > 0) {
      KVQ_ASSERT((int)h_src.size() <= pad && (int)h_moves.size() <= 4 * pad);
      h_src.resize(pad, 0);
      h_dst.resize(pad, -1);               // (quantize_kivi_groups skips it)
      h_moves.resize((size_t)4 * pad, 0);  // {slot 0, rows 0 -> 0, 0 rows}
    }
    KVQ_ASSERT((int)h_src.size() <= kv_groups_max);
    if (attention) {
      h_indptr.assign(n + 1, 0);
      h_last.assign(n, 0);
      h_indices.clear();
      h_ex_len.resize(n);
      h_glo.resize(n);
      h_ghi.resize(n);
      for (int t = 0; t < n; ++t) {
        const int sq = h_seq[t], p = h_pos[t];
        const int body = kivi_comp(p + 1), np = (body + P - 1) / P;
        const std::vector<int32_t>& pg = seq_pages[sq];
        h_indices.insert(h_indices.end(), pg.begin(), pg.begin() + np);
        h_indptr[t + 1] = (int32_t)h_indices.size();
        h_last[t] = np > 0 ? body - (np - 1) * P : 1;
        if (p < sink) {
          h_ex_len[t] = p + 1;
          h_glo[t] = h_ghi[t] = 0;
        } else {
          h_ex_len[t] = p + 1 - kv_base[sq];  // sink + (p - sink) - base + 1
          h_glo[t] = sink;
          h_ghi[t] = sink + body - kv_base[sq];
        }
      }
      up(indptr, h_indptr.data(), (n + 1) * sizeof(int32_t));
      up(indices, h_indices.data(), h_indices.size() * sizeof(int32_t));
      up(last, h_last.data(), n * sizeof(int32_t));
      up(ex_len, h_ex_len.data(), n * sizeof(int32_t));
      up(kx_glo, h_glo.data(), n * sizeof(int32_t));
      up(kx_ghi, h_ghi.data(), n * sizeof(int32_t));
    }
    up(slots, h_slots.data(), n * sizeof(int64_t));
    up(ex_slots, h_ex_slots.data(), n * sizeof(int64_t));
    up(tok_seq, h_seq.data(), n * sizeof(int32_t));
    up(kx_src, h_src.data(), h_src.size() * sizeof(int64_t));
    up(kx_dst, h_dst.data(), h_dst.size() * sizeof(int64_t));
    up(kx_moves, h_moves.data(), h_moves.size() * sizeof(int32_t));
  }

  // KIVI: layer il's append (exact rows, V codes), the step's groups, and (after attention) the move
  // of the residual. kv: the layer's view.
  void kivi_append(int il, const paged_kv_view& kv, const uint16_t* k, const uint16_t* v, int n, void* st) {
    exact_rows_out eo;
    eo.k = kx_layer(kx_k, il);
    eo.v = kx_layer(kx_v, il);
    eo.slots = ex_slots;
    eo.cap = kv_cap;
    append_kivi(kv, k, v, kv_elem::f16, slots, n, eo, st);
    quantize_kivi_groups(kv, eo.k, kv_cap, kx_src, kx_dst, (int)h_src.size(), st);
  }
  void kivi_move(int il, void* st) {
    move_exact_rows(kx_layer(kx_k, il), kx_layer(kx_v, il), hp.n_kv_head, hp.head_dim, kv_cap, kx_moves,
                    (int)h_moves.size() / 4, st);
  }
  void kivi_step_done() {
    for (const auto& [sq, b] : h_new_base) kv_base[sq] = b;
  }

  // A KIVI step (forward chunk or decode step). graph_step: a decode step (one token per sequence) as
  // a CUDA graph, one per (tokens, output rows, argmax) shape as run()'s: its groups and moves padded
  // to one per token (kivi_tables), its decode plan kept in the graph entry and updated in place.
  void run_kivi(float* out, int32_t* ids, bool graph_step) {
    const int n = (int)h_tok.size();
    const int n_out = (int)h_rows.size();
    const bool want_ids = ids != nullptr;
    auto up = pinned_uploader();
    up(tokens, h_tok.data(), n * sizeof(int32_t));
    up(pos, h_pos.data(), n * sizeof(int32_t));
    up(rows, h_rows.data(), n_out * sizeof(int32_t));
    decode_params dp = kv_decode_params();
    // a prompt chunk of one sequence: its queries in tiles that read each key tile once
    dp.kivi_tiles = kivi_query_tiles && tiled_prefill && n >= kKiviTilesMin &&
                    std::all_of(h_seq.begin(), h_seq.end(), [&](int32_t sq) { return sq == h_seq[0]; });
    graph_step = graph_step && !dp.kivi_tiles;
    kivi_tables(true, up, graph_step ? n : 0);
    n_tiled += dp.kivi_tiles;
    n_parts = 1;
    parts[0] = attn_part{};
    parts[0].rows = parts[0].entries = n;
    parts[0].paged = true;
    step_staged = false;
    step_paged = true;
    graph_entry* g = graph_step ? graph_of_step(n, n_out, want_ids) : nullptr;
    if (g) {
      // as run(): the entry's plan updated in place and the graph replayed, else the step captured anew
      if (!(part_plans(g->plans, dp, true) && g->exec)) {
        trim_graphs(g);
        capture(*g, n, n_out, want_ids);
      }
      check_cuda(cudaGraphLaunch(g->exec, stream), "cudaGraphLaunch");
    } else {
      const decode_plan plan(fmt, dp, h_indptr.data(), h_last.data(), n, kv_cap);
      parts[0].dplan = &plan;
      enqueue(n, n_out, want_ids);
      check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // before the plan's buffers go
    }
    kivi_step_done();
    for (int t = 0; t < n; ++t) seq_pos[h_seq[t]] = std::max(seq_pos[h_seq[t]], h_pos[t] + 1);
    finish(out, ids, n_out);
  }

  // Logits / argmax of the step's output rows back to the host, checked for NaN / Inf: both for every
  // row, except in a mixed step (n_dec > 0) with ids, where the decode rows [0, n_dec) give ids only and
  // the others logits only (at their row of `out`).
  void finish(float* out, int32_t* ids, int n_out) {
    const int n_ids = ids && n_dec > 0 ? n_dec : n_out, first = ids && n_dec > 0 ? n_dec : 0;
    const size_t V = hp.n_vocab, n_logits = (size_t)(n_out - first) * V;
    if (out && n_logits > 0)
      check_cuda(cudaMemcpyAsync(out + first * V, logits + first * V, n_logits * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpy logits");
    int32_t* pin_ids = reinterpret_cast<int32_t*>(pin);  // the tables' uploads are done by then (stream order)
    if (ids)
      check_cuda(cudaMemcpyAsync(pin_ids, argmax, n_ids * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpy argmax");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (out)
      for (size_t i = first * V; i < (size_t)n_out * V; ++i)
        if (!std::isfinite(out[i])) non_finite(i / V);
    if (ids) {
      std::memcpy(ids, pin_ids, n_ids * sizeof(int32_t));
      for (int r = 0; r < n_ids; ++r)
        if (ids[r] < 0) non_finite((size_t)r);
    }
  }

  // Runs the validated tokens h_tok / h_seq / h_pos (token t of sequence h_seq[t] at position
  // h_pos[t], one sequence's positions consecutive and continuing its cache), with logits for the
  // tokens h_rows. Copies the logits to `out` and / or the argmax ids to `ids` (either may be null).
  void run(float* out, int32_t* ids, bool graph_step = false) {
    if (kivi) return run_kivi(out, ids, graph_step);
    const int n = (int)h_tok.size();
    const int n_out = (int)h_rows.size();
    const int P = fmt.page_size;
    h_slots.resize(n);
    h_ex_slots.resize(n);
    h_cross.clear();
    for (int t = 0; t < n; ++t) {
      h_slots[t] = (int64_t)page_for(h_seq[t], h_pos[t]) * P + h_pos[t] % P;
      if (h_pos[t] < cal_n) h_slots[t] = -1;  // staged (append_paged skips it)
      if (h_pos[t] == cal_n - 1) h_cross.push_back(h_seq[t]);
      h_ex_slots[t] = sink_slot(h_seq[t], h_pos[t]);  // (written with the page row)
    }
    cal_tables();
    step_staged = false;
    for (int t = 0; t < n && !step_staged; ++t) step_staged = h_pos[t] < cal_n;
    // a step that calibrates launches more kernels than the others: run it directly
    graph_step = graph_step && h_cross.empty();
    // The attention of the step in up to two parts, each with its own plan and page-table entries:
    // rows [0, n_dec) the decode rows of a mixed step (model_runner::step; n_dec = 0 otherwise), one
    // entry per token; rows [n_dec, n) through the tiled prefill kernel when they are a prompt chunk
    // of one sequence of >= kTiledMin tokens (one entry: a sequence whose pages hold positions [0,
    // last + 1), the chunk being their last positions, appended first; with the K channel scale its
    // queries are scaled by that sequence's lambda and those below cal_n then attended by
    // staged_attention, as on the per-token path), else one entry per token. Each part's plan is the
    // plan that part gets run alone, so a mixed step's rows equal decode() and forward() run apart.
    const int n0 = n_dec;
    bool tiled = tiled_prefill && n - n0 >= kTiledMin;
    for (int t = n0 + 1; tiled && t < n; ++t) tiled = h_seq[t] == h_seq[n0] && h_pos[t] == h_pos[n0] + t - n0;
    h_indptr.clear();
    h_last.clear();
    h_indices.clear();
    h_ex_len.clear();
    n_parts = 0;
    auto add_part = [&](int t0, int t1, bool tl) {
      attn_part& a = parts[n_parts++];
      a = attn_part{};
      a.row0 = t0;
      a.rows = t1 - t0;
      a.tiled = tl;
      a.paged = cal_n == 0;
      for (int t = t0; !a.paged && t < t1; ++t) a.paged = h_pos[t] >= cal_n;
      a.entries = tl ? 1 : t1 - t0;
      a.ptr0 = (int)h_indptr.size();
      a.ind0 = (int)h_indices.size();
      a.ent0 = (int)h_last.size();
      h_indptr.push_back(0);
      // entry e attends positions [0, len) of sequence sq: [0, sink) exact, the rest through its
      // pages (compressed, as the CPU cache without an exact tail: kv_cache_quant's comp_rule with
      // min_tail 0); the prefill kernel shows query p the sink rows <= p
      auto entry = [&](int sq, int len) {
        const int np = (len + P - 1) / P;
        const std::vector<int32_t>& pg = seq_pages[sq];
        h_indices.insert(h_indices.end(), pg.begin(), pg.begin() + np);
        h_indptr.push_back((int32_t)h_indices.size() - a.ind0);
        h_last.push_back(len - (np - 1) * P);
        h_ex_len.push_back(std::min(sink, len));
      };
      if (tl) entry(h_seq[t0], h_pos[t1 - 1] + 1);
      else
        for (int t = t0; t < t1; ++t) entry(h_seq[t], h_pos[t] + 1);
    };
    if (n0 > 0) add_part(0, n0, false);
    add_part(n0, n, tiled);
    step_paged = parts[0].paged || (n_parts == 2 && parts[1].paged);
    prof_begin();
    // the tables through pinned memory, asynchronously on the stream (ordered before the step)
    auto up = pinned_uploader();
    up(tokens, h_tok.data(), n * sizeof(int32_t));
    up(pos, h_pos.data(), n * sizeof(int32_t));
    up(rows, h_rows.data(), n_out * sizeof(int32_t));
    up(indptr, h_indptr.data(), h_indptr.size() * sizeof(int32_t));
    up(indices, h_indices.data(), h_indices.size() * sizeof(int32_t));
    up(last, h_last.data(), h_last.size() * sizeof(int32_t));
    up(slots, h_slots.data(), n * sizeof(int64_t));
    up(tok_seq, h_seq.data(), n * sizeof(int32_t));
    up(cal_rows, h_cal_rows.data(), h_cal_rows.size() * sizeof(int32_t));
    up(cal_slots, h_cal_slots.data(), h_cal_slots.size() * sizeof(int64_t));
    if (sink > 0) {
      up(ex_len, h_ex_len.data(), h_ex_len.size() * sizeof(int32_t));
      up(ex_slots, h_ex_slots.data(), n * sizeof(int64_t));
      up(cal_ex_slots, h_cal_ex_slots.data(), h_cal_ex_slots.size() * sizeof(int64_t));
    }

    decode_params dp = kv_decode_params();
    dp.body_lo = sink;
    const bool want_ids = ids != nullptr;

    for (int i = 0; i < n_parts; ++i) n_tiled += parts[i].tiled;
    graph_entry* g = graph_step ? graph_of_step(n, n_out, want_ids) : nullptr;
    if (g) {
      // the same launches as the captured step (pointers fixed, tables and work items rewritten in
      // place): replay the graph as it is; else capture the step anew
      const bool replay = part_plans(g->plans, dp, true) && g->exec;
      prof_launch();
      if (!replay) {
        trim_graphs(g);  // (new plans: the cache's workspace may have grown)
        capture(*g, n, n_out, want_ids);
      }
      check_cuda(cudaGraphLaunch(g->exec, stream), "cudaGraphLaunch");
      prof_launched();
    } else {
      part_plans(direct_plans, dp, split_fixed > 0);
      prof_launch();
      enqueue(n, n_out, want_ids);
      prof_launched();
      check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // before a plan is updated
    }
    for (int t = 0; t < n; ++t) seq_pos[h_seq[t]] = std::max(seq_pos[h_seq[t]], h_pos[t] + 1);
    finish(out, ids, n_out);
    prof_end();
  }

  // The graph entry of this step's shape (parts[0, n_parts) and the arguments), or nullptr when the
  // shape is new: it is then remembered (trim_graphs) and the step runs directly.
  graph_entry* graph_of_step(int n, int n_out, bool want_ids) {
    graph_key key;
    key.n = n;
    key.n_dec = n_dec;
    key.n_out = n_out;
    key.ids = want_ids;
    key.staged = step_staged;  // (step_paged: one of the parts is)
    for (int i = 0; i < n_parts; ++i) {
      key.entries[i] = parts[i].entries;
      key.part_paged[i] = parts[i].paged;
      key.tiled[i] = parts[i].tiled;
    }
    for (auto& e : graph_cache)
      if (e->key == key) {
        e->used = ++graph_clock;
        return e.get();
      }
    graph_cache.push_back(std::make_unique<graph_entry>());
    graph_cache.back()->key = key;
    graph_cache.back()->used = ++graph_clock;
    trim_graphs(graph_cache.back().get());
    return nullptr;
  }

  // Drops the least recently used shapes but `keep` while there are more than kGraphs or their plans
  // hold more than kGraphPlanBytes (between steps: the stream is idle).
  void trim_graphs(const graph_entry* keep) {
    auto bytes = [](const plan_set& ps) {
      size_t b = ps.p ? ps.p->workspace_bytes() : 0;
      for (const auto& d : ps.d) b += d ? d->workspace_bytes() : 0;
      return b;
    };
    for (;;) {
      size_t total = 0;
      for (const auto& e : graph_cache) total += bytes(e->plans);
      if (graph_cache.size() <= kGraphs && total <= kGraphPlanBytes) return;
      auto lru = graph_cache.end();
      for (auto it = graph_cache.begin(); it != graph_cache.end(); ++it)
        if (it->get() != keep && (lru == graph_cache.end() || (*it)->used < (*lru)->used)) lru = it;
      if (lru == graph_cache.end()) return;  // only `keep` is left
      if ((*lru)->exec) cudaGraphExecDestroy((*lru)->exec);
      graph_cache.erase(lru);
    }
  }

  // Points each part of the step (parts[0, n_parts)) at its plan in ps: none for a part whose every
  // query is staged (below the K channel scale's window: staged_attention writes all its rows); a
  // prefill plan for a tiled part; else a decode plan. A plan of the same shape in ps is updated in
  // place (prefill_plan::update, always; decode_plan::update when update_decode: with fixed split-KV
  // items, or under a graph, whose replays keep the captured split) when that gives the launch a new
  // plan would; otherwise a new plan is made (its exact window: the sink rows, or KIVI's exact slot of
  // kv_cap rows). Returns whether every plan was updated in place.
  bool part_plans(plan_set& ps, const decode_params& dp, bool update_decode) {
    bool all_kept = true;
    for (int i = 0; i < n_parts; ++i) {
      attn_part& a = parts[i];
      a.dplan = nullptr;
      a.pplan = nullptr;
      if (!a.paged) continue;
      const int32_t* indptr = h_indptr.data() + a.ptr0;
      const int32_t* last = h_last.data() + a.ent0;
      if (a.tiled) {
        const int32_t qo[2] = {0, a.rows};
        if (!ps.p || !ps.p->update(qo, indptr, last, stream)) {
          prefill_params pp;
          pp.n_head = hp.n_head;
          pp.spec = attn_spec{hp.attn_scale};
          pp.q_elem = kv_elem::f16;
          pp.out_elem = kv_elem::f16;
          pp.body_lo = sink;
          ps.p.reset();  // (its buffers go before the new plan's are taken)
          ps.p = std::make_unique<prefill_plan>(fmt, pp, qo, indptr, last, 1, sink);
          all_kept = false;
        }
        a.pplan = ps.p.get();
      } else {
        std::unique_ptr<decode_plan>& d = ps.d[i];
        if (!(update_decode && d && ps.entries[i] == a.entries && d->update(indptr, last, stream))) {
          d.reset();
          d = std::make_unique<decode_plan>(fmt, dp, indptr, last, a.entries, kivi ? kv_cap : sink);
          ps.entries[i] = a.entries;
          all_kept = false;
        }
        a.dplan = d.get();
      }
    }
    return all_kept;
  }

  // Captures the step's launches (enqueue) into a graph and applies it to g.exec: cudaGraphExecUpdate
  // when g has one and the update is accepted, else a new instantiation.
  void capture(graph_entry& g, int n, int n_out, bool want_ids) {
    cudaGraph_t graph = nullptr;
    if (n_parts == 2) init_side();  // (before the capture: it allocates)
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      use_side = true;
      enqueue(n, n_out, want_ids);
      use_side = false;
    } catch (...) {
      use_side = false;
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    ++n_captured;
    bool updated = false;
    if (g.exec) {
      cudaGraphExecUpdateResultInfo info{};
      updated = cudaGraphExecUpdate(g.exec, graph, &info) == cudaSuccess;
      if (!updated) {
        (void)cudaGetLastError();
        cudaGraphExecDestroy(g.exec);
        g.exec = nullptr;
      }
    }
    if (!updated) {
      const cudaError_t e = cudaGraphInstantiate(&g.exec, graph, 0);
      if (e != cudaSuccess) {
        cudaGraphDestroy(graph);
        g.exec = nullptr;
        check_cuda(e, "cudaGraphInstantiate");
      }
      ++n_instantiated;
    }
    cudaGraphDestroy(graph);
  }

  // decode_params of this model's attention (f16 queries and outputs).
  decode_params kv_decode_params() const {
    decode_params dp;
    dp.n_head = hp.n_head;
    dp.spec = attn_spec{hp.attn_scale};
    dp.q_elem = kv_elem::f16;
    dp.out_elem = kv_elem::f16;
    dp.split_tokens = split_fixed;
    return dp;
  }

  // y [n][n_out] = x [n][n_in] . W^T as gemm(), rows [0, split) and [split, n) as two products when 0 <
  // split < n: a mixed step's decode rows and prompt rows each see the row count they see apart (cuBLAS
  // picks its kernel, and with it the summation order, by the shape); the prompt rows' product on the
  // side stream, beside the decode rows'.
  void gemm_rows(const uint16_t* w, int64_t n_out, int64_t n_in, const uint16_t* xin, int n, float* y, int split) {
    if (split <= 0 || split >= n) return gemm(w, n_out, n_in, xin, n, y);
    if (!use_side) {
      gemm(w, n_out, n_in, xin, split, y);
      gemm(w, n_out, n_in, xin + (size_t)split * n_in, n - split, y + (size_t)split * n_out);
      return;
    }
    fork();
    gemm(w, n_out, n_in, xin + (size_t)split * n_in, n - split, y + (size_t)split * n_out, blas_side);
    gemm(w, n_out, n_in, xin, split, y);
    join();
  }

  // The step's kernels and products on `stream` (src/model/arch/llama.cpp's graph); attention through
  // the plans of parts[0, n_parts) (a part without a plan: its every token staged; staged_attention
  // writes its rows).
  void enqueue(int n, int n_out, bool want_ids) {
    const int64_t E = hp.n_embd, F = hp.n_ff;
    void* st = stream;
    // a mixed step's products in two row groups (gemm_rows); its output rows: the decode rows first
    const int split = n_parts == 2 ? parts[1].row0 : 0;
    mk::embed(tokens, emb, n, (int)E, x, st);
    for (int il = 0; il < hp.n_layer; ++il) {
      const layer_w& L = layers[il];
      mk::add_rmsnorm(x, il == 0 ? nullptr : o, L.attn_norm, nullptr, n, (int)E, hp.rms_eps, h, st);
      gemm_rows(L.wqkv, dqkv, E, h, n, qkv, split);
      mk::qkv_rope(qkv, L.bqkv, inv_freq, n_rot, neox, pos, n, hp.n_head, hp.n_kv_head, hp.head_dim, q16, k16, v16, st,
                   k32, v32);
      if (kivi) {
        paged_kv_view kv = layer_view(il, parts[0]);
        kivi_append(il, kv, k16, v16, n, st);
        exact_window_view ew;
        ew.k = kx_layer(kx_k, il);
        ew.v = kx_layer(kx_v, il);
        ew.len = ex_len;
        ew.cap = kv_cap;
        ew.slot = tok_seq;
        ew.gap_lo = kx_glo;
        ew.gap_hi = kx_ghi;
        parts[0].dplan->run(kv, q16, attn16, &ew, st);
        kivi_move(il, st);
      } else {
        if (cal_n > 0) {
          append_calibrated(il, k32, v32, tok_seq, pos, slots, ex_slots, n, step_staged, step_paged, st);
        } else {
          const exact_rows_out pe = sink_out(il, ex_slots);
          append_paged(layer_view(il, attn_part{}), k16, v16, kv_elem::f16, slots, n, st, sink > 0 ? &pe : nullptr);
        }
        // a mixed step's prompt part on the side stream, beside the decode rows' part
        const bool two = use_side && n_parts == 2 && (parts[0].dplan || parts[0].pplan) && (parts[1].dplan || parts[1].pplan);
        if (two) fork();
        for (int i = n_parts - 1; i >= 0; --i) {
          const attn_part& a = parts[i];
          void* ast = two && i == 1 ? (void*)side : st;
          paged_kv_view kv = layer_view(il, a);
          if (cal_n > 0) {
            kv.k_mu = k_mu + (size_t)il * n_seq * dkv;
            kv.k_lambda = k_lam + (size_t)il * n_seq * dkv;
            kv.stat_row = tok_seq + a.row0;  // per token (decode plan), or entry 0 = the chunk's sequence
          }
          const exact_window_view ew = sink_view(il, a);
          const uint16_t* q = q16 + (size_t)a.row0 * dq;
          uint16_t* out = attn16 + (size_t)a.row0 * dq;
          if (a.pplan) a.pplan->run(kv, q, out, sink > 0 ? &ew : nullptr, ast);
          else if (a.dplan) a.dplan->run(kv, q, out, sink > 0 ? &ew : nullptr, ast);
        }
        if (two) join();
      }
      // queries below the calibration positions: exact attention over the staging rows (replaces
      // what the paged kernel wrote for them from pages that may not hold those rows yet)
      if (cal_n > 0 && step_staged)
        mk::staged_attention(q16, stage_k(il), stage_v(il), tok_seq, pos, n, cal_n, hp.n_head, hp.n_kv_head,
                             hp.head_dim, hp.attn_scale, attn16, st);
      gemm_rows(L.wo, E, dq, attn16, n, o, split);
      mk::add_rmsnorm(x, o, L.ffn_norm, nullptr, n, (int)E, hp.rms_eps, h, st);
      gemm_rows(L.wgu, 2 * F, E, h, n, gu, split);
      mk::swiglu(gu, n, (int)F, act, st);
      gemm_rows(L.wdown, E, F, act, n, o, split);
    }
    // x += the last FFN output and the final norm, for the output rows only
    mk::add_rmsnorm(x, o, out_norm, rows, n_out, (int)E, hp.rms_eps, h, st);
    if (n_out > 0) gemm_rows(w_out, hp.n_vocab, E, h, n_out, logits, split);
    if (want_ids) mk::argmax_rows(logits, n_out, hp.n_vocab, argmax, st);
  }

  // h_cal_rows / h_cal_slots for the sequences of h_cross: the stats row and page slot of each of
  // their staged positions [0, cal_n) (their pages exist: page_for ran for every position).
  void cal_tables() {
    h_cal_rows.clear();
    h_cal_slots.clear();
    h_cal_ex_slots.clear();
    const int P = fmt.page_size;
    for (int32_t sq : h_cross)
      for (int p = 0; p < cal_n; ++p) {
        h_cal_rows.push_back(sq);
        h_cal_slots.push_back((int64_t)seq_pages[sq][p / P] * P + p % P);
        h_cal_ex_slots.push_back(sink_slot(sq, p));
      }
  }

  // Appends the f32 rows k, v [n][dkv] of layer il (token t of sequence seq[t] at position pos[t],
  // page slot slots[t], -1 for a staged one; device arrays) with the K channel scale: rows below
  // cal_n to the staging rows; then, for each sequence of h_cross (cal_tables uploaded), mu /
  // lambda from its staged positions [cal_skip, cal_n) and its cal_n staged rows into the pages;
  // then the other rows into the pages. staged / paged: whether any row is below / at or past cal_n
  // (the kernels of the other kind have nothing to do and are not launched). ex_slots_d [n]: the
  // rows' exact sink rows (with sink > 0; cal_ex_slots for the calibrated staged rows).
  void append_calibrated(int il, const float* k, const float* v, const int32_t* seq, const int32_t* pos_d,
                         const int64_t* slots_d, const int64_t* ex_slots_d, int n, bool staged, bool paged, void* st) {
    float *sk = stage_k(il), *sv = stage_v(il);
    if (staged) mk::stage_rows(k, v, seq, pos_d, n, cal_n, (int)dkv, sk, sv, st);
    paged_kv_view kv = layer_view(il, 0);
    kv.k_mu = k_mu + (size_t)il * n_seq * dkv;
    kv.k_lambda = k_lam + (size_t)il * n_seq * dkv;
    for (size_t i = 0; i < h_cross.size(); ++i) {
      const size_t sq = (size_t)h_cross[i];
      channel_stats(sk + (sq * cal_n + cal_skip) * dkv, cal_n - cal_skip, hp.n_kv_head, hp.head_dim,
                    const_cast<float*>(kv.k_mu) + sq * dkv, const_cast<float*>(kv.k_lambda) + sq * dkv, st);
      kv.stat_row = cal_rows + i * cal_n;
      const exact_rows_out ce = sink_out(il, cal_ex_slots + i * cal_n);
      append_paged(kv, sk + sq * cal_n * dkv, sv + sq * cal_n * dkv, kv_elem::f32, cal_slots + i * cal_n, cal_n, st,
                   sink > 0 ? &ce : nullptr);
    }
    kv.stat_row = seq;
    const exact_rows_out pe = sink_out(il, ex_slots_d);
    if (paged) append_paged(kv, k, v, kv_elem::f32, slots_d, n, st, sink > 0 ? &pe : nullptr);
  }

  // forward()'s checks of tokens [n] of sequence sq at pos0 .. pos0 + n - 1 (nothing appended on
  // error); returns the new pages they need.
  int check_forward(std::span<const int32_t> toks, int pos0, std::span<const uint8_t> output, int sq) const {
    const int n = (int)toks.size();
    if (n == 0) fail_input("[cuda model] forward called with no tokens");
    if (n > max_batch)
      fail_input("[cuda model] batch of " + std::to_string(n) + " tokens exceeds the runner's max_batch " +
                 std::to_string(max_batch));
    if (!output.empty() && (int)output.size() != n)
      fail_input("[cuda model] output flags: " + std::to_string(output.size()) + " for " + std::to_string(n) +
                 " tokens (one per token, or empty)");
    for (int t = 0; t < n; ++t) check_token(toks[t], t);
    check_seq(sq);
    if (pos0 != seq_pos[sq])
      fail_input("[cuda model] cache holds " + std::to_string(seq_pos[sq]) +
                 " positions but the batch starts at position " + std::to_string(pos0));
    if ((int64_t)pos0 + n > n_ctx)
      fail_input("[cuda model] the sequence would hold " + std::to_string((int64_t)pos0 + n) +
                 " positions, more than n_ctx " + std::to_string(n_ctx));
    return pages_needed(sq, (int64_t)pos0 + n);
  }
  int seq_pos_checked(int sq) const {
    check_seq(sq);
    return seq_pos[sq];
  }
  // decode()'s checks of one token each of distinct sequences (nothing appended on error); returns
  // the new pages they need. what: the caller's name in the messages.
  int check_decode(std::span<const int32_t> seq_ids, std::span<const int32_t> toks, const char* what) const {
    const int n = (int)seq_ids.size();
    const std::string w = std::string("[cuda model] ") + what;
    if (n == 0) fail_input(w + " called with no sequences");
    if ((int)toks.size() != n)
      fail_input(w + ": " + std::to_string(toks.size()) + " tokens for " + std::to_string(n) +
                 " sequences (one each)");
    if (n > max_batch)
      fail_input(w + " batch of " + std::to_string(n) + " sequences exceeds the runner's max_batch " +
                 std::to_string(max_batch));
    std::vector<uint8_t> seen(n_seq, 0);
    int need = 0;
    for (int i = 0; i < n; ++i) {
      check_seq(seq_ids[i]);
      if (seen[seq_ids[i]]++) fail_input(w + ": sequence " + std::to_string(seq_ids[i]) + " appears twice");
      check_token(toks[i], i);
      if (seq_pos[seq_ids[i]] >= n_ctx)
        fail_input(w + ": sequence " + std::to_string(seq_ids[i]) + " already holds n_ctx " + std::to_string(n_ctx) +
                   " positions");
      need += pages_needed(seq_ids[i], (int64_t)seq_pos[seq_ids[i]] + 1);
    }
    return need;
  }
  // The host tables of decode rows: token i of sequence seq_ids[i] at its next position, output row i.
  void set_decode_rows(std::span<const int32_t> seq_ids, std::span<const int32_t> toks) {
    const int n = (int)seq_ids.size();
    h_tok.assign(toks.begin(), toks.end());
    h_seq.assign(seq_ids.begin(), seq_ids.end());
    h_pos.resize(n);
    h_rows.resize(n);
    for (int i = 0; i < n; ++i) {
      h_pos[i] = seq_pos[seq_ids[i]];
      h_rows[i] = i;
    }
  }

  [[noreturn]] void non_finite(size_t row) const {
    const int t = h_rows[row];
    fail_input("[cuda model] non-finite logits (NaN/Inf) for sequence " + std::to_string(h_seq[t]) + " at position " +
               std::to_string(h_pos[t]) + " (f16 overflow of an activation?)");
  }

  void check_seq(int sq) const {
    if (sq < 0 || sq >= n_seq)
      fail_input("[cuda model] sequence id " + std::to_string(sq) + " is outside [0, n_seq " + std::to_string(n_seq) +
                 ")");
  }
  void check_token(int32_t id, int t) const {
    if (id < 0 || id >= hp.n_vocab)
      fail_input("[cuda model] token id " + std::to_string(id) + " at batch index " + std::to_string(t) +
                 " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
  }
};

model_runner::model_runner(const model& m, const kv_cache_params& cp, int max_batch) : p_(std::make_unique<impl>()) {
  impl& s = *p_;
  s.init(m.hparams(), cp, max_batch);
  const model_hparams& hp = s.hp;

  // weights (the tensors the CPU graph reads, src/model/arch/llama.cpp)
  const gguf_file& f = m.gguf();
  model_hparams hq = hp;
  const load::io_weights io = load::io(f, hq);
  const int64_t E = hp.n_embd, F = hp.n_ff;
  s.emb = s.upload_f16({&io.tok_embd});
  s.w_out = hq.tied_output ? s.emb : s.upload_f16({&io.output});
  s.out_norm = s.upload_f32(io.output_norm);
  s.inv_freq = s.upload_f32(build::make_rope(hp, hp.layers[0], load::rope_factors(f, hp)).inv_freq, false);
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
}

model_runner::model_runner(const model_hparams& hp_in, const kv_cache_params& cp, int max_batch, uint64_t seed)
    : p_(std::make_unique<impl>()) {
  impl& s = *p_;
  if ((int)hp_in.layers.size() != hp_in.n_layer)
    fail_input("[cuda model] hyper-parameters: " + std::to_string(hp_in.layers.size()) + " layer entries for n_layer " +
               std::to_string(hp_in.n_layer));
  s.init(hp_in, cp, max_batch);
  s.seed = seed * 0x100000001b3ull;
  const model_hparams& hp = s.hp;
  const int64_t E = hp.n_embd, F = hp.n_ff;
  s.emb = s.random_f16(hp.n_vocab, E);
  s.w_out = hp.tied_output ? s.emb : s.random_f16(hp.n_vocab, E);
  s.out_norm = s.random_f32(E, 1.0f, 1.0f);
  s.inv_freq = s.upload_f32(build::make_rope(hp, hp.layers[0], {}).inv_freq, false);
  for (int il = 0; il < hp.n_layer; ++il) {
    impl::layer_w& L = s.layers[il];
    L.wqkv = s.random_f16(s.dqkv, E);
    L.wo = s.random_f16(E, s.dq);
    L.wgu = s.random_f16(2 * F, E);
    L.wdown = s.random_f16(E, F);
    L.attn_norm = s.random_f32(E, 1.0f, 1.0f);
    L.ffn_norm = s.random_f32(E, 1.0f, 1.0f);
    if (hp.qkv_bias) L.bqkv = s.random_f32(s.dqkv, -0.5f, 0.5f);
  }
  check_cuda(cudaDeviceSynchronize(), "random weights");
}

model_runner::~model_runner() = default;

int model_runner::forward(std::span<const int32_t> tokens, int pos0, std::span<const uint8_t> output, float* logits,
                          int seq_id) {
  impl& s = *p_;
  const int n = (int)tokens.size();
  s.check_pages(s.check_forward(tokens, pos0, output, seq_id));
  // KIVI: steps of at most kv_chunk tokens (the exact slot holds a step's rows beside the residual)
  const int step = s.kivi ? s.kv_chunk : n;
  int written = 0;
  for (int t0 = 0; t0 < n; t0 += step) {
    const int m = std::min(step, n - t0);
    s.h_tok.assign(tokens.begin() + t0, tokens.begin() + t0 + m);
    s.h_seq.assign(m, seq_id);
    s.h_pos.resize(m);
    s.h_rows.clear();
    for (int t = 0; t < m; ++t) {
      s.h_pos[t] = pos0 + t0 + t;
      if (output.empty() ? t0 + t == n - 1 : output[t0 + t] != 0) s.h_rows.push_back(t);
    }
    s.run(logits ? logits + (size_t)written * s.hp.n_vocab : nullptr, nullptr);
    written += (int)s.h_rows.size();
  }
  return written;
}

void model_runner::decode(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens, float* logits,
                          int32_t* argmax) {
  impl& s = *p_;
  const int need = s.check_decode(seq_ids, tokens, "decode");
  s.check_pages(need);
  s.set_decode_rows(seq_ids, tokens);
  s.run(logits, argmax, s.graphs);
}

int model_runner::step(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens, int n_decode,
                       std::span<const uint8_t> output, float* logits, int32_t* argmax) {
  impl& s = *p_;
  const int n = (int)tokens.size();
  if ((int)seq_ids.size() != n)
    fail_input("[cuda model] step: " + std::to_string(seq_ids.size()) + " sequence ids for " + std::to_string(n) +
               " tokens (one each)");
  if (n_decode < 0 || n_decode >= n)
    fail_input("[cuda model] step: n_decode " + std::to_string(n_decode) + " must be in [0, " + std::to_string(n) +
               ") (at least one prompt token after the decode rows)");
  const int n_p = n - n_decode;
  const auto piece = tokens.subspan(n_decode);
  const int32_t sq = seq_ids[n_decode];
  if (!output.empty() && (int)output.size() != n_p)
    fail_input("[cuda model] step: output flags: " + std::to_string(output.size()) + " for " + std::to_string(n_p) +
               " prompt tokens (one per token, or empty)");
  for (int t = n_decode; t < n; ++t)
    if (seq_ids[t] != sq)
      fail_input("[cuda model] step: batch index " + std::to_string(t) + " holds sequence " +
                 std::to_string(seq_ids[t]) + " but the prompt piece is sequence " + std::to_string(sq) +
                 " (one piece per step, after the decode rows)");
  for (int i = 0; i < n_decode; ++i)
    if (seq_ids[i] == sq)
      fail_input("[cuda model] step: sequence " + std::to_string(sq) + " is both a decode row and the prompt piece");
  if (n_decode == 0) return forward(piece, s.seq_pos_checked(sq), output, logits, sq);
  const auto dec_seq = seq_ids.first(n_decode), dec_tok = tokens.first(n_decode);
  if (s.kivi) {
    // KIVI: apart (its prompt steps and exact residual rows are per sequence: docs/cuda.md "KIVI pages")
    s.check_pages(s.check_decode(dec_seq, dec_tok, "step") + s.check_forward(piece, s.seq_pos_checked(sq), output, sq));
    decode(dec_seq, dec_tok, argmax ? nullptr : logits, argmax);
    return n_decode + forward(piece, s.seq_pos[sq], output, logits ? logits + (size_t)n_decode * s.hp.n_vocab : nullptr,
                              sq);
  }
  if (n > s.max_batch)
    fail_input("[cuda model] step of " + std::to_string(n) + " tokens exceeds the runner's max_batch " +
               std::to_string(s.max_batch));
  const int pos0 = s.seq_pos_checked(sq);
  const int need = s.check_decode(dec_seq, dec_tok, "step") + s.check_forward(piece, pos0, output, sq);
  s.check_pages(need);
  s.set_decode_rows(dec_seq, dec_tok);
  for (int t = 0; t < n_p; ++t) {
    s.h_tok.push_back(piece[t]);
    s.h_seq.push_back(sq);
    s.h_pos.push_back(pos0 + t);
    if (output.empty() ? t == n_p - 1 : output[t] != 0) s.h_rows.push_back(n_decode + t);
  }
  s.n_dec = n_decode;
  try {
    s.run(logits, argmax, s.graphs);
  } catch (...) {
    s.n_dec = 0;
    throw;
  }
  s.n_dec = 0;
  return (int)s.h_rows.size();
}

void model_runner::set_cuda_graphs(bool on) { p_->graphs = on; }
void model_runner::set_tiled_prefill(bool on) { p_->tiled_prefill = on; }
void model_runner::set_kivi_query_tiles(bool on) { p_->kivi_query_tiles = on; }
void model_runner::set_batch_invariant(bool on) { p_->split_fixed = on ? impl::kInvariantSplit : 0; }
bool model_runner::batch_invariant() const { return p_->split_fixed > 0; }
bool model_runner::tiled_prefill() const { return p_->tiled_prefill; }
int model_runner::tiled_prefills() const { return p_->n_tiled; }
bool model_runner::cuda_graphs() const { return p_->graphs; }
int model_runner::graph_instantiations() const { return p_->n_instantiated; }
int model_runner::graph_captures() const { return p_->n_captured; }
void model_runner::set_step_profile(bool on) {
  impl& s = *p_;
  for (cudaEvent_t& e : s.pev)
    if (on && !e) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  s.profile = on;
}
model_runner::step_profile model_runner::last_step_profile() const { return p_->prof; }

void model_runner::fill_synthetic(int seq_id, int n_tokens, uint64_t seed) {
  impl& s = *p_;
  s.check_seq(seq_id);
  if (n_tokens < 0) fail_input("[cuda model] fill_synthetic: n_tokens " + std::to_string(n_tokens) + " must be >= 0");
  const int p0 = s.seq_pos[seq_id];
  if ((int64_t)p0 + n_tokens > s.n_ctx)
    fail_input("[cuda model] fill_synthetic: the sequence would hold " + std::to_string((int64_t)p0 + n_tokens) +
               " positions, more than n_ctx " + std::to_string(s.n_ctx));
  if (n_tokens == 0) return;
  s.check_pages(s.pages_needed(seq_id, (int64_t)p0 + n_tokens));
  constexpr int C = impl::kFillChunk;
  const bool cal = s.cal_n > 0;
  if (!s.fill_slots) {
    if (cal) {
      s.fill_k32 = s.alloc<float>((size_t)C * s.dkv);
      s.fill_v32 = s.alloc<float>((size_t)C * s.dkv);
      s.fill_seq = s.alloc<int32_t>(C);
      s.fill_pos = s.alloc<int32_t>(C);
    } else {
      s.fill_k = s.alloc<uint16_t>((size_t)C * s.dkv);
      s.fill_v = s.alloc<uint16_t>((size_t)C * s.dkv);
    }
    s.fill_slots = s.alloc<int64_t>(C);
    if (s.sink > 0) s.fill_ex_slots = s.alloc<int64_t>(C);
  }
  if (s.kivi) {
    // the forward's KIVI path (kivi_tables, kivi_append, kivi_move) on random f16 rows, in steps
    // of kv_chunk positions
    if (!s.fill_k) {
      s.fill_k = s.alloc<uint16_t>((size_t)s.kv_chunk * s.dkv);
      s.fill_v = s.alloc<uint16_t>((size_t)s.kv_chunk * s.dkv);
    }
    uint64_t draw = seed * 0x9e3779b97f4a7c15ull + (uint64_t)seq_id * 0x100000001b3ull + (uint64_t)p0;
    for (int c0 = 0; c0 < n_tokens; c0 += s.kv_chunk) {
      const int c = std::min(s.kv_chunk, n_tokens - c0);
      s.h_seq.assign(c, seq_id);
      s.h_pos.resize(c);
      for (int i = 0; i < c; ++i) s.h_pos[i] = p0 + c0 + i;
      auto up = [&](void* d, const void* src, size_t bytes) {
        if (bytes) check_cuda(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy tables");
      };
      s.kivi_tables(false, up);
      for (int il = 0; il < s.hp.n_layer; ++il) {
        mk::fill_uniform_f16(s.fill_k, c * s.dkv, 2.0f, ++draw, nullptr);
        mk::fill_uniform_f16(s.fill_v, c * s.dkv, 2.0f, ++draw, nullptr);
        s.kivi_append(il, s.layer_view(il, 0), s.fill_k, s.fill_v, c, nullptr);
        s.kivi_move(il, nullptr);
      }
      check_cuda(cudaDeviceSynchronize(), "fill_synthetic");
      s.kivi_step_done();
      s.seq_pos[seq_id] = p0 + c0 + c;
    }
    return;
  }
  const int P = s.fmt.page_size;
  std::vector<int64_t> sl(C), el(C);
  std::vector<int32_t> sq(C, seq_id), ps(C);
  uint64_t draw = seed * 0x9e3779b97f4a7c15ull + (uint64_t)seq_id * 0x100000001b3ull + (uint64_t)p0;
  for (int c0 = 0; c0 < n_tokens; c0 += C) {
    const int c = std::min(C, n_tokens - c0);
    s.h_cross.clear();
    for (int i = 0; i < c; ++i) {
      const int p = p0 + c0 + i;
      sl[i] = (int64_t)s.page_for(seq_id, p) * P + p % P;
      ps[i] = p;
      el[i] = s.sink_slot(seq_id, p);
      if (p < s.cal_n) sl[i] = -1;  // staged, as in run()
      if (p == s.cal_n - 1) s.h_cross.push_back(seq_id);
    }
    check_cuda(cudaMemcpy(s.fill_slots, sl.data(), c * sizeof(int64_t), cudaMemcpyHostToDevice), "cudaMemcpy slots");
    if (s.sink > 0)
      check_cuda(cudaMemcpy(s.fill_ex_slots, el.data(), c * sizeof(int64_t), cudaMemcpyHostToDevice),
                 "cudaMemcpy slots");
    if (cal) {
      // the forward's path (impl::append_calibrated) with f32 rows: staging, calibration, pages
      s.cal_tables();
      check_cuda(cudaMemcpy(s.fill_seq, sq.data(), c * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy seq");
      check_cuda(cudaMemcpy(s.fill_pos, ps.data(), c * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy pos");
      if (!s.h_cal_rows.empty()) {
        check_cuda(cudaMemcpy(s.cal_rows, s.h_cal_rows.data(), s.h_cal_rows.size() * 4, cudaMemcpyHostToDevice),
                   "cudaMemcpy cal rows");
        check_cuda(cudaMemcpy(s.cal_slots, s.h_cal_slots.data(), s.h_cal_slots.size() * 8, cudaMemcpyHostToDevice),
                   "cudaMemcpy cal slots");
        if (s.sink > 0)
          check_cuda(
              cudaMemcpy(s.cal_ex_slots, s.h_cal_ex_slots.data(), s.h_cal_ex_slots.size() * 8, cudaMemcpyHostToDevice),
              "cudaMemcpy cal slots");
      }
    }
    const bool staged = p0 + c0 < s.cal_n, paged = p0 + c0 + c > s.cal_n;  // the chunk's first / last position
    for (int il = 0; il < s.hp.n_layer; ++il) {
      if (cal) {
        mk::fill_uniform_f32(s.fill_k32, c * s.dkv, -2.0f, 2.0f, ++draw, nullptr);
        mk::fill_uniform_f32(s.fill_v32, c * s.dkv, -2.0f, 2.0f, ++draw, nullptr);
        s.append_calibrated(il, s.fill_k32, s.fill_v32, s.fill_seq, s.fill_pos, s.fill_slots, s.fill_ex_slots, c,
                            staged, paged, nullptr);
      } else {
        mk::fill_uniform_f16(s.fill_k, c * s.dkv, 2.0f, ++draw, nullptr);
        mk::fill_uniform_f16(s.fill_v, c * s.dkv, 2.0f, ++draw, nullptr);
        const exact_rows_out fe = s.sink_out(il, s.fill_ex_slots);
        append_paged(s.layer_view(il, 0), s.fill_k, s.fill_v, kv_elem::f16, s.fill_slots, c, nullptr,
                     s.sink > 0 ? &fe : nullptr);
      }
    }
    check_cuda(cudaDeviceSynchronize(), "fill_synthetic");  // sl is rewritten by the next chunk
    s.h_cross.clear();
  }
  s.seq_pos[seq_id] = p0 + n_tokens;
}

void model_runner::clear() {
  for (int sq = 0; sq < p_->n_seq; ++sq) clear_seq(sq);
}
void model_runner::clear_seq(int seq_id) {
  impl& s = *p_;
  s.check_seq(seq_id);
  std::vector<int32_t>& pg = s.seq_pages[seq_id];
  s.free_pages.insert(s.free_pages.end(), pg.rbegin(), pg.rend());
  pg.clear();
  s.seq_pos[seq_id] = 0;
  if (s.kivi) s.kv_base[seq_id] = 0;
}
int model_runner::n_pos(int seq_id) const {
  p_->check_seq(seq_id);
  return p_->seq_pos[seq_id];
}
int model_runner::n_ctx() const { return p_->n_ctx; }
int model_runner::n_seq() const { return p_->n_seq; }
int model_runner::max_batch() const { return p_->max_batch; }
size_t model_runner::kv_bytes() const { return p_->kv_bytes; }
size_t model_runner::weight_bytes() const { return p_->weight_bytes; }
size_t model_runner::kv_bytes_per_page() const { return (size_t)p_->hp.n_layer * p_->geo.page_bytes; }
kv_page_info model_runner::page_info() const {
  const impl& s = *p_;
  kv_page_info pi;
  pi.page_size = s.fmt.page_size;
  pi.n_pages = s.n_pages;
  pi.n_free = (int)s.free_pages.size();
  pi.n_seq_held = s.n_pages - pi.n_free;
  pi.max_pages_per_seq = s.pages_per_seq;
  pi.page_bytes = kv_bytes_per_page();
  return pi;
}
size_t model_runner::kv_bytes_used() const {
  const impl& s = *p_;
  return (size_t)(s.n_pages - (int)s.free_pages.size()) * kv_bytes_per_page();
}

std::string model_runner::describe() const {
  const impl& s = *p_;
  std::string d = std::string(kv_traits(s.fmt.format).name) + "/" + kv_traits(s.fmt.format).name;
  if (s.kivi)
    d = std::string("kivi4/q4a (K per-channel T32, V ") + rotation_name(s.fmt.rotation) +
        " g32; KIVI residual: min tail " + std::to_string(s.kv_min_tail) + ")";
  else if (s.compressed)
    d += std::string(" (") + rotation_name(s.fmt.rotation) + ", g" + std::to_string(s.geo.group) + ")";
  if (s.sink > 0) d += ", exact sink " + std::to_string(s.sink);
  return d + ", " + std::to_string(s.fmt.page_size) + "-token pages, on " + device_name();
}

}  // namespace kvq::cuda
