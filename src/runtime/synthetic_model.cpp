// Synthetic random-weight models of published shapes, written as a temporary GGUF v3 file and
// loaded through model::load (the same code path as a real model). Spec: ggml docs/gguf.md.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kvq/bench.h"
#include "kvq/error.h"
#include "kvq/f16.h"

namespace kvq {

std::vector<model_shape> model_shapes() {
  // name, arch, n_layer, n_embd, n_head, n_kv_head, head_dim, n_ff, n_vocab, n_ctx_train, rope base, tied
  return {
      {"llama3-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 8192, 500000.0f, false},
      {"llama3.2-1b", "llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0f, true},
      {"mistral-7b", "llama", 32, 4096, 32, 8, 128, 14336, 32768, 32768, 1000000.0f, false},
      {"qwen3-0.6b", "qwen3", 28, 1024, 16, 8, 128, 3072, 151936, 40960, 1000000.0f, true},
      {"qwen3-1.7b", "qwen3", 28, 2048, 16, 8, 128, 6144, 151936, 40960, 1000000.0f, true},
      {"qwen3-4b", "qwen3", 36, 2560, 32, 8, 128, 9728, 151936, 40960, 1000000.0f, true},
      {"qwen3-8b", "qwen3", 36, 4096, 32, 8, 128, 12288, 151936, 40960, 1000000.0f, false},
  };
}

model_shape find_model_shape(const std::string& name) {
  std::string names;
  for (const auto& s : model_shapes()) {
    if (s.name == name) return s;
    names += (names.empty() ? "" : ", ") + s.name;
  }
  fail_input("[bench] unknown model shape '" + name + "' (known: " + names + ")");
}

namespace {

struct rng {
  uint64_t s;
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

class gguf_out {
 public:
  explicit gguf_out(const std::string& path) : path_(path) {
    f_ = std::fopen(path.c_str(), "wb");
    if (!f_) fail(errc::io, "[bench] cannot create the synthetic model file '" + path + "'");
  }
  ~gguf_out() {
    if (f_) std::fclose(f_);
  }
  void raw(const void* p, size_t n) {
    if (std::fwrite(p, 1, n, f_) != n) fail(errc::io, "[bench] write to '" + path_ + "' failed (disk full?)");
  }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void str(const std::string& s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void pad(uint64_t align) {
    static const char zeros[64] = {};
    const long at = std::ftell(f_);
    const uint64_t n = (align - (uint64_t)at % align) % align;
    raw(zeros, n);
  }
  void close() {
    if (std::fclose(f_) != 0) {
      f_ = nullptr;
      fail(errc::io, "[bench] cannot finish '" + path_ + "'");
    }
    f_ = nullptr;
  }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

struct tensor_spec {
  std::string name;
  ggml_type type;
  int64_t n_in, n_out;  // ne[0], ne[1] (n_out = 1: a vector)
  uint64_t bytes() const {
    const int64_t n = n_in * n_out;
    switch (type) {
      case ggml_type::f32: return 4 * (uint64_t)n;
      case ggml_type::f16: return 2 * (uint64_t)n;
      case ggml_type::q8_0: return (uint64_t)n / 32 * 34;
      case ggml_type::q4_0: return (uint64_t)n / 32 * 18;
      default: return 0;
    }
  }
};

// Streams one tensor's random data (uniform, variance 1/n_in; vectors = 1).
void write_tensor_data(gguf_out& out, const tensor_spec& t, rng& r) {
  const int64_t n = t.n_in * t.n_out;
  std::vector<uint8_t> buf;
  buf.reserve(1 << 22);
  const float a = std::sqrt(3.0f / (float)t.n_in);  // U(-a, a) has variance 1/n_in
  auto flush = [&](bool force) {
    if (force || buf.size() >= (1u << 22) - 64) {
      out.raw(buf.data(), buf.size());
      buf.clear();
    }
  };
  if (t.type == ggml_type::f32) {
    const float one = 1.0f;
    for (int64_t i = 0; i < n; ++i) {
      buf.insert(buf.end(), (const uint8_t*)&one, (const uint8_t*)&one + 4);
      flush(false);
    }
  } else if (t.type == ggml_type::f16) {
    for (int64_t i = 0; i < n; i += 4) {
      const uint64_t x = r.next();
      for (int k = 0; k < 4 && i + k < n; ++k) {
        const float u = ((float)((x >> (16 * k)) & 0xffff) / 32767.5f - 1.0f) * a;
        const uint16_t h = f32_to_f16(u);
        buf.push_back((uint8_t)h);
        buf.push_back((uint8_t)(h >> 8));
      }
      flush(false);
    }
  } else if (t.type == ggml_type::q8_0) {
    const uint16_t d = f32_to_f16(a / 127.0f);
    for (int64_t b = 0; b < n / 32; ++b) {
      buf.push_back((uint8_t)d);
      buf.push_back((uint8_t)(d >> 8));
      for (int k = 0; k < 4; ++k) {
        uint64_t x = r.next();
        for (int j = 0; j < 8; ++j, x >>= 8) {
          int8_t q = (int8_t)(x & 0xff);
          if (q == -128) q = -127;
          buf.push_back((uint8_t)q);
        }
      }
      flush(false);
    }
  } else {  // q4_0: nibbles uniform in [0, 15] -> (nibble - 8) * d
    const uint16_t d = f32_to_f16(a / 8.0f);
    for (int64_t b = 0; b < n / 32; ++b) {
      buf.push_back((uint8_t)d);
      buf.push_back((uint8_t)(d >> 8));
      for (int k = 0; k < 2; ++k) {
        uint64_t x = r.next();
        for (int j = 0; j < 8; ++j, x >>= 8) buf.push_back((uint8_t)(x & 0xff));
      }
      flush(false);
    }
  }
  flush(true);
}

}  // namespace

std::unique_ptr<model> make_synthetic_model(const model_shape& s, ggml_type wt, int n_layer, uint64_t seed,
                                            const std::string& tmp_dir) {
  if (wt != ggml_type::f16 && wt != ggml_type::q8_0 && wt != ggml_type::q4_0)
    fail_input(std::string("[bench] synthetic weight type ") + ggml_type_name(wt) +
               " is not supported (supported: f16, q8_0, q4_0)");
  if (n_layer < 0) fail_input("[bench] synthetic model layers " + std::to_string(n_layer) + " must be >= 0");
  const int L = n_layer > 0 ? n_layer : s.n_layer;
  const int64_t E = s.n_embd, dq = (int64_t)s.n_head * s.head_dim, dkv = (int64_t)s.n_kv_head * s.head_dim;
  for (int64_t d : {E, dq, dkv, (int64_t)s.n_ff})
    if (d % 32 != 0) fail_input("[bench] shape '" + s.name + "': dimension " + std::to_string(d) + " is not a multiple of 32");

  std::vector<tensor_spec> ts;
  ts.push_back({"token_embd.weight", wt, E, s.n_vocab});
  ts.push_back({"output_norm.weight", ggml_type::f32, E, 1});
  if (!s.tied_output) ts.push_back({"output.weight", wt, E, s.n_vocab});
  for (int il = 0; il < L; ++il) {
    const std::string b = "blk." + std::to_string(il) + ".";
    ts.push_back({b + "attn_norm.weight", ggml_type::f32, E, 1});
    ts.push_back({b + "ffn_norm.weight", ggml_type::f32, E, 1});
    ts.push_back({b + "attn_q.weight", wt, E, dq});
    ts.push_back({b + "attn_k.weight", wt, E, dkv});
    ts.push_back({b + "attn_v.weight", wt, E, dkv});
    ts.push_back({b + "attn_output.weight", wt, dq, E});
    ts.push_back({b + "ffn_gate.weight", wt, E, s.n_ff});
    ts.push_back({b + "ffn_up.weight", wt, E, s.n_ff});
    ts.push_back({b + "ffn_down.weight", wt, s.n_ff, E});
    if (s.arch == "qwen3") {
      ts.push_back({b + "attn_q_norm.weight", ggml_type::f32, s.head_dim, 1});
      ts.push_back({b + "attn_k_norm.weight", ggml_type::f32, s.head_dim, 1});
    }
  }

  std::string dir = tmp_dir;
  if (dir.empty()) {
    const char* e = std::getenv("TMPDIR");
    dir = (e && *e) ? e : "/tmp";
  }
  std::string path = dir + "/kvq_synthetic_" + s.name + "_XXXXXX";
  std::vector<char> tmpl(path.begin(), path.end());
  tmpl.push_back('\0');
  const int fd = ::mkstemp(tmpl.data());
  if (fd < 0) fail(errc::io, "[bench] cannot create a temporary file in '" + dir + "'");
  ::close(fd);
  path = tmpl.data();
  struct unlink_guard {
    std::string p;
    ~unlink_guard() { std::remove(p.c_str()); }
  } guard{path};

  {
    gguf_out out(path);
    const std::string a = s.arch + ".";
    struct kv_u32 { std::string k; uint32_t v; };
    struct kv_f32 { std::string k; float v; };
    const std::vector<kv_u32> u32s = {
        {a + "context_length", (uint32_t)s.n_ctx_train}, {a + "embedding_length", (uint32_t)E},
        {a + "block_count", (uint32_t)L},                {a + "feed_forward_length", (uint32_t)s.n_ff},
        {a + "attention.head_count", (uint32_t)s.n_head}, {a + "attention.head_count_kv", (uint32_t)s.n_kv_head},
        {a + "attention.key_length", (uint32_t)s.head_dim}, {a + "attention.value_length", (uint32_t)s.head_dim}};
    const std::vector<kv_f32> f32s = {{a + "rope.freq_base", s.rope_freq_base},
                                      {a + "attention.layer_norm_rms_epsilon", 1e-6f}};
    out.raw("GGUF", 4);
    out.u32(3);
    out.u64(ts.size());
    out.u64(2 + u32s.size() + f32s.size());
    out.str("general.architecture");
    out.u32((uint32_t)gguf_value_type::string);
    out.str(s.arch);
    out.str("general.name");
    out.u32((uint32_t)gguf_value_type::string);
    out.str("synthetic " + s.name + (L != s.n_layer ? " (" + std::to_string(L) + " layers)" : std::string()) +
            " " + ggml_type_name(wt));
    for (const auto& kv : u32s) {
      out.str(kv.k);
      out.u32((uint32_t)gguf_value_type::u32);
      out.u32(kv.v);
    }
    for (const auto& kv : f32s) {
      out.str(kv.k);
      out.u32((uint32_t)gguf_value_type::f32);
      out.raw(&kv.v, 4);
    }
    uint64_t offset = 0;
    for (const auto& t : ts) {
      out.str(t.name);
      const bool vec = t.n_out == 1;
      out.u32(vec ? 1 : 2);
      out.u64((uint64_t)t.n_in);
      if (!vec) out.u64((uint64_t)t.n_out);
      out.u32((uint32_t)t.type);
      out.u64(offset);
      offset += (t.bytes() + 31) / 32 * 32;
    }
    out.pad(32);
    rng r{seed};
    for (const auto& t : ts) {
      write_tensor_data(out, t, r);
      out.pad(32);
    }
    out.close();
  }
  return model::load(path);  // the mapping outlives the unlink by guard
}

}  // namespace kvq
