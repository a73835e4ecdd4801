// kvq.KVCache: kvq's KV cache (include/kvq/kv_cache.h) over numpy arrays and torch CPU tensors.
// Arrays come in through nanobind's ndarray (the buffer protocol or DLPack), so a C-contiguous
// float32 array is read in place; any other strides are gathered into one contiguous copy.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "kvq/error.h"
#include "kvq/thread_pool.h"

namespace kvq::py {
namespace {

using array_in = nb::ndarray<nb::ro>;  // any dtype, device, shape: checked below for the messages

struct py_kv_cache {
  std::unique_ptr<kv_cache> c;
  thread_pool pool;
  std::mutex mu;  // one call at a time per cache (kv_cache's rule), held without the GIL
  py_kv_cache(const kv_cache_params& p, int n_threads) : c(make_kv_cache(p)), pool(n_threads) {}
};

std::string shape_str(const array_in& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// A [n_tokens, n_heads, head_dim] float32 CPU array: its data when C-contiguous, else a contiguous
// copy in `copy`. n_heads < 0: any multiple of `head_multiple` (queries, GQA). Errors name the
// argument: TypeError for dtype / device, ValueError for the shape.
const float* rows_3d(const char* op, const char* arg, const array_in& a, int n_heads, int head_multiple, int head_dim,
                     std::vector<float>& copy) {
  const std::string tag = std::string("[KVCache.") + op + "] " + arg + ": ";
  if (a.device_type() != nb::device::cpu::value)
    throw nb::type_error((tag + "must be on the CPU (numpy array or torch CPU tensor)").c_str());
  if (a.dtype() != nb::dtype<float>()) {
    const auto d = a.dtype();
    const char* kind = d.code == (uint8_t)nb::dlpack::dtype_code::Float ? "float"
                       : d.code == (uint8_t)nb::dlpack::dtype_code::Int ? "int"
                       : d.code == (uint8_t)nb::dlpack::dtype_code::UInt ? "uint"
                       : d.code == (uint8_t)nb::dlpack::dtype_code::Bfloat ? "bfloat" : "other";
    throw nb::type_error((tag + "dtype " + kind + std::to_string(d.bits) +
                          ", expected float32 (convert with .astype(numpy.float32) or .float())")
                             .c_str());
  }
  const std::string want = n_heads > 0 ? "(n_tokens, " + std::to_string(n_heads) + ", " + std::to_string(head_dim) + ")"
                                       : "(n_tokens, n_head, " + std::to_string(head_dim) + ") with n_head a multiple of " +
                                             std::to_string(head_multiple);
  const bool ok = a.ndim() == 3 && a.shape(0) >= 1 && a.shape(2) == (size_t)head_dim &&
                  (n_heads > 0 ? a.shape(1) == (size_t)n_heads
                               : a.shape(1) >= (size_t)head_multiple && a.shape(1) % head_multiple == 0);
  if (!ok) throw nb::value_error((tag + "expected shape " + want + ", got " + shape_str(a)).c_str());
  const size_t n0 = a.shape(0), n1 = a.shape(1), n2 = a.shape(2);
  const float* src = static_cast<const float*>(a.data());
  if (a.stride(2) == 1 && a.stride(1) == (int64_t)n2 && (n0 == 1 || a.stride(0) == (int64_t)(n1 * n2))) return src;
  copy.resize(n0 * n1 * n2);
  for (size_t i = 0; i < n0; ++i)
    for (size_t j = 0; j < n1; ++j)
      for (size_t t = 0; t < n2; ++t)
        copy[(i * n1 + j) * n2 + t] = src[i * a.stride(0) + j * a.stride(1) + t * a.stride(2)];
  return copy.data();
}

}  // namespace

void bind_kv_cache(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<py_kv_cache>(
      m, "KVCache",
      "kvq's KV cache for n_layer layers of n_kv_head heads of head_dim, n_ctx positions per sequence, K and V "
      "stored in type_k / type_v (compressed formats attend on the compressed form). Cache options as "
      "Model.generate's keyword arguments (type_k='q4', type_v, rotation, group_size, sink, recent, ...). "
      "ValueError (kvq's message) for invalid shapes or options.")
      .def(
          "__init__",
          [](py_kv_cache* self, int n_layer, int n_kv_head, int head_dim, int n_ctx, int n_seq, int n_threads,
             const nb::kwargs& kw) {
            kv_cache_params p = cache_options(kw, "KVCache");
            p.n_layer = n_layer;
            p.n_kv_head = n_kv_head;
            p.head_dim = head_dim;
            p.n_ctx = n_ctx;
            p.n_seq = n_seq;
            new (self) py_kv_cache(p, n_threads);
          },
          "n_layer"_a, "n_kv_head"_a, "head_dim"_a, "n_ctx"_a, nb::kw_only(), "n_seq"_a = 1, "n_threads"_a = 0,
          "cache"_a)
      .def(
          "append",
          [](py_kv_cache& s, int layer, const array_in& k, const array_in& v, int seq_id) {
            const kv_cache_params& p = s.c->params();
            std::vector<float> kc, vc;
            const float* kp = rows_3d("append", "k", k, p.n_kv_head, 0, p.head_dim, kc);
            const float* vp = rows_3d("append", "v", v, p.n_kv_head, 0, p.head_dim, vc);
            if (k.shape(0) != v.shape(0))
              throw nb::value_error(("[KVCache.append] k and v: different n_tokens, " + std::to_string(k.shape(0)) +
                                     " and " + std::to_string(v.shape(0)))
                                        .c_str());
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(s.mu);
            s.c->append(layer, seq_id, (int)k.shape(0), kp, vp);
          },
          "layer"_a, "k"_a, "v"_a, "seq_id"_a = 0,
          "Appends n_tokens positions to `layer`: k, v float32 [n_tokens, n_kv_head, head_dim] (K after RoPE). Every "
          "layer must receive the same tokens; n_pos() advances when the last layer has. TypeError for a dtype "
          "other than float32 or a non-CPU tensor, ValueError for a shape, a layer or seq_id out of range, or "
          "positions past n_ctx.")
      .def(
          "attend",
          [](py_kv_cache& s, int layer, const array_in& q, int pos0, std::optional<float> scale_opt, int seq_id) {
            const kv_cache_params& p = s.c->params();
            std::vector<float> qc;
            const float* qp = rows_3d("attend", "q", q, -1, p.n_kv_head, p.head_dim, qc);
            const float scale = scale_opt ? *scale_opt : 1.0f / std::sqrt((float)p.head_dim);
            const size_t n_tokens = q.shape(0), n_head = q.shape(1), n = n_tokens * n_head * p.head_dim;
            auto* out = new float[n];
            nb::capsule owner(out, [](void* o) noexcept { delete[] static_cast<float*>(o); });
            {
              nb::gil_scoped_release release;
              std::lock_guard<std::mutex> lock(s.mu);
              s.c->attend(layer, seq_id, pos0, (int)n_tokens, (int)n_head, qp, scale, out, s.pool);
            }
            return nb::ndarray<nb::numpy, float, nb::ndim<3>>(out, {n_tokens, n_head, (size_t)p.head_dim}, owner);
          },
          "layer"_a, "q"_a, "pos0"_a, "scale"_a = nb::none(), "seq_id"_a = 0,
          "Causal attention of `layer`: query t of q (float32 [n_tokens, n_head, head_dim], after RoPE; n_head a "
          "multiple of n_kv_head, GQA) sits at position pos0 + t and attends to positions [0, pos0 + t], which "
          "must be appended. scale: default 1/sqrt(head_dim). Returns a numpy float32 array [n_tokens, n_head, "
          "head_dim]. Errors as append(); ValueError when the positions are not in the cache.")
      .def(
          "attend_batch",
          [](py_kv_cache& s, int layer, const std::vector<array_in>& qs, const std::vector<int>& pos0,
             std::optional<float> scale_opt, std::optional<std::vector<int>> seq_ids_opt) {
            const kv_cache_params& p = s.c->params();
            const size_t n = qs.size();
            if (pos0.size() != n)
              throw nb::value_error(("[KVCache.attend_batch] pos0: " + std::to_string(pos0.size()) +
                                     " positions for " + std::to_string(n) + " query arrays")
                                        .c_str());
            if (seq_ids_opt && seq_ids_opt->size() != n)
              throw nb::value_error(("[KVCache.attend_batch] seq_ids: " + std::to_string(seq_ids_opt->size()) +
                                     " ids for " + std::to_string(n) + " query arrays")
                                        .c_str());
            std::vector<std::vector<float>> copies(n);
            std::vector<attend_seq> seqs(n);
            std::vector<nb::ndarray<nb::numpy, float, nb::ndim<3>>> outs;
            size_t n_head = 0;
            for (size_t i = 0; i < n; ++i) {
              const std::string arg = "q[" + std::to_string(i) + "]";
              seqs[i].q = rows_3d("attend_batch", arg.c_str(), qs[i], -1, p.n_kv_head, p.head_dim, copies[i]);
              if (i == 0) n_head = qs[i].shape(1);
              if (qs[i].shape(1) != n_head)
                throw nb::value_error(("[KVCache.attend_batch] " + arg + ": n_head " + std::to_string(qs[i].shape(1)) +
                                       ", q[0] has " + std::to_string(n_head) + " (one n_head per call)")
                                          .c_str());
              const size_t n_tokens = qs[i].shape(0), elems = n_tokens * n_head * p.head_dim;
              auto* out = new float[elems];
              nb::capsule owner(out, [](void* o) noexcept { delete[] static_cast<float*>(o); });
              outs.emplace_back(out, std::initializer_list<size_t>{n_tokens, n_head, (size_t)p.head_dim}, owner);
              seqs[i].out = out;
              seqs[i].n_tokens = (int)n_tokens;
              seqs[i].pos0 = pos0[i];
              seqs[i].seq_id = seq_ids_opt ? (*seq_ids_opt)[i] : (int)i;
            }
            const float scale = scale_opt ? *scale_opt : 1.0f / std::sqrt((float)p.head_dim);
            if (n > 0) {
              nb::gil_scoped_release release;
              std::lock_guard<std::mutex> lock(s.mu);
              s.c->attend_batch(layer, seqs.data(), (int)n, (int)n_head, scale, s.pool);
            }
            return outs;
          },
          "layer"_a, "q"_a, "pos0"_a, "scale"_a = nb::none(), "seq_ids"_a = nb::none(),
          "attend() for several sequences of `layer` in one call (one decode step or prefill chunk of a batch), "
          "each as if attended alone (the same outputs bit for bit), threaded over sequences and heads together. "
          "q: a list of float32 [n_tokens_i, n_head, head_dim] arrays (n_tokens may differ, n_head may not); "
          "pos0: the position of each list entry's first query; seq_ids: the sequence of each entry (default "
          "0, 1, ...; each at most once). Returns a list of numpy float32 arrays [n_tokens_i, n_head, head_dim]. "
          "Errors as attend(); ValueError for list lengths that differ or a seq_id given twice.")
      .def("n_pos", [](const py_kv_cache& s, int seq_id) { return s.c->n_pos(seq_id); }, "seq_id"_a = 0,
           "Positions stored for seq_id (all layers).")
      .def(
          "truncate",
          [](py_kv_cache& s, int n, int seq_id) {
            if (n < 0 || n > s.c->n_pos(seq_id))
              fail_input("[KVCache.truncate] n " + std::to_string(n) + " must be in [0, n_pos " +
                         std::to_string(s.c->n_pos(seq_id)) + "]");
            s.c->truncate(seq_id, n);
          },
          "n"_a, "seq_id"_a = 0, "Keeps positions [0, n) of seq_id. ValueError when n is outside [0, n_pos()].")
      .def("clear", [](py_kv_cache& s, int seq_id) { s.c->clear(seq_id); }, "seq_id"_a = 0,
           "Forgets every position of seq_id.")
      .def("bytes_used", [](const py_kv_cache& s) { return s.c->bytes_used(); },
           "Bytes holding the stored positions (all layers, K and V).")
      .def("bytes", [](const py_kv_cache& s) { return s.c->bytes(); }, "Bytes allocated (all layers, K and V).")
      .def_prop_ro("n_layer", [](const py_kv_cache& s) { return s.c->params().n_layer; })
      .def_prop_ro("n_kv_head", [](const py_kv_cache& s) { return s.c->params().n_kv_head; })
      .def_prop_ro("head_dim", [](const py_kv_cache& s) { return s.c->params().head_dim; })
      .def_prop_ro("n_ctx", [](const py_kv_cache& s) { return s.c->params().n_ctx; })
      .def_prop_ro("n_seq", [](const py_kv_cache& s) { return s.c->params().n_seq; })
      .def("describe", [](const py_kv_cache& s) { return s.c->describe(); },
           "The formats, e.g. 'K q4 (hadamard, g32) / V q4 (hadamard, g32)'.")
      .def("__repr__", [](const py_kv_cache& s) {
        const kv_cache_params& p = s.c->params();
        return "kvq.KVCache(n_layer=" + std::to_string(p.n_layer) + ", n_kv_head=" + std::to_string(p.n_kv_head) +
               ", head_dim=" + std::to_string(p.head_dim) + ", n_ctx=" + std::to_string(p.n_ctx) + ": " +
               s.c->describe() + ")";
      });
}

}  // namespace kvq::py
