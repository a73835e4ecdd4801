// GGUF reader (versions 2 and 3), memory-mapped.
// Spec: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
// Every offset, count and string length is bounds-checked against the file size; a malformed file
// raises kvq::error(errc::invalid_input) naming the file, the field and the bad value.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace kvq {

// ggml tensor type ids as stored in GGUF (subset kvq knows by name; others are refused on use).
enum class ggml_type : uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q8_1 = 9,
  q2_k = 10, q3_k = 11, q4_k = 12, q5_k = 13, q6_k = 14, q8_k = 15,
  iq2_xxs = 16, iq2_xs = 17, iq3_xxs = 18, iq1_s = 19, iq4_nl = 20, iq3_s = 21, iq2_s = 22,
  iq4_xs = 23, i8 = 24, i16 = 25, i32 = 26, i64 = 27, f64 = 28, iq1_m = 29, bf16 = 30,
  tq1_0 = 34, tq2_0 = 35, mxfp4 = 39,
};
const char* ggml_type_name(ggml_type t);  // "q4_0", or "type<N>" for unknown ids
// Block size in elements and bytes per block for the weight types kvq computes with (f32, f16,
// bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_k .. q6_k, iq4_xs: src/core/weight_types/traits.cpp);
// 0 for others.
int64_t ggml_block_elems(ggml_type t);
int64_t ggml_block_bytes(ggml_type t);
// Storage block size (elements, bytes) of every ggml type id whose layout is known (all the ids
// above, including the k-quants and i-quants kvq cannot compute with); 0 for unknown ids. Used to
// validate tensor extents at open.
int64_t ggml_storage_block_elems(ggml_type t);
int64_t ggml_storage_block_bytes(ggml_type t);

enum class gguf_value_type : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8,
  array = 9, u64 = 10, i64 = 11, f64 = 12,
};

// One metadata value. Scalars widen to int64/uint64/double; arrays keep their element type.
struct gguf_value {
  gguf_value_type type = gguf_value_type::u8;
  gguf_value_type elem_type = gguf_value_type::u8;  // for arrays
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
  // arrays: exactly one of these is filled, by element type family
  std::vector<std::string> arr_str;
  std::vector<int64_t> arr_int;    // all signed/unsigned integer and bool elements
  std::vector<double> arr_float;   // f32/f64 elements
  // arrays: number of elements. An array of arrays (elem_type == array) is bounds-checked at
  // open but its contents are not kept: only arr_n is filled.
  uint64_t arr_n = 0;
};

struct gguf_tensor_info {
  std::string name;
  ggml_type type = ggml_type::f32;
  std::vector<int64_t> ne;  // dims, ne[0] is the contiguous (row) dimension, as in ggml
  uint64_t offset = 0;      // relative to the data section
  uint64_t n_bytes = 0;     // storage size
  const uint8_t* data = nullptr;  // points into the mapping
  int64_t n_elements() const;
};

const char* gguf_value_type_name(gguf_value_type t);  // "u32", "string", "array", ...

class gguf_file {
 public:
  // Opens and validates `path`. Throws kvq::error (io / invalid_input) on any problem.
  static std::unique_ptr<gguf_file> open(const std::string& path);
  ~gguf_file();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }

  const std::map<std::string, gguf_value>& metadata() const { return kv_; }
  const gguf_value* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }
  // Typed getters: throw invalid_input naming the key when missing or of the wrong kind.
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;  // any integer type
  double get_float(const std::string& key) const; // any float or integer type
  bool get_bool(const std::string& key) const;
  std::optional<int64_t> try_int(const std::string& key) const;
  std::optional<double> try_float(const std::string& key) const;
  std::optional<std::string> try_string(const std::string& key) const;

  const std::vector<gguf_tensor_info>& tensors() const { return tensors_; }
  const gguf_tensor_info* find_tensor(const std::string& name) const;
  // Throws invalid_input "[gguf] FILE: missing tensor 'NAME'" when absent.
  const gguf_tensor_info& tensor(const std::string& name) const;

 private:
  gguf_file() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, gguf_value> kv_;
  std::vector<gguf_tensor_info> tensors_;
  std::map<std::string, size_t> tensor_index_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  friend struct gguf_parser;
};

}  // namespace kvq
