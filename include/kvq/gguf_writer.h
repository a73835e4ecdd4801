// GGUF v3 (or v2) writer, little-endian, the layout that gguf.h reads (spec: ggml docs/gguf.md).
// Used for synthetic random-weight models (runtime/synthetic_model.cpp: gigabytes, streamed) and
// by tests to build small model, vocabulary and malformed files. Metadata keys are written in
// insertion order; setting a key again replaces its value in place. Tensor data starts at a
// multiple of `alignment` (general.alignment is written only when it differs from the default 32).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/gguf.h"

namespace kvq {

class gguf_writer {
 public:
  void set_u8(const std::string& key, uint8_t v);
  void set_i8(const std::string& key, int8_t v);
  void set_u16(const std::string& key, uint16_t v);
  void set_i16(const std::string& key, int16_t v);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_i64(const std::string& key, int64_t v);
  void set_f32(const std::string& key, float v);
  void set_f64(const std::string& key, double v);
  void set_bool(const std::string& key, bool v);
  void set_str(const std::string& key, const std::string& v);
  void set_arr_str(const std::string& key, const std::vector<std::string>& v);
  void set_arr_f32(const std::string& key, const std::vector<float>& v);
  void set_arr_i32(const std::string& key, const std::vector<int32_t>& v);
  // Any array of fixed-size elements: `elem_bytes` is elements x size of the element type.
  void set_arr_raw(const std::string& key, gguf_value_type elem_type, uint64_t n,
                   const std::vector<uint8_t>& elem_bytes);
  // Array of arrays of i32 (nested arrays, to test readers that skip them).
  void set_arr_arr_i32(const std::string& key, const std::vector<std::vector<int32_t>>& v);

  // ne[0] is the contiguous dimension (ggml order). `data` must hold exactly the tensor's bytes
  // (checked against the type's block size when known; an unknown type id writes data as given,
  // for tests of the reader). Errors: invalid_input "[gguf_writer] tensor 'NAME': ...".
  void add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                  const std::vector<uint8_t>& data);
  // Convenience: f32 values stored as f32, f16 or bf16.
  void add_tensor_f32(const std::string& name, const std::vector<int64_t>& ne,
                      const std::vector<float>& values, ggml_type stored_as = ggml_type::f32);
  // A tensor whose bytes are produced while the file is written, for files larger than memory:
  // `fill` is called once, in tensor order, and must pass exactly the tensor's bytes (blocks x the
  // type's block bytes; the type must be known) to the sink, in pieces of any size.
  // Errors: invalid_input as add_tensor; a fill that gives another byte count is
  // internal "[OP] tensor 'NAME': fill wrote N bytes, expected M".
  using byte_sink = std::function<void(const void* data, size_t n_bytes)>;
  void add_tensor_streamed(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                           std::function<void(const byte_sink&)> fill);

  void set_alignment(uint32_t a) { alignment_ = a; }
  void set_version(uint32_t v) { version_ = v; }  // 2 or 3 (same little-endian layout)

  std::vector<uint8_t> bytes() const;  // the whole file in memory
  // Streams the file to `path` (created or truncated). Errors: io "[OP] cannot create 'PATH'",
  // "[OP] write to 'PATH' failed (disk full?)"; op names the caller ("bench", ...).
  void write(const std::string& path, const std::string& op = "gguf_writer") const;

 private:
  struct kv {
    std::string key;
    std::vector<uint8_t> typed_value;  // u32 type + value encoding
  };
  struct tensor {
    std::string name;
    ggml_type type;
    std::vector<int64_t> ne;
    uint64_t n_bytes;
    std::vector<uint8_t> data;                 // in memory, or
    std::function<void(const byte_sink&)> fill;  // streamed
  };
  void put(const std::string& key, std::vector<uint8_t> typed_value);
  void emit(const byte_sink& out, const std::string& op) const;
  std::vector<kv> kv_;
  std::vector<tensor> tensors_;
  uint32_t alignment_ = 32;
  uint32_t version_ = 3;
};

}  // namespace kvq
