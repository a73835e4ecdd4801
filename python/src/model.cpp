// kvq.Model: a GGUF model with its tokenizer; generate, tokenize / detokenize and perplexity as
// the CLI's commands (tools/cmd_generate.cpp, cmd_tokenize.cpp, cmd_perplexity.cpp) compute them,
// with the figures of their --json output.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bindings.h"
#include "result_json.h"  // tools/: the CLI's --json objects
#include "kvq/error.h"
#include "kvq/generate.h"
#include "kvq/model.h"
#include "kvq/perplexity.h"
#include "kvq/tokenizer.h"

namespace kvq::py {
namespace {

struct py_model {
  std::string path;
  std::unique_ptr<model> m;
  std::unique_ptr<tokenizer> tok;
  std::mutex mu;  // one forward at a time (the model keeps scratch buffers)

  explicit py_model(const std::string& p) : path(p) {
    nb::gil_scoped_release release;
    m = model::load(p);
    tok = tokenizer::from_gguf(m->gguf());
  }
};

// Between tokens (and perplexity chunks) the GIL is taken back to check for signals, so Ctrl-C
// raises KeyboardInterrupt within one token; on_token(piece_bytes) is called there too. An
// exception either raises stops the engine and propagates (kvq.Model.stream stops this way when
// it is closed early).
void check_signals() {
  if (PyErr_CheckSignals() != 0) throw nb::python_error();
}

// A dict of the CLI's --json object (tools/result_json.h: the same code builds both); text that
// is not valid UTF-8 (a piece that splits a character) becomes U+FFFD, as in the CLI's output.
nb::dict to_dict(const nlohmann::json& j) {
  nb::object loads = nb::module_::import_("json").attr("loads");
  return nb::cast<nb::dict>(loads(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)));
}

nb::object run_generate(py_model& self, const std::string& prompt, int max_tokens, float temperature, int top_k,
                        float top_p, float min_p, int64_t seed, int n_ctx, int n_batch, int n_threads, bool ignore_eos,
                        bool add_bos, bool details, nb::object on_token, const nb::kwargs& cache) {
  const generate_params p{.prompt = prompt,
                          .n_predict = max_tokens,
                          .n_ctx = n_ctx,
                          .n_batch = n_batch,
                          .n_threads = n_threads,
                          .add_bos = add_bos,
                          .ignore_eos = ignore_eos,
                          .sampling = {.temp = temperature,
                                       .top_k = top_k,
                                       .top_p = top_p,
                                       .min_p = min_p,
                                       .seed = sampling_seed(seed)},  // any int64, as the CLI and server
                          .cache = cache_options(cache, "generate", true)};
  generate_result r;
  {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mu);
    const bool has_on_token = on_token.is_valid() && !on_token.is_none();
    r = generate(*self.m, *self.tok, p, [&](const std::string& piece) {
      nb::gil_scoped_acquire acquire;
      check_signals();
      if (has_on_token) on_token(nb::bytes(piece.data(), piece.size()));
    });
  }
  if (!details) return utf8_str(r.text);
  return to_dict(cli::generate_json(self.path, p, r));  // the keys of `kvq generate --json`
}

nb::dict run_perplexity(py_model& self, const std::string& text, int n_ctx, int chunks, int n_batch, int n_threads,
                        nb::object compare, const std::string& kl_base, const std::string& kl_compare, int kl_top_k,
                        const nb::kwargs& cache) {
  perplexity_params p{.n_ctx = n_ctx,
                      .n_batch = n_batch,
                      .n_chunks = chunks,
                      .n_threads = n_threads,
                      .cache = cache_options(cache, "perplexity", true),
                      .kl_base_in = kl_compare,
                      .compare_type = std::nullopt,  // set below
                      .kl_base_out = kl_base,
                      .kl_top_k = kl_top_k};
  if (!compare.is_none()) {
    if (!nb::isinstance<nb::str>(compare))
      throw nb::type_error("perplexity(): compare must be a cache type name (str) or None");
    p.compare_type = parse_kv_cache_type(nb::cast<std::string>(compare));
  }
  perplexity_result r;
  {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mu);
    perplexity_check(*self.m, p);
    const auto ids = perplexity_tokenize(*self.tok, text);
    r = perplexity(*self.m, ids, perplexity_bos(*self.tok), p, [](int, int, int64_t, double) {
      nb::gil_scoped_acquire acquire;
      check_signals();
    });
  }
  return to_dict(cli::perplexity_json(self.path, p, r));  // `kvq perplexity --json` less "text" (the file name)
}

}  // namespace

