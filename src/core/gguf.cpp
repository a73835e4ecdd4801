// GGUF v2/v3 reader. Layout (little-endian), from the GGUF spec (ggml docs/gguf.md):
//   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
//   n_kv x { string key | u32 value_type | value }
//   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
//   padding to general.alignment | tensor data (offsets relative to here, each aligned)
// string = u64 length + bytes (no terminator); array = u32 elem_type + u64 count + elements.
// Every read is bounds-checked against the mapped size, so a corrupt file raises kvq::error.
#include "kvq/gguf.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "core/weight_types/traits.h"
#include "kvq/error.h"

namespace kvq {

namespace {

struct type_row {
  const char* name;
  int64_t blk;    // elements per block
  int64_t bytes;  // bytes per block
};

// ggml type ids 0..39 (ggml.h / ggml.c type_traits). Removed ids keep a null name.
constexpr type_row k_types[] = {
    {"f32", 1, 4},          {"f16", 1, 2},         {"q4_0", 32, 18},      {"q4_1", 32, 20},
    {nullptr, 0, 0},        {nullptr, 0, 0},       {"q5_0", 32, 22},      {"q5_1", 32, 24},
    {"q8_0", 32, 34},       {"q8_1", 32, 36},      {"q2_k", 256, 84},     {"q3_k", 256, 110},
    {"q4_k", 256, 144},     {"q5_k", 256, 176},    {"q6_k", 256, 210},    {"q8_k", 256, 292},
    {"iq2_xxs", 256, 66},   {"iq2_xs", 256, 74},   {"iq3_xxs", 256, 98},  {"iq1_s", 256, 50},
    {"iq4_nl", 32, 18},     {"iq3_s", 256, 110},   {"iq2_s", 256, 82},    {"iq4_xs", 256, 136},
    {"i8", 1, 1},           {"i16", 1, 2},         {"i32", 1, 4},         {"i64", 1, 8},
    {"f64", 1, 8},          {"iq1_m", 256, 56},    {"bf16", 1, 2},        {nullptr, 0, 0},
    {nullptr, 0, 0},        {nullptr, 0, 0},       {"tq1_0", 256, 54},    {"tq2_0", 256, 66},
    {nullptr, 0, 0},        {nullptr, 0, 0},       {nullptr, 0, 0},       {"mxfp4", 32, 17},
};
constexpr uint32_t k_n_types = sizeof(k_types) / sizeof(k_types[0]);

const type_row* row_of(ggml_type t) {
  const uint32_t id = (uint32_t)t;
  if (id >= k_n_types || !k_types[id].name) return nullptr;
  return &k_types[id];
}

bool kvq_holds(ggml_type t) { return find_weight_traits(t) != nullptr; }

// Smallest encoded size of one value of a type (used to reject absurd counts early).
uint64_t min_value_bytes(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::u8: case gguf_value_type::i8: case gguf_value_type::boolean: return 1;
    case gguf_value_type::u16: case gguf_value_type::i16: return 2;
    case gguf_value_type::u32: case gguf_value_type::i32: case gguf_value_type::f32: return 4;
    case gguf_value_type::u64: case gguf_value_type::i64: case gguf_value_type::f64: return 8;
    case gguf_value_type::string: return 8;
    case gguf_value_type::array: return 12;
  }
  return 1;
}

constexpr int k_max_array_depth = 8;

}  // namespace

const char* ggml_type_name(ggml_type t) {
  if (const type_row* r = row_of(t)) return r->name;
  static thread_local char buf[32];
  std::snprintf(buf, sizeof(buf), "type%u", (unsigned)t);
  return buf;
}

int64_t ggml_storage_block_elems(ggml_type t) {
  const type_row* r = row_of(t);
  return r ? r->blk : 0;
}
int64_t ggml_storage_block_bytes(ggml_type t) {
  const type_row* r = row_of(t);
  return r ? r->bytes : 0;
}
int64_t ggml_block_elems(ggml_type t) { return kvq_holds(t) ? ggml_storage_block_elems(t) : 0; }
int64_t ggml_block_bytes(ggml_type t) { return kvq_holds(t) ? ggml_storage_block_bytes(t) : 0; }

