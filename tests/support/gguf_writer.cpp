#include "support/gguf_writer.h"

#include <cstring>
#include <fstream>
#include <stdexcept>

#include "kvq/f16.h"

namespace kvq::test {

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

void gguf_writer::add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                             const std::vector<uint8_t>& data) {
  const int64_t blk = ggml_storage_block_elems(type);
  if (blk > 0) {  // unknown type ids (and absurd shapes for them) are written unchecked
    int64_t n = 1;
    for (int64_t d : ne)
      if (d <= 0 || __builtin_mul_overflow(n, d, &n))
        throw std::invalid_argument("gguf_writer: " + name + ": bad shape");
    if (ne.empty() || ne[0] % blk != 0)
      throw std::invalid_argument("gguf_writer: " + name + ": ne[0] not a multiple of the block size");
    if ((int64_t)data.size() != n / blk * ggml_storage_block_bytes(type))
      throw std::invalid_argument("gguf_writer: " + name + ": data size does not match shape/type");
  }
  tensors_.push_back({name, type, ne, data});
}

void gguf_writer::add_tensor_f32(const std::string& name, const std::vector<int64_t>& ne,
                                 const std::vector<float>& values, ggml_type stored_as) {
  std::vector<uint8_t> b;
  for (float f : values) {
    if (stored_as == ggml_type::f32) app<float>(b, f);
    else if (stored_as == ggml_type::f16) app<uint16_t>(b, f32_to_f16(f));
    else if (stored_as == ggml_type::bf16) app<uint16_t>(b, f32_to_bf16(f));
    else throw std::invalid_argument("gguf_writer: add_tensor_f32 stores only f32/f16/bf16");
  }
  add_tensor(name, stored_as, ne, b);
}

std::vector<uint8_t> gguf_writer::bytes() const {
  std::vector<uint8_t> b;
  app<uint32_t>(b, 0x46554747u);  // "GGUF" little-endian
  app<uint32_t>(b, version_);
  app<uint64_t>(b, tensors_.size());
  const bool write_align = alignment_ != 32;
  app<uint64_t>(b, kv_.size() + (write_align ? 1 : 0));
  for (const kv& e : kv_) {
    app_str(b, e.key);
    const size_t at = b.size();
    b.resize(at + e.typed_value.size());
    std::memcpy(b.data() + at, e.typed_value.data(), e.typed_value.size());
  }
  if (write_align) {
    app_str(b, "general.alignment");
    app<uint32_t>(b, (uint32_t)gguf_value_type::u32);
    app<uint32_t>(b, alignment_);
  }
  auto align_up = [&](uint64_t x) { return (x + alignment_ - 1) / alignment_ * alignment_; };
  uint64_t off = 0;
  std::vector<uint64_t> offsets;
  for (const tensor& t : tensors_) {
    app_str(b, t.name);
    app<uint32_t>(b, (uint32_t)t.ne.size());
    for (int64_t d : t.ne) app<uint64_t>(b, (uint64_t)d);
    app<uint32_t>(b, (uint32_t)t.type);
    off = align_up(off);
    offsets.push_back(off);
    app<uint64_t>(b, off);
    off += t.data.size();
  }
  b.resize(align_up(b.size()), 0);
  const size_t data_start = b.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    b.resize(data_start + offsets[i], 0);
    b.insert(b.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  return b;
}

void gguf_writer::write(const std::string& path) const {
  const std::vector<uint8_t> b = bytes();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw std::runtime_error("gguf_writer: cannot open " + path);
  f.write(reinterpret_cast<const char*>(b.data()), (std::streamsize)b.size());
  if (!f) throw std::runtime_error("gguf_writer: write failed " + path);
}

}  // namespace kvq::test
