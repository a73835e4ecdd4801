// model: loading (the common hyper-parameters, then the architecture's own), cache parameters
// and the batch validation in front of the architecture's graph.
#include "kvq/model.h"

#include <algorithm>
#include <unordered_set>

#include "kvq/error.h"
#include "model/arch.h"
#include "model/graph.h"

namespace kvq {
namespace {

// The architectures: general.architecture -> its implementation (src/model/arch/).
struct arch_entry {
  const char* name;
  std::unique_ptr<model_arch> (*make)();
};
constexpr arch_entry kArchs[] = {
    {"llama", make_arch_llama}, {"mistral", make_arch_llama}, {"qwen2", make_arch_llama},
    {"qwen3", make_arch_llama}, {"gemma3", make_arch_gemma3},
};

}  // namespace

std::vector<std::string> supported_architectures() {
  std::vector<std::string> v;
  for (const auto& a : kArchs) v.push_back(a.name);
  return v;
}

model::model() = default;
model::~model() = default;

std::unique_ptr<model> model::load(const std::string& path) {
  std::unique_ptr<model> m(new model());
  m->file_ = gguf_file::open(path);
  const gguf_file& f = *m->file_;
  model_hparams& hp = m->hp_;
  hp.arch = f.get_string("general.architecture");
  const arch_entry* entry = nullptr;
  for (const auto& a : kArchs)
    if (hp.arch == a.name) entry = &a;
  if (!entry) {
    std::string list;
    for (const auto& a : kArchs) list += (list.empty() ? "" : ", ") + std::string(a.name);
    fail_unsupported("[model] " + path + ": general.architecture '" + hp.arch + "' is not supported (supported: " +
                     list + ")");
  }
  load::common_hparams(f, hp);
  m->arch_ = entry->make();
  m->arch_->load(f, hp);
  for (const auto& t : f.tensors()) hp.n_params += t.n_elements();
  m->scratch_ = std::make_unique<graph_scratch>();
  return m;
}

kv_cache_params model::cache_params(int n_ctx, const kv_cache_params& options, int n_seq) const {
  kv_cache_params p = options;
  p.n_layer = hp_.n_layer;
  p.n_kv_head = hp_.n_kv_head;
  p.head_dim = hp_.head_dim;
  p.n_ctx = n_ctx;
  p.n_seq = n_seq;
  // the layers' sliding windows (the cache applies them and keeps a ring for each windowed layer)
  p.layers.clear();
  for (const layer_hparams& l : hp_.layers)
    if (l.window > 0) p.layers.resize(hp_.n_layer);
  for (size_t il = 0; il < p.layers.size(); ++il) p.layers[il].window = hp_.layers[il].window;
  return p;
}

int model::forward(const model_batch& b, kv_cache& cache, thread_pool& pool, float* logits) {
  const model_hparams& hp = hp_;
  const int64_t n = (int64_t)b.tokens.size();
  if (n == 0) fail_input("[model] forward called with no tokens");
  if ((int64_t)b.pos.size() != n || (int64_t)b.seq_id.size() != n || (!b.output.empty() && (int64_t)b.output.size() != n))
    fail_input("[model] batch of " + std::to_string(n) + " tokens has " + std::to_string(b.pos.size()) +
               " positions, " + std::to_string(b.seq_id.size()) + " sequence ids and " + std::to_string(b.output.size()) +
               " output flags (each must have one per token; output flags may be empty)");
  for (int64_t t = 0; t < n; ++t)
    if (b.tokens[t] < 0 || b.tokens[t] >= hp.n_vocab)
      fail_input("[model] token id " + std::to_string(b.tokens[t]) + " at batch index " + std::to_string(t) +
                 " is outside the vocabulary [0, " + std::to_string(hp.n_vocab) + ")");
  graph_scratch& s = *scratch_;
  // Runs of one sequence each, at consecutive positions continuing the cache.
  const kv_cache_params& cp = cache.params();
  s.runs.clear();
  for (int64_t t = 0; t < n; ++t) {
    const int sid = b.seq_id[t];
    if (t > 0 && sid == b.seq_id[t - 1]) {
      if (b.pos[t] != b.pos[t - 1] + 1)
        fail_input("[model] batch index " + std::to_string(t) + " of sequence " + std::to_string(sid) +
                   " is at position " + std::to_string(b.pos[t]) + ", expected " + std::to_string(b.pos[t - 1] + 1) +
                   " (a sequence's tokens must have consecutive positions)");
      ++s.runs.back().n;
      continue;
    }
    if (sid < 0 || sid >= cp.n_seq)
      fail_input("[model] sequence id " + std::to_string(sid) + " at batch index " + std::to_string(t) +
                 " is outside the cache's [0, " + std::to_string(cp.n_seq) + ")");
    for (const seq_run& r : s.runs)
      if (r.seq_id == sid)
        fail_input("[model] sequence " + std::to_string(sid) + " appears in two runs of the batch (indices " +
                   std::to_string(r.t0) + " and " + std::to_string(t) + "); a sequence's tokens must be contiguous");
    if (cache.n_pos(sid) != b.pos[t])
      fail_input("[model] cache holds " + std::to_string(cache.n_pos(sid)) + " positions of sequence " +
                 std::to_string(sid) + " but the batch starts at position " + std::to_string(b.pos[t]));
    s.runs.push_back(seq_run{sid, b.pos[t], (int)t, 1});
  }
  for (const seq_run& r : s.runs) {
    if ((int64_t)r.pos0 + r.n > cp.n_ctx)
      fail_input("[model] sequence " + std::to_string(r.seq_id) + " would hold " + std::to_string((int64_t)r.pos0 + r.n) +
                 " positions, more than the cache's n_ctx " + std::to_string(cp.n_ctx));
  }
  // The cache applies the sliding windows (kv_cache_params::layers, set by cache_params): one made
  // without them would attend globally where the model attends over a window.
  for (int il = 0; il < hp.n_layer; ++il) {
    const int w = hp.layers[il].window, cw = cp.layers.empty() ? 0 : cp.layers[il].window;
    if (w != cw)
      fail_input("[model] layer " + std::to_string(il) + " of " + hp.arch + " attends over a sliding window of " +
                 std::to_string(w) + " tokens but the KV cache's layer has window " + std::to_string(cw) +
                 " (make the cache's params with model::cache_params)");
  }
  s.out_rows.clear();
  if (b.output.empty()) {
    for (const seq_run& r : s.runs) s.out_rows.push_back(r.t0 + r.n - 1);
  } else {
    for (int64_t t = 0; t < n; ++t)
      if (b.output[t]) s.out_rows.push_back((int32_t)t);
  }
  s.reserve(n, hp);
  const graph_ctx g{hp, b, s.runs, s.out_rows, cache, pool, s, observer_};
  arch_->forward(g, logits);
  return (int)s.out_rows.size();
}

void model::forward(std::span<const int32_t> tokens, int pos0, int seq_id, kv_cache& cache, thread_pool& pool,
                    float* logits, bool all_logits) {
  const size_t n = tokens.size();
  all_pos_.resize(n);
  all_seq_.assign(n, seq_id);
  all_out_.assign(n, all_logits ? 1 : 0);
  for (size_t t = 0; t < n; ++t) all_pos_[t] = pos0 + (int32_t)t;
  if (n > 0) all_out_[n - 1] = 1;
  forward(model_batch{tokens, all_pos_, all_seq_, all_out_}, cache, pool, logits);
}

}  // namespace kvq