const char* gguf_value_type_name(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::u8: return "u8";
    case gguf_value_type::i8: return "i8";
    case gguf_value_type::u16: return "u16";
    case gguf_value_type::i16: return "i16";
    case gguf_value_type::u32: return "u32";
    case gguf_value_type::i32: return "i32";
    case gguf_value_type::f32: return "f32";
    case gguf_value_type::boolean: return "bool";
    case gguf_value_type::string: return "string";
    case gguf_value_type::array: return "array";
    case gguf_value_type::u64: return "u64";
    case gguf_value_type::i64: return "i64";
    case gguf_value_type::f64: return "f64";
  }
  return "?";
}

int64_t gguf_tensor_info::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // overflow excluded at open
  return n;
}

// Cursor over the mapping; every read names the field it is reading for the error message.
struct gguf_parser {
  const std::string& path;
  const uint8_t* base;
  uint64_t size;
  uint64_t pos = 0;

  [[noreturn]] void bad(const std::string& what) const {
    fail_input(fmt::format("[gguf] {}: {}", path, what));
  }
  uint64_t left() const { return size - pos; }
  void need(uint64_t n, const std::string& field) const {
    if (n > left())
      bad(fmt::format("{} at offset {} needs {} bytes but only {} remain (file is {} bytes)",
                      field, pos, n, left(), size));
  }
  template <class T>
  T rd(const std::string& field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string rd_str(const std::string& field) {
    const uint64_t n = rd<uint64_t>(field + " length");
    if (n > left())
      bad(fmt::format("{}: string length {} at offset {} runs past the end of the file ({} bytes)",
                      field, n, pos - 8, size));
    std::string s(reinterpret_cast<const char*>(base + pos), (size_t)n);
    pos += n;
    return s;
  }
  gguf_value_type rd_vtype(const std::string& field) {
    const uint32_t t = rd<uint32_t>(field);
    if (t > (uint32_t)gguf_value_type::f64) bad(fmt::format("{}: unknown value type {}", field, t));
    return (gguf_value_type)t;
  }

  // Reads a scalar of type t into v.scalar.
  void rd_scalar(gguf_value_type t, gguf_value& v, const std::string& field) {
    switch (t) {
      case gguf_value_type::u8: v.scalar = (uint64_t)rd<uint8_t>(field); break;
      case gguf_value_type::u16: v.scalar = (uint64_t)rd<uint16_t>(field); break;
      case gguf_value_type::u32: v.scalar = (uint64_t)rd<uint32_t>(field); break;
      case gguf_value_type::u64: v.scalar = rd<uint64_t>(field); break;
      case gguf_value_type::i8: v.scalar = (int64_t)rd<int8_t>(field); break;
      case gguf_value_type::i16: v.scalar = (int64_t)rd<int16_t>(field); break;
      case gguf_value_type::i32: v.scalar = (int64_t)rd<int32_t>(field); break;
      case gguf_value_type::i64: v.scalar = rd<int64_t>(field); break;
      case gguf_value_type::f32: v.scalar = (double)rd<float>(field); break;
      case gguf_value_type::f64: v.scalar = rd<double>(field); break;
      case gguf_value_type::boolean: {
        const uint8_t b = rd<uint8_t>(field);
        if (b > 1) bad(fmt::format("{}: bool value {} is neither 0 nor 1", field, b));
        v.scalar = b != 0;
        break;
      }
      case gguf_value_type::string: v.scalar = rd_str(field); break;
      case gguf_value_type::array: bad(fmt::format("{}: internal: array read as scalar", field));
    }
  }

  // Reads an array body (after the u32 value type). Nested arrays are checked and skipped.
  void rd_array(gguf_value& v, const std::string& field, int depth) {
    if (depth > k_max_array_depth)
      bad(fmt::format("{}: arrays nested deeper than {}", field, k_max_array_depth));
    v.type = gguf_value_type::array;
    v.elem_type = rd_vtype(field + " element type");
    const uint64_t n = rd<uint64_t>(field + " element count");
    if (n > left() / min_value_bytes(v.elem_type))
      bad(fmt::format("{}: array of {} {} elements cannot fit in the {} bytes left of the file",
                      field, n, gguf_value_type_name(v.elem_type), left()));
    v.arr_n = n;
    const std::string ef = field + " element";
    switch (v.elem_type) {
      case gguf_value_type::string:
        v.arr_str.reserve(n);
        for (uint64_t i = 0; i < n; ++i) v.arr_str.push_back(rd_str(ef));
        break;
      case gguf_value_type::f32:
      case gguf_value_type::f64: {
        v.arr_float.resize(n);
        gguf_value e;
        for (uint64_t i = 0; i < n; ++i) {
          rd_scalar(v.elem_type, e, ef);
          v.arr_float[i] = std::get<double>(e.scalar);
        }
        break;
      }
      case gguf_value_type::array: {
        for (uint64_t i = 0; i < n; ++i) {
          gguf_value sub;
          rd_vtype(ef + " type");  // an array element's own header: elem type + count
          pos -= 4;
          rd_array(sub, ef, depth + 1);
        }
        break;
      }
      default: {  // integers and bools
        v.arr_int.resize(n);
        gguf_value e;
        for (uint64_t i = 0; i < n; ++i) {
          rd_scalar(v.elem_type, e, ef);
          if (auto* u = std::get_if<uint64_t>(&e.scalar)) v.arr_int[i] = (int64_t)*u;
          else if (auto* s = std::get_if<int64_t>(&e.scalar)) v.arr_int[i] = *s;
          else v.arr_int[i] = std::get<bool>(e.scalar) ? 1 : 0;
        }
        break;
      }
    }
  }

  void parse(gguf_file& f) {
    if (size < 4 || std::memcmp(base, "GGUF", 4) != 0) {
      std::string got;
      for (uint64_t i = 0; i < std::min<uint64_t>(size, 4); ++i) got += fmt::format("{:02x}", base[i]);
      bad(fmt::format("bad magic 0x{} (expected \"GGUF\" 0x47475546); not a GGUF file", got));
    }
    pos = 4;
    const uint32_t version = rd<uint32_t>("header version");
    if (version != 2 && version != 3) {
      const uint32_t swapped = __builtin_bswap32(version);
      if (swapped == 2 || swapped == 3)
        fail_unsupported(fmt::format("[gguf] {}: big-endian GGUF (version {}) is not supported",
                                     path, swapped));
      fail_unsupported(fmt::format("[gguf] {}: unsupported GGUF version {} (supported: 2, 3)", path,
                                   version));
    }
    f.version_ = version;
    const uint64_t n_tensors = rd<uint64_t>("header tensor count");
    const uint64_t n_kv = rd<uint64_t>("header metadata count");
    // A key-value pair takes >= 13 bytes (key length, type, 1-byte value); a tensor info >= 28
    // (name length, n_dims, one dim, type, offset).
    if (n_kv > left() / 13)
      bad(fmt::format("header metadata count {} is absurd for a file of {} bytes", n_kv, size));
    if (n_tensors > left() / 28)
      bad(fmt::format("header tensor count {} is absurd for a file of {} bytes", n_tensors, size));

    for (uint64_t i = 0; i < n_kv; ++i) {
      const std::string key = rd_str(fmt::format("metadata #{} key", i));
      const std::string field = fmt::format("metadata '{}'", key);
      if (f.kv_.count(key)) bad(fmt::format("duplicate metadata key '{}'", key));
      gguf_value v;
      v.type = rd_vtype(field + " type");
      if (v.type == gguf_value_type::array) rd_array(v, field, 0);
      else rd_scalar(v.type, v, field);
      f.kv_.emplace(key, std::move(v));
    }

    if (const gguf_value* a = f.find("general.alignment")) {
      uint64_t al = 0;
      if (a->type == gguf_value_type::array || (!std::holds_alternative<uint64_t>(a->scalar) &&
                                                !std::holds_alternative<int64_t>(a->scalar)))
        bad(fmt::format("metadata 'general.alignment' has type {}, expected an integer",
                        gguf_value_type_name(a->type)));
      if (auto* u = std::get_if<uint64_t>(&a->scalar)) al = *u;
      else if (int64_t s = std::get<int64_t>(a->scalar); s > 0) al = (uint64_t)s;
      if (al == 0 || (al & (al - 1)) != 0 || al > (1u << 30))
        bad(fmt::format("metadata 'general.alignment' = {} is not a power of two in [1, 2^30]", al));
      f.alignment_ = al;
    }

    f.tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      gguf_tensor_info t;
      t.name = rd_str(fmt::format("tensor #{} name", i));
      const std::string field = fmt::format("tensor '{}'", t.name);
      if (f.tensor_index_.count(t.name)) bad(fmt::format("duplicate tensor name '{}'", t.name));
      const uint32_t n_dims = rd<uint32_t>(field + " n_dims");
      if (n_dims < 1 || n_dims > 4) bad(fmt::format("{}: n_dims {} is not in [1, 4]", field, n_dims));
      int64_t n_el = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t ne = rd<uint64_t>(fmt::format("{} ne[{}]", field, d));
        if (ne == 0 || ne > (uint64_t)std::numeric_limits<int64_t>::max())
          bad(fmt::format("{}: dimension ne[{}] = {} must be in [1, 2^63)", field, d, ne));
        if (__builtin_mul_overflow(n_el, (int64_t)ne, &n_el))
          bad(fmt::format("{}: element count overflows at ne[{}] = {}", field, d, ne));
        t.ne.push_back((int64_t)ne);
      }
      t.type = (ggml_type)rd<uint32_t>(field + " type");
      t.offset = rd<uint64_t>(field + " offset");
      const int64_t blk = ggml_storage_block_elems(t.type);
      if (blk > 0) {
        if (t.ne[0] % blk != 0)
          bad(fmt::format("{}: ne[0] = {} is not a multiple of the {} block size {}", field, t.ne[0],
                          ggml_type_name(t.type), blk));
        // n_el <= 2^63 and bytes/blk <= 9, so compute in 128 bits to be safe.
        const unsigned __int128 nb =
            (unsigned __int128)(n_el / blk) * (unsigned __int128)ggml_storage_block_bytes(t.type);
        if (nb > size) bad(fmt::format("{}: size of {} elements of {} exceeds the file size {}",
                                       field, n_el, ggml_type_name(t.type), size));
        t.n_bytes = (uint64_t)nb;
      }
      if (t.offset % f.alignment_ != 0)
        bad(fmt::format("{}: data offset {} is not a multiple of the alignment {}", field, t.offset,
                        f.alignment_));
      f.tensor_index_.emplace(t.name, f.tensors_.size());
      f.tensors_.push_back(std::move(t));
    }

