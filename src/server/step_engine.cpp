#include "server/step_engine.h"

#include <algorithm>

#include "runtime/forward_engine.h"

namespace kvq::server_detail {
namespace {

class cpu_step_engine final : public step_engine {
 public:
  cpu_step_engine(model& m, const kv_cache_params& cp) : m_(m), cache_(make_kv_cache(cp)) {}
  void step(const model_batch& b, int, float* logits, int32_t*, thread_pool& pool) override {
    m_.forward(b, *cache_, pool, logits);
  }
  void clear(int seq) override { cache_->clear(seq); }
  kv_page_info page_info() const override { return cache_->page_info(); }
  int pages_for(int n_pos) const override { return cache_->pages_for(n_pos); }
  int seq_pages(int seq) const override { return (int)cache_->seq_pages(seq).size(); }
  int stage_pages_for(int n_pos) const override { return cache_->stage_pages_for(n_pos); }
  int seq_stage_pages(int seq) const override { return cache_->seq_stage_pages(seq); }
  size_t bytes() const override { return cache_->bytes(); }
  size_t bytes_used() const override { return cache_->bytes_used(); }
  std::string describe() const override { return cache_->describe(); }
  bool split_free() const override {
    const auto& ls = cache_->params().layers;
    return std::none_of(ls.begin(), ls.end(), [](const kv_layer_geometry& g) { return g.window > 0; });
  }
  kv_cache* cpu_cache() override { return cache_.get(); }

 private:
  model& m_;
  std::unique_ptr<kv_cache> cache_;
};

class cuda_step_engine final : public step_engine {
 public:
  cuda_step_engine(const model& m, const kv_cache_params& cp, int max_batch, bool graphs)
      : runner_(m, cp, max_batch), n_vocab_(m.hparams().n_vocab) {
    runner_.set_cuda_graphs(graphs);
    runner_.set_batch_invariant(true);  // a request's bits must not depend on its neighbours
  }
  void step(const model_batch& b, int n_decode, float* logits, int32_t* decode_ids, thread_pool&) override {
    const int n = (int)b.tokens.size();
    size_t row = 0;
    int t0 = n_decode;
    if (n_decode > 0 && n > n_decode) {
      // the decode rows and the first prompt piece in one pass (model_runner::step: the same bits as apart)
      int t1 = t0 + 1;
      while (t1 < n && b.seq_id[t1] == b.seq_id[t0]) ++t1;
      row = runner_.step(b.seq_id.first(t1), b.tokens.first(t1), n_decode, b.output.subspan(t0, t1 - t0), logits,
                         decode_ids);
      t0 = t1;
    } else if (n_decode > 0) {
      runner_.decode(b.seq_id.subspan(0, n_decode), b.tokens.subspan(0, n_decode), decode_ids ? nullptr : logits,
                     decode_ids);
      row = n_decode;
    }
    // the other prompt pieces: one forward() each (a piece is one sequence's consecutive positions)
    while (t0 < n) {
      int t1 = t0 + 1;
      while (t1 < n && b.seq_id[t1] == b.seq_id[t0]) ++t1;
      const auto out = b.output.subspan(t0, t1 - t0);
      if (std::any_of(out.begin(), out.end(), [](uint8_t o) { return o != 0; })) {
        row += runner_.forward(b.tokens.subspan(t0, t1 - t0), b.pos[t0], out, logits + row * n_vocab_, b.seq_id[t0]);
      } else {
        // no row wanted: the runner writes the last token's row (empty flags) into scratch
        scratch_.resize(n_vocab_);
        runner_.forward(b.tokens.subspan(t0, t1 - t0), b.pos[t0], {}, scratch_.data(), b.seq_id[t0]);
      }
      t0 = t1;
    }
  }
  void clear(int seq) override { runner_.clear_seq(seq); }
  kv_page_info page_info() const override { return runner_.page_info(); }
  int pages_for(int n_pos) const override {
    const int P = runner_.page_info().page_size;
    return (n_pos + P - 1) / P;
  }
  int seq_pages(int seq) const override { return pages_for(runner_.n_pos(seq)); }
  size_t bytes() const override { return runner_.kv_bytes(); }
  size_t bytes_used() const override { return runner_.kv_bytes_used(); }
  std::string describe() const override {
    return runner_.describe() + (runner_.cuda_graphs() ? ", decode and mixed steps as CUDA graphs" : "");
  }
  bool split_free() const override { return false; }  // a piece's products and prefill kernel depend on its length
  bool device_argmax() const override { return true; }

 private:
  cuda::model_runner runner_;
  size_t n_vocab_;
  std::vector<float> scratch_;  // [n_vocab] a piece's unwanted last row
};

}  // namespace

std::unique_ptr<step_engine> make_cpu_step_engine(model& m, const kv_cache_params& cp) {
  return std::make_unique<cpu_step_engine>(m, cp);
}

std::unique_ptr<step_engine> make_cuda_step_engine(const model& m, const kv_cache_params& cp, int max_batch,
                                                   bool cuda_graphs) {
  kv_cache_params c = cp;
  c.page_size = 0;  // the runner's pages are its own (16 positions)
  kv_cache_params checked = c;
  checked.n_pages = 0;
  forward_engine_check(m, checked, compute_device::cuda, max_batch);
  return std::make_unique<cuda_step_engine>(m, c, max_batch, cuda_graphs);
}

}  // namespace kvq::server_detail
