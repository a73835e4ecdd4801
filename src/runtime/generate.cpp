#include "kvq/generate.h"

#include <algorithm>
#include <chrono>

#include "kvq/error.h"
#include "runtime/forward_engine.h"

namespace kvq {

int resolve_n_ctx(const model& m, int n_ctx, const char* op) {
  const int train = m.hparams().n_ctx_train;
  const std::string tag = std::string("[") + op + "] ";
  if (n_ctx < 0) fail_input(tag + "context size -c " + std::to_string(n_ctx) + " must be >= 0");
  if (n_ctx == 0) return std::min(train, 4096);
  if (n_ctx > train)
    fail_input(tag + "context size -c " + std::to_string(n_ctx) + " exceeds the model's training context " +
               std::to_string(train) + " (" + m.hparams().arch + ".context_length)");
  return n_ctx;
}

generate_result generate(model& m, const tokenizer& tok, const generate_params& p,
                         const std::function<void(const std::string&)>& on_piece) {
  using clock = std::chrono::steady_clock;
  generate_result r;
  if (p.n_predict < -1)
    fail_input("[generate] -n " + std::to_string(p.n_predict) + " must be >= -1 (-1: until end of generation)");
  if (p.n_batch <= 0) fail_input("[generate] batch size " + std::to_string(p.n_batch) + " must be > 0");
  r.n_ctx = resolve_n_ctx(m, p.n_ctx);

  kv_cache_params cp = m.cache_params(r.n_ctx, p.cache);
  cp.n_ubatch = std::max(cp.n_ubatch, p.n_batch);  // sliding-window layers' rings hold one prompt batch
  // The CPU engine with a kv_cache, or (--device cuda) the model and its cache on the GPU; either
  // validates before any work.
  forward_engine eng(m, cp, p.device, std::min(p.n_batch, r.n_ctx));

  r.prompt_ids = tok.encode(p.prompt, p.add_bos && tok.add_bos_default(), /*parse_special=*/true);
  if (r.prompt_ids.empty())  // an empty prompt is BOS alone (as llama.cpp), when the model adds BOS
    fail_input(p.prompt.empty() ? "[generate] the prompt is empty and this model adds no BOS token (give one with -p)"
                                : "[generate] the prompt tokenized to zero tokens");
  if ((int)r.prompt_ids.size() > r.n_ctx)
    fail_input("[generate] the prompt has " + std::to_string(r.prompt_ids.size()) +
               " tokens, more than the context size " + std::to_string(r.n_ctx) + " (raise -c)");
  // A generated token takes the position after the prompt: a prompt that fills the context leaves
  // it none (the server's context_length_exceeded); -n 0 only prefills.
  if ((int)r.prompt_ids.size() == r.n_ctx && p.n_predict != 0)
    fail_input("[generate] the prompt has " + std::to_string(r.prompt_ids.size()) +
               " tokens, which fill the context size " + std::to_string(r.n_ctx) +
               " and leave no position for a generated token (raise -c)");

  sampler smp(p.sampling);
  r.seed = smp.seed();
  thread_pool pool(p.n_threads);
  const int n_vocab = m.hparams().n_vocab;
  std::vector<float> logits(n_vocab);

  const auto t0 = clock::now();
  const int n_prompt = (int)r.prompt_ids.size();
  for (int i = 0; i < n_prompt; i += p.n_batch) {
    const int nb = std::min(p.n_batch, n_prompt - i);
    const std::span<const int32_t> batch(r.prompt_ids.data() + i, nb);
    eng.forward(batch, i, {}, logits.data(), pool);
  }
  const auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  int pos = n_prompt;
  r.stop_reason = "n_predict";
  for (int i = 0; p.n_predict < 0 || i < p.n_predict; ++i) {
    const int32_t id = smp.sample(logits.data(), n_vocab);
    if (!p.ignore_eos && tok.is_eog(id)) { r.stop_reason = "eog"; break; }
    r.ids.push_back(id);
    if (on_piece) on_piece(tok.token_to_piece(id));
    if (p.n_predict >= 0 && i + 1 == p.n_predict) break;  // no forward needed for the last token
    // this token takes position pos; when that is the context's last, a next token would have none
    // (prompt + generated tokens never exceed n_ctx, as the server's usage)
    if (pos + 1 >= r.n_ctx) {
      r.stop_reason = "context_full";
      break;
    }
    eng.forward(std::span<const int32_t>(&id, 1), pos, {}, logits.data(), pool);
    ++pos;
  }
  const auto t2 = clock::now();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.text = tok.decode(r.ids);
  r.prefill_tokens_per_s = r.prefill_seconds > 0 ? n_prompt / r.prefill_seconds : 0;
  // Decode steps = forwards after the prompt (the last sampled token needs none).
  const int n_steps = std::max(0, pos - n_prompt);
  r.decode_tokens_per_s = r.decode_seconds > 0 ? n_steps / r.decode_seconds : 0;
  r.kv_bytes = eng.kv_bytes();
  r.kv_bytes_used = eng.kv_bytes_used();
  r.kv_bytes_per_token = kv_bytes_per_token(cp);
  kv_cache_params f16 = cp;
  f16.type_k = f16.type_v = kv_cache_type::f16;
  r.kv_bytes_per_token_f16 = kv_bytes_per_token(f16);
  r.kv_describe = eng.describe();
  r.attn_tier = eng.attn_tier();
  if (kv_cache* cache = eng.cpu_cache()) append_certified_report(*cache, r.certified);
  return r;
}

}  // namespace kvq