void bind_model(nb::module_& m) {
  using namespace nb::literals;
  const generate_params gp;
  const perplexity_params pp;
  nb::class_<py_model>(m, "Model",
                       "A GGUF model and its tokenizer (kvq::model::load, tokenizer::from_gguf). Errors: OSError "
                       "when the file cannot be opened, ValueError for a malformed or unsupported file.")
      .def(nb::init<const std::string&>(), "path"_a)
      .def_ro("path", &py_model::path)
      .def_prop_ro("arch", [](const py_model& s) { return s.m->hparams().arch; })
      .def_prop_ro("n_vocab", [](const py_model& s) { return s.m->hparams().n_vocab; })
      .def_prop_ro("n_layer", [](const py_model& s) { return s.m->hparams().n_layer; })
      .def_prop_ro("n_head", [](const py_model& s) { return s.m->hparams().n_head; })
      .def_prop_ro("n_kv_head", [](const py_model& s) { return s.m->hparams().n_kv_head; })
      .def_prop_ro("head_dim", [](const py_model& s) { return s.m->hparams().head_dim; })
      .def_prop_ro("n_ctx_train", [](const py_model& s) { return s.m->hparams().n_ctx_train; })
      .def_prop_ro("bos", [](const py_model& s) { return s.tok->bos(); })
      .def_prop_ro("eos", [](const py_model& s) { return s.tok->eos(); })
      .def(
          "tokenize",
          [](const py_model& s, const std::string& text, bool add_bos, bool parse_special) {
            return s.tok->encode(text, add_bos && s.tok->add_bos_default(), parse_special);
          },
          "text"_a, "add_bos"_a = true, "parse_special"_a = true,
          "Token ids of `text`, as `kvq tokenize` (add_bos=False: --no-bos; parse_special=False: "
          "--no-parse-special).")
      .def(
          "detokenize", [](const py_model& s, const std::vector<int32_t>& ids) { return utf8_str(s.tok->decode(ids)); },
          "ids"_a,
          "The text of `ids` (tokenizer::decode: concatenated pieces, control tokens empty). ValueError for "
          "an id outside [0, n_vocab).")
      .def("generate", &run_generate, "prompt"_a, "max_tokens"_a = gp.n_predict, "temperature"_a = 0.0f,
           "top_k"_a = gp.sampling.top_k, "top_p"_a = gp.sampling.top_p, "min_p"_a = gp.sampling.min_p,
           "seed"_a = -1, "n_ctx"_a = gp.n_ctx, "n_batch"_a = gp.n_batch, "n_threads"_a = gp.n_threads,
           "ignore_eos"_a = gp.ignore_eos, "add_bos"_a = gp.add_bos, "details"_a = false,
           "on_token"_a = nb::none(), "cache"_a,
           "Generates up to max_tokens tokens after `prompt` as `kvq generate` does (greedy by default: "
           "temperature 0; the CLI's --temp default is 0.8; seed: any 64-bit integer as the CLI's --seed, -1: "
           "random) and returns the generated text, or with details=True "
           "the dict of `kvq generate --json` (ids, text, stop_reason, speeds, KV bytes). Cache options as "
           "keyword arguments spelled as the CLI's flags: type_k='q4' (-ctk), type_v (-ctv), rotation (--kv-rot), "
           "group_size (--kv-group), sink (--kv-sink), recent (--kv-exact-recent), kivi_group, kivi_residual, "
           "channel_scale, k_channel_scale, channel_calib, kv_seed, certify, certify_tol, certify_budget, host_dir, "
           "certify_measure, certify_adapt. on_token(piece: bytes) is called for each generated token. Errors: ValueError "
           "(kvq's message) for bad values, TypeError for unknown options.")
      .def("perplexity", &run_perplexity, "text"_a, "n_ctx"_a = pp.n_ctx, "chunks"_a = pp.n_chunks,
           "n_batch"_a = pp.n_batch, "n_threads"_a = pp.n_threads, "compare"_a = nb::none(),
           "kl_base"_a = std::string(), "kl_compare"_a = std::string(), "kl_top_k"_a = pp.kl_top_k, "cache"_a,
           "Perplexity of `text` with llama.cpp's protocol, as `kvq perplexity` (n_ctx: -c, chunks: --chunks, "
           "compare: --compare TYPE, kl_base: --kl-base FILE, kl_compare: --kl-compare FILE); returns the dict of "
           "its --json output (ppl, ppl_err, nll_mean, n_scored, ..., and 'kld' with a base). Cache options as "
           "generate().");
}

}  // namespace kvq::py
