// kvq._kvq: the module, kvq's errors as Python exceptions, and the cache options.
#include <Python.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "kvq/error.h"

namespace kvq::py {

nb::str utf8_str(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "replace");
  if (!o) throw nb::python_error();
  return nb::steal<nb::str>(o);
}

namespace {

const char* const option_names[] = {"type_k", "type_v", "rotation", "group_size", "sink", "recent",
                                    "kivi_group", "kivi_residual", "channel_scale", "k_channel_scale",
                                    "channel_calib", "kv_seed", "certify", "certify_tol", "certify_budget",
                                    "host_dir", "certify_measure", "certify_adapt"};

std::string py_type_name(nb::handle v) { return nb::cast<std::string>(nb::str(v.type().attr("__name__"))); }

[[noreturn]] void fail_type(const char* op, const std::string& key, const char* expected, nb::handle v) {
  throw nb::type_error((std::string(op) + "(): cache option " + key + " must be " + expected + ", got " +
                        py_type_name(v))
                           .c_str());
}

std::string as_str(const char* op, const std::string& key, nb::handle v) {
  if (!nb::isinstance<nb::str>(v)) fail_type(op, key, "a str", v);
  return nb::cast<std::string>(v);
}
int as_int(const char* op, const std::string& key, nb::handle v) {
  if (!nb::isinstance<nb::int_>(v) || nb::isinstance<nb::bool_>(v)) fail_type(op, key, "an int", v);
  return nb::cast<int>(v);
}
bool as_bool(const char* op, const std::string& key, nb::handle v) {
  if (!nb::isinstance<nb::bool_>(v)) fail_type(op, key, "a bool", v);
  return nb::cast<bool>(v);
}

}  // namespace

kv_cache_params cache_options(const nb::kwargs& kw, const char* op, bool auto_windows) {
  kv_cache_params p;
  if (auto_windows) p.sink = p.exact_recent = -1;  // auto until given
  for (auto [k, v] : kw) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "type_k") p.type_k = parse_kv_cache_type(as_str(op, key, v), "K");
    else if (key == "type_v") p.type_v = parse_kv_cache_type(as_str(op, key, v), "V");
    else if (key == "rotation") p.rotation = parse_kv_rotation(as_str(op, key, v));
    else if (key == "group_size") p.group_size = as_int(op, key, v);
    else if (key == "sink") p.sink = auto_windows && v.is_none() ? -1 : as_int(op, key, v);
    else if (key == "recent") p.exact_recent = auto_windows && v.is_none() ? -1 : as_int(op, key, v);
    else if (key == "kivi_group") p.kivi_group = as_int(op, key, v);
    else if (key == "kivi_residual") p.kivi_residual = as_int(op, key, v);
    else if (key == "channel_scale") p.channel_scale = as_bool(op, key, v);
    else if (key == "channel_calib") p.channel_calib = as_int(op, key, v);
    else if (key == "k_channel_scale") {
      if (v.is_none()) p.k_channel_scale.reset();
      else if (nb::isinstance<nb::bool_>(v)) p.k_channel_scale = nb::cast<bool>(v);
      else p.k_channel_scale = parse_kv_switch(as_str(op, key, v), "k_channel_scale (or True, False, None)");
    } else if (key == "kv_seed") {
      if (!nb::isinstance<nb::int_>(v) || nb::isinstance<nb::bool_>(v)) fail_type(op, key, "an int", v);
      p.seed = nb::cast<uint64_t>(v);
    } else if (key == "certify") p.certify = as_bool(op, key, v);
    else if (key == "certify_tol") {
      if (!nb::isinstance<nb::float_>(v) && !(nb::isinstance<nb::int_>(v) && !nb::isinstance<nb::bool_>(v)))
        fail_type(op, key, "a float", v);
      p.certify_tol = nb::cast<double>(v);
    } else if (key == "certify_budget") {
      if (!nb::isinstance<nb::float_>(v) && !(nb::isinstance<nb::int_>(v) && !nb::isinstance<nb::bool_>(v)))
        fail_type(op, key, "a float", v);
      p.certify_budget = nb::cast<double>(v);
    } else if (key == "host_dir") p.host_dir = as_str(op, key, v);
    else if (key == "certify_measure") p.certify_measure = as_bool(op, key, v);
    else if (key == "certify_adapt") p.certify_adapt = as_bool(op, key, v);
    else {
      std::string names;
      for (const char* n : option_names) names += (names.empty() ? "" : ", ") + std::string(n);
      throw nb::type_error((std::string(op) + "() got an unexpected keyword argument '" + key +
                            "' (cache options: " + names + ")")
                               .c_str());
    }
  }
  if (auto_windows) {
    const kv_windows w = kv_auto_windows(p);
    if (p.sink == -1) p.sink = w.sink;
    if (p.exact_recent == -1) p.exact_recent = w.exact_recent;
  }
  return p;
}

}  // namespace kvq::py

NB_MODULE(_kvq, m) {
  namespace nb = nanobind;
  m.doc() = "kvq: LLM inference with a compressed KV cache (C++ engine; bindings in nanobind)";
  // kvq::error -> ValueError (invalid_input, unsupported), OSError (io), RuntimeError (internal),
  // the message unchanged ("[op] ...").
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvq::error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.code()) {
        case kvq::errc::invalid_input:
        case kvq::errc::unsupported: type = PyExc_ValueError; break;
        case kvq::errc::io: type = PyExc_OSError; break;
        default: break;
      }
      PyErr_SetString(type, e.what());
    }
  });
  m.def("kv_type_names", &kvq::kv_type_names, "The cache type names type_k / type_v accept (as `kvq info`).");
  m.attr("__version__") = KVQ_VERSION;  // project(kvq VERSION ...) of CMakeLists.txt
  kvq::py::bind_model(m);
  kvq::py::bind_kv_cache(m);
}