    // Data section starts at the next multiple of the alignment.
    const uint64_t data_start = (pos + f.alignment_ - 1) / f.alignment_ * f.alignment_;
    for (gguf_tensor_info& t : f.tensors_) {
      const uint64_t avail = data_start <= size ? size - data_start : 0;
      if (t.offset > avail || t.n_bytes > avail - t.offset)
        bad(fmt::format("tensor '{}' data at offset {} + {} bytes runs past the end of the data "
                        "section ({} bytes starting at file offset {}; file is {} bytes)",
                        t.name, t.offset, t.n_bytes, avail, data_start, size));
      t.data = base + data_start + t.offset;
    }
  }
};

std::unique_ptr<gguf_file> gguf_file::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(errc::io, fmt::format("[gguf] {}: cannot open: {}", path, std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(errc::io, fmt::format("[gguf] {}: cannot stat: {}", path, std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(errc::io, fmt::format("[gguf] {}: not a regular file", path));
  }
  std::unique_ptr<gguf_file> f(new gguf_file());
  f->path_ = path;
  const uint64_t size = (uint64_t)st.st_size;
  if (size == 0) {
    ::close(fd);
    fail_input(fmt::format("[gguf] {}: file is empty (0 bytes); not a GGUF file", path));
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail(errc::io, fmt::format("[gguf] {}: mmap failed: {}", path, std::strerror(e)));
  f->map_ = m;
  f->map_size_ = size;
  gguf_parser p{f->path_, static_cast<const uint8_t*>(m), size};
  p.parse(*f);  // on throw, ~gguf_file unmaps
  return f;
}

gguf_file::~gguf_file() {
  if (map_) ::munmap(map_, map_size_);
}

const gguf_value* gguf_file::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
[[noreturn]] void bad_key(const std::string& path, const std::string& key, const gguf_value& v,
                          const char* want) {
  std::string got = gguf_value_type_name(v.type);
  if (v.type == gguf_value_type::array) got += fmt::format(" of {}", gguf_value_type_name(v.elem_type));
  fail_input(fmt::format("[gguf] {}: metadata '{}' has type {}, expected {}", path, key, got, want));
}
std::optional<int64_t> as_int(const std::string& path, const std::string& key, const gguf_value& v) {
  if (v.type == gguf_value_type::array) return std::nullopt;
  if (auto* u = std::get_if<uint64_t>(&v.scalar)) {
    if (*u > (uint64_t)std::numeric_limits<int64_t>::max())
      fail_input(fmt::format("[gguf] {}: metadata '{}' = {} does not fit in int64", path, key, *u));
    return (int64_t)*u;
  }
  if (auto* s = std::get_if<int64_t>(&v.scalar)) return *s;
  return std::nullopt;
}
}  // namespace

int64_t gguf_file::get_int(const std::string& key) const {
  const gguf_value* v = find(key);
  if (!v) fail_input(fmt::format("[gguf] {}: missing metadata '{}'", path_, key));
  if (auto i = as_int(path_, key, *v)) return *i;
  bad_key(path_, key, *v, "an integer");
}

std::optional<int64_t> gguf_file::try_int(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_int(key);
}

double gguf_file::get_float(const std::string& key) const {
  const gguf_value* v = find(key);
  if (!v) fail_input(fmt::format("[gguf] {}: missing metadata '{}'", path_, key));
  if (v->type != gguf_value_type::array) {
    if (auto* d = std::get_if<double>(&v->scalar)) return *d;
    if (auto* u = std::get_if<uint64_t>(&v->scalar)) return (double)*u;
    if (auto* s = std::get_if<int64_t>(&v->scalar)) return (double)*s;
  }
  bad_key(path_, key, *v, "a number");
}

std::optional<double> gguf_file::try_float(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_float(key);
}

std::string gguf_file::get_string(const std::string& key) const {
  const gguf_value* v = find(key);
  if (!v) fail_input(fmt::format("[gguf] {}: missing metadata '{}'", path_, key));
  if (v->type == gguf_value_type::string) return std::get<std::string>(v->scalar);
  bad_key(path_, key, *v, "a string");
}

std::optional<std::string> gguf_file::try_string(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_string(key);
}

bool gguf_file::get_bool(const std::string& key) const {
  const gguf_value* v = find(key);
  if (!v) fail_input(fmt::format("[gguf] {}: missing metadata '{}'", path_, key));
  if (v->type == gguf_value_type::boolean) return std::get<bool>(v->scalar);
  bad_key(path_, key, *v, "a bool");
}

const gguf_tensor_info* gguf_file::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const gguf_tensor_info& gguf_file::tensor(const std::string& name) const {
  if (const gguf_tensor_info* t = find_tensor(name)) return *t;
  fail_input(fmt::format("[gguf] {}: missing tensor '{}'", path_, name));
}

}  // namespace kvq
