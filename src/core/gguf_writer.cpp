#include "kvq/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

namespace {

template <class T>
void app(std::vector<uint8_t>& b, T v) {
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &v, sizeof(T));
}
void app_str(std::vector<uint8_t>& b, const std::string& s) {
  app<uint64_t>(b, s.size());
  const size_t at = b.size();
  b.resize(at + s.size());
  if (!s.empty()) std::memcpy(b.data() + at, s.data(), s.size());
}
template <class T>
std::vector<uint8_t> scalar(gguf_value_type t, T v) {
  std::vector<uint8_t> b;
  app<uint32_t>(b, (uint32_t)t);
  app<T>(b, v);
  return b;
}

}  // namespace

void gguf_writer::put(const std::string& key, std::vector<uint8_t> typed_value) {
  for (kv& e : kv_)
    if (e.key == key) {
      e.typed_value = std::move(typed_value);
      return;
    }
  kv_.push_back({key, std::move(typed_value)});
}

void gguf_writer::set_u8(const std::string& k, uint8_t v) { put(k, scalar(gguf_value_type::u8, v)); }
void gguf_writer::set_i8(const std::string& k, int8_t v) { put(k, scalar(gguf_value_type::i8, v)); }
void gguf_writer::set_u16(const std::string& k, uint16_t v) { put(k, scalar(gguf_value_type::u16, v)); }
void gguf_writer::set_i16(const std::string& k, int16_t v) { put(k, scalar(gguf_value_type::i16, v)); }
void gguf_writer::set_u32(const std::string& k, uint32_t v) { put(k, scalar(gguf_value_type::u32, v)); }
void gguf_writer::set_i32(const std::string& k, int32_t v) { put(k, scalar(gguf_value_type::i32, v)); }
void gguf_writer::set_u64(const std::string& k, uint64_t v) { put(k, scalar(gguf_value_type::u64, v)); }
void gguf_writer::set_i64(const std::string& k, int64_t v) { put(k, scalar(gguf_value_type::i64, v)); }
void gguf_writer::set_f32(const std::string& k, float v) { put(k, scalar(gguf_value_type::f32, v)); }
void gguf_writer::set_f64(const std::string& k, double v) { put(k, scalar(gguf_value_type::f64, v)); }
void gguf_writer::set_bool(const std::string& k, bool v) {
  put(k, scalar(gguf_value_type::boolean, (uint8_t)(v ? 1 : 0)));
}
void gguf_writer::set_str(const std::string& k, const std::string& v) {
  std::vector<uint8_t> b;
  app<uint32_t>(b, (uint32_t)gguf_value_type::string);
  app_str(b, v);
  put(k, std::move(b));
}
void gguf_writer::set_arr_str(const std::string& k, const std::vector<std::string>& v) {
  std::vector<uint8_t> b;
  app<uint32_t>(b, (uint32_t)gguf_value_type::array);
  app<uint32_t>(b, (uint32_t)gguf_value_type::string);
  app<uint64_t>(b, v.size());
  for (const std::string& s : v) app_str(b, s);
  put(k, std::move(b));
}
void gguf_writer::set_arr_raw(const std::string& k, gguf_value_type elem_type, uint64_t n,
                              const std::vector<uint8_t>& elem_bytes) {
  std::vector<uint8_t> b;
  app<uint32_t>(b, (uint32_t)gguf_value_type::array);
  app<uint32_t>(b, (uint32_t)elem_type);
  app<uint64_t>(b, n);
  b.insert(b.end(), elem_bytes.begin(), elem_bytes.end());
  put(k, std::move(b));
}
void gguf_writer::set_arr_f32(const std::string& k, const std::vector<float>& v) {
  std::vector<uint8_t> e;
  for (float f : v) app<float>(e, f);
  set_arr_raw(k, gguf_value_type::f32, v.size(), e);
}
void gguf_writer::set_arr_i32(const std::string& k, const std::vector<int32_t>& v) {
  std::vector<uint8_t> e;
  for (int32_t i : v) app<int32_t>(e, i);
  set_arr_raw(k, gguf_value_type::i32, v.size(), e);
}
void gguf_writer::set_arr_arr_i32(const std::string& k, const std::vector<std::vector<int32_t>>& v) {
  std::vector<uint8_t> e;
  for (const auto& sub : v) {
    app<uint32_t>(e, (uint32_t)gguf_value_type::i32);
    app<uint64_t>(e, sub.size());
    for (int32_t i : sub) app<int32_t>(e, i);
  }
  set_arr_raw(k, gguf_value_type::array, v.size(), e);
}

