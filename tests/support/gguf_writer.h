// Test-only GGUF v3 writer: builds small model/vocabulary files for tests (little-endian, spec
// ggml docs/gguf.md). Metadata keys are written in insertion order; setting a key again replaces
// its value in place. Tensor data is aligned to `alignment` (general.alignment is written only when
// it differs from the default 32).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/gguf.h"

namespace kvq::test {

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
  // (checked against the type's block size when known; an unknown type id writes data as given).
  void add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& ne,
                  const std::vector<uint8_t>& data);
  // Convenience: f32 values stored as f32, f16 or bf16.
  void add_tensor_f32(const std::string& name, const std::vector<int64_t>& ne,
                      const std::vector<float>& values, ggml_type stored_as = ggml_type::f32);

  void set_alignment(uint32_t a) { alignment_ = a; }
  void set_version(uint32_t v) { version_ = v; }  // 2 or 3 (same little-endian layout)

  std::vector<uint8_t> bytes() const;  // the whole file
  void write(const std::string& path) const;

 private:
  struct kv {
    std::string key;
    std::vector<uint8_t> typed_value;  // u32 type + value encoding
  };
  struct tensor {
    std::string name;
    ggml_type type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;
  };
  void put(const std::string& key, std::vector<uint8_t> typed_value);
  std::vector<kv> kv_;
  std::vector<tensor> tensors_;
  uint32_t alignment_ = 32;
  uint32_t version_ = 3;
};

}  // namespace kvq::test
