#include "model/graph.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "kvq/error.h"
#include "model/ops.h"

namespace kvq {

void graph_scratch::reserve(int64_t n, const model_hparams& hp) {
  if (n <= cap) return;
  cap = n;
  const int64_t dq = (int64_t)hp.n_head * hp.head_dim, dkv = (int64_t)hp.n_kv_head * hp.head_dim;
  x.resize(n * hp.n_embd);
  h.resize(n * hp.n_embd);
  o.resize(n * hp.n_embd);
  q.resize(n * dq);
  attn.resize(n * dq);
  k.resize(n * dkv);
  v.resize(n * dkv);
  gate.resize(n * hp.n_ff);
  up.resize(n * hp.n_ff);
  act.resize(n * hp.n_ff);
  rope_cs.resize(n * hp.n_rot);
}

namespace build {

rope_table make_rope(const model_hparams& hp, const layer_hparams& lp, std::span<const float> factors) {
  rope_table r;
  r.n_rot = hp.n_rot;
  r.neox = hp.rope == rope_type::neox;
  const int half = hp.n_rot / 2;
  r.inv_freq.resize(half);
  const float theta_scale = std::pow(lp.rope_freq_base, -2.0f / (float)hp.n_rot);
  float th = lp.rope_freq_scale;
  for (int i = 0; i < half; ++i) {
    r.inv_freq[i] = factors.empty() ? th : th / factors[i];
    th *= theta_scale;
  }
  return r;
}

void embed(const graph_ctx& g, const weight_view& tok_embd, float scale, float* x) {
  const int64_t E = g.hp.n_embd, n = g.n_tokens();
  for (int64_t t = 0; t < n; ++t) {
    float* row = x + t * E;
    weight_row_to_f32(tok_embd, g.batch.tokens[t], row);
    if (scale != 1.0f)
      for (int64_t i = 0; i < E; ++i) row[i] *= scale;
  }
}

namespace {

void add_serial(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// The element-wise ops below run on the pool in blocks of this many elements: at 14 threads the
// per-token ops left on the calling thread (SwiGLU's exp, RoPE's sin / cos, norms) took a third
// of a 128-token step (perf: 3.5 % of a one-thread step, against matmuls that the pool divides).
constexpr int64_t kElemBlock = 2048;

// fn(i0, m) for the blocks [i0, i0 + m) of [0, n), over the pool when `work` pays for it.
template <class F>
void for_blocks(thread_pool& pool, int64_t n, int64_t work, const F& fn) {
  pool.parallel_for((n + kElemBlock - 1) / kElemBlock, work, [&](int64_t b, int) {
    const int64_t i0 = b * kElemBlock;
    fn(i0, std::min(kElemBlock, n - i0));
  });
}

}  // namespace

void norm(thread_pool& pool, const float* x, const float* w, int64_t n_rows, int64_t n, float eps, float* out) {
  pool.parallel_for(n_rows, n_rows * n * 4,
                    [&](int64_t r, int) { ops::rms_norm(x + r * n, w, n, eps, out + r * n); });
}

void add(thread_pool& pool, float* x, const float* y, int64_t n) {
  for_blocks(pool, n, n, [&](int64_t i0, int64_t m) { add_serial(x + i0, y + i0, m); });
}

void check_finite(const graph_ctx& g, const float* x, int64_t n, const char* what, int il) {
  std::atomic<bool> finite{true};
  for_blocks(g.pool, n, n, [&](int64_t i0, int64_t m) {
    if (!ops::all_finite(x + i0, m)) finite.store(false, std::memory_order_relaxed);
  });
  if (finite.load()) return;
  std::string where = "position " + std::to_string(g.runs[0].pos0) + " of sequence " + std::to_string(g.runs[0].seq_id);
  if (g.runs.size() > 1) where += " (and " + std::to_string(g.runs.size() - 1) + " more sequences)";
  fail_input(std::string("[model] non-finite activation (NaN/Inf) in ") + what + " of layer " + std::to_string(il) +
             " for the batch starting at " + where);
}

void attention(const graph_ctx& g, int il, const attn_weights& w, const float* h, float* out) {
  const model_hparams& hp = g.hp;
  graph_scratch& s = g.s;
  const int64_t n = g.n_tokens(), D = hp.head_dim;
  const int64_t dq = (int64_t)hp.n_head * D, dkv = (int64_t)hp.n_kv_head * D;
  matmul(*w.wq, h, n, s.q.data(), g.pool);  // [n, n_head * head_dim]
  matmul(*w.wk, h, n, s.k.data(), g.pool);  // [n, n_kv_head * head_dim]
  matmul(*w.wv, h, n, s.v.data(), g.pool);
  const int n_rot = w.rope->n_rot;
  // bias, QK-norm and RoPE of each token (its angles once for all heads), tokens over the pool
  g.pool.parallel_for(n, n * (dq + dkv) * 8, [&](int64_t t, int) {
    float* q = &s.q[t * dq];
    float* k = &s.k[t * dkv];
    if (w.bq) {
      float* v = &s.v[t * dkv];
      add_serial(q, w.bq, dq);
      add_serial(k, w.bk, dkv);
      add_serial(v, w.bv, dkv);
    }
    float* cs = &s.rope_cs[t * n_rot];
    ops::rope_angles(n_rot, w.rope->inv_freq.data(), g.batch.pos[t], cs);
    for (int hh = 0; hh < hp.n_head; ++hh) {
      if (w.q_norm) ops::rms_norm(q + hh * D, w.q_norm, D, hp.rms_eps, q + hh * D);
      ops::rope_apply(q + hh * D, n_rot, cs, w.rope->neox);
    }
    for (int hh = 0; hh < hp.n_kv_head; ++hh) {
      if (w.k_norm) ops::rms_norm(k + hh * D, w.k_norm, D, hp.rms_eps, k + hh * D);
      ops::rope_apply(k + hh * D, n_rot, cs, w.rope->neox);
    }
  });
  check_finite(g, s.k.data(), n * dkv, "K", il);
  check_finite(g, s.v.data(), n * dkv, "V", il);
  check_finite(g, s.q.data(), n * dq, "Q", il);
  s.seqs.resize(g.runs.size());
  for (size_t r = 0; r < g.runs.size(); ++r) {
    const seq_run& run = g.runs[r];
    const float* q = &s.q[run.t0 * dq];
    const float* k = &s.k[run.t0 * dkv];
    const float* v = &s.v[run.t0 * dkv];
    if (g.observer) g.observer(il, run.pos0, run.n, q, k, v);
    g.cache.append(il, run.seq_id, run.n, k, v);
    s.seqs[r] = attend_seq{run.seq_id, run.pos0, run.n, q, &s.attn[run.t0 * dq]};
  }
  g.cache.attend_batch(il, s.seqs.data(), (int)s.seqs.size(), hp.n_head, hp.attn_scale, g.pool);
  matmul(*w.wo, s.attn.data(), n, out, g.pool);
}

void ffn(const graph_ctx& g, const ffn_weights& w, const float* h, float* out) {
  graph_scratch& s = g.s;
  const int64_t n = g.n_tokens(), F = g.hp.n_ff;
  matmul(*w.gate, h, n, s.gate.data(), g.pool);  // [n, n_ff]
  matmul(*w.up, h, n, s.up.data(), g.pool);
  const int64_t nf = n * F;
  for_blocks(g.pool, nf, nf * 16, [&](int64_t i0, int64_t m) {
    if (w.type == ffn_type::geglu)
      ops::geglu_tanh(s.gate.data() + i0, s.up.data() + i0, m, s.act.data() + i0);
    else
      ops::swiglu(s.gate.data() + i0, s.up.data() + i0, m, s.act.data() + i0);
  });
  matmul(*w.down, s.act.data(), n, out, g.pool);
}

void output(const graph_ctx& g, const float* x, const float* norm_w, const weight_view& w_out, float* logits) {
  const model_hparams& hp = g.hp;
  const int64_t E = hp.n_embd, n_out = (int64_t)g.out_rows.size();
  float* h = g.s.h.data();  // [n_out, n_embd] (n_out <= n)
  for (int64_t r = 0; r < n_out; ++r) ops::rms_norm(x + g.out_rows[r] * E, norm_w, E, hp.rms_eps, h + r * E);
  matmul(w_out, h, n_out, logits, g.pool);
  if (hp.final_logit_softcap > 0.0f) {
    const float c = hp.final_logit_softcap;
    for (int64_t i = 0; i < n_out * hp.n_vocab; ++i) logits[i] = c * std::tanh(logits[i] / c);
  }
}

}  // namespace build
}  // namespace kvq