namespace {

// Bytes of a tensor of a known type and shape; invalid_input otherwise.
uint64_t tensor_bytes(const std::string& name, ggml_type type, const std::vector<int64_t>& ne) {
  const int64_t blk = ggml_storage_block_elems(type);
  if (blk <= 0)
    fail_input("[gguf_writer] tensor '" + name + "': unknown type " + ggml_type_name(type));
  int64_t n = 1;
  for (int64_t d : ne)
    if (d <= 0 || __builtin_mul_overflow(n, d, &n)) fail_input("[gguf_writer] tensor '" + name + "': bad shape");
  if (ne.empty() || ne[0] % blk != 0)
    fail_input("[gguf_writer] tensor '" + name + "': ne[0] not a multiple of the block size " + std::to_string(blk));
  return (uint64_t)(n / blk * ggml_storage_block_bytes(type));
}

}  // namespace

void gguf_writer::add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                             const std::vector<uint8_t>& data) {
  // unknown type ids (and absurd shapes for them) are written unchecked
  if (ggml_storage_block_elems(type) > 0 && tensor_bytes(name, type, ne) != data.size())
    fail_input("[gguf_writer] tensor '" + name + "': data size " + std::to_string(data.size()) +
               " does not match shape and type (" + std::to_string(tensor_bytes(name, type, ne)) + " bytes)");
  tensors_.push_back({name, type, ne, data.size(), data, {}});
}

void gguf_writer::add_tensor_streamed(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                                      std::function<void(const byte_sink&)> fill) {
  tensors_.push_back({name, type, ne, tensor_bytes(name, type, ne), {}, std::move(fill)});
}

void gguf_writer::add_tensor_f32(const std::string& name, const std::vector<int64_t>& ne,
                                 const std::vector<float>& values, ggml_type stored_as) {
  std::vector<uint8_t> b;
  for (float f : values) {
    if (stored_as == ggml_type::f32) app<float>(b, f);
    else if (stored_as == ggml_type::f16) app<uint16_t>(b, f32_to_f16(f));
    else if (stored_as == ggml_type::bf16) app<uint16_t>(b, f32_to_bf16(f));
    else fail_input(std::string("[gguf_writer] add_tensor_f32 stores only f32/f16/bf16, not ") + ggml_type_name(stored_as));
  }
  add_tensor(name, stored_as, ne, b);
}

void gguf_writer::emit(const byte_sink& out, const std::string& op) const {
  std::vector<uint8_t> b;  // the header
  app<uint32_t>(b, 0x46554747u);  // "GGUF" little-endian
  app<uint32_t>(b, version_);
  app<uint64_t>(b, tensors_.size());
  const bool write_align = alignment_ != 32;
  app<uint64_t>(b, kv_.size() + (write_align ? 1 : 0));
  for (const kv& e : kv_) {
    app_str(b, e.key);
    b.insert(b.end(), e.typed_value.begin(), e.typed_value.end());
  }
  if (write_align) {
    app_str(b, "general.alignment");
    app<uint32_t>(b, (uint32_t)gguf_value_type::u32);
    app<uint32_t>(b, alignment_);
  }
  auto align_up = [&](uint64_t x) { return (x + alignment_ - 1) / alignment_ * alignment_; };
  uint64_t off = 0;
  for (const tensor& t : tensors_) {
    app_str(b, t.name);
    app<uint32_t>(b, (uint32_t)t.ne.size());
    for (int64_t d : t.ne) app<uint64_t>(b, (uint64_t)d);
    app<uint32_t>(b, (uint32_t)t.type);
    off = align_up(off);
    app<uint64_t>(b, off);
    off += t.n_bytes;
  }
  b.resize(align_up(b.size()), 0);
  out(b.data(), b.size());
  // Tensor data, each at its aligned offset in the data section.
  const std::vector<uint8_t> zeros(alignment_, 0);
  uint64_t at = 0;
  for (const tensor& t : tensors_) {
    out(zeros.data(), align_up(at) - at);
    at = align_up(at);
    if (!t.fill) {
      out(t.data.data(), t.data.size());
    } else {
      uint64_t given = 0;
      t.fill([&](const void* p, size_t n) {
        given += n;
        out(p, n);
      });
      if (given != t.n_bytes)
        fail(errc::internal, "[" + op + "] tensor '" + t.name + "': fill wrote " + std::to_string(given) +
                                 " bytes, expected " + std::to_string(t.n_bytes));
    }
    at += t.n_bytes;
  }
}

std::vector<uint8_t> gguf_writer::bytes() const {
  std::vector<uint8_t> b;
  emit([&](const void* p, size_t n) { b.insert(b.end(), (const uint8_t*)p, (const uint8_t*)p + n); }, "gguf_writer");
  return b;
}

void gguf_writer::write(const std::string& path, const std::string& op) const {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(errc::io, "[" + op + "] cannot create '" + path + "'");
  struct closer {
    std::FILE*& f;
    ~closer() {
      if (f) std::fclose(f);
    }
  } guard{f};
  emit(
      [&](const void* p, size_t n) {
        if (n > 0 && std::fwrite(p, 1, n, f) != n) fail(errc::io, "[" + op + "] write to '" + path + "' failed (disk full?)");
      },
      op);
  const int rc = std::fclose(f);
  f = nullptr;
  if (rc != 0) fail(errc::io, "[" + op + "] write to '" + path + "' failed (disk full?)");
}

}  // namespace kvq
