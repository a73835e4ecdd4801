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
#include "kvq/gguf_writer.h"

namespace kvq {

std::vector<model_shape> model_shapes() {
  // name, arch, n_layer, n_embd, n_head, n_kv_head, head_dim, n_ff, n_vocab, n_ctx_train, rope base, tied
  return {
      {"llama3-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 8192, 500000.0f, false},
      // Llama-3.1-8B: Llama-3-8B's shape with a 128K context (its llama3 RoPE scaling is not modelled:
      // the speed does not depend on it)
      {"llama3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072, 500000.0f, false},
      {"llama3.2-1b", "llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0f, true},
      {"mistral-7b", "llama", 32, 4096, 32, 8, 128, 14336, 32768, 32768, 1000000.0f, false},
      {"qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 64, 4864, 151936, 32768, 1000000.0f, true},
      {"qwen2.5-1.5b", "qwen2", 28, 1536, 12, 2, 128, 8960, 151936, 32768, 1000000.0f, true},
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

model_hparams shape_hparams(const model_shape& s, int n_layer) {
  if (n_layer < 0) fail_input("[bench] synthetic model layers " + std::to_string(n_layer) + " must be >= 0");
  model_hparams hp;
  hp.arch = s.arch;
  hp.n_layer = n_layer > 0 ? n_layer : s.n_layer;
  hp.name = "synthetic " + s.name + (hp.n_layer != s.n_layer ? " (" + std::to_string(hp.n_layer) + " layers)" : "") + " f16";
  hp.n_vocab = s.n_vocab;
  hp.n_embd = s.n_embd;
  hp.n_head = s.n_head;
  hp.n_kv_head = s.n_kv_head;
  hp.head_dim = s.head_dim;
  hp.n_ff = s.n_ff;
  hp.n_ctx_train = s.n_ctx_train;
  hp.n_rot = s.head_dim;
  hp.rope_freq_base = s.rope_freq_base;
  hp.rms_eps = 1e-6f;  // the value make_synthetic_model writes
  hp.attn_scale = (float)(1.0 / std::sqrt((double)s.head_dim));
  hp.rope = (s.arch == "qwen2" || s.arch == "qwen3") ? rope_type::neox : rope_type::norm;
  hp.qkv_bias = s.arch == "qwen2";
  hp.qk_norm = s.arch == "qwen3";
  hp.tied_output = s.tied_output;
  hp.layers.assign(hp.n_layer, layer_hparams{0, hp.rope_freq_base, hp.rope_freq_scale});
  const int64_t E = s.n_embd, dq = (int64_t)s.n_head * s.head_dim, dkv = (int64_t)s.n_kv_head * s.head_dim;
  hp.n_params = (int64_t)s.n_vocab * E * (s.tied_output ? 1 : 2) + E +
                hp.n_layer * (2 * E + E * (dq + 2 * dkv) + dq * E + 3 * E * (int64_t)s.n_ff +
                              (hp.qkv_bias ? dq + 2 * dkv : 0) + (hp.qk_norm ? 2 * s.head_dim : 0));
  return hp;
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

struct tensor_spec {
  std::string name;
  ggml_type type;
  int64_t n_in, n_out;  // ne[0], ne[1] (n_out = 1: a vector)
  bool bias = false;     // f32 vector of uniform values in [-0.5, 0.5] (qwen2's q/k/v biases), not ones
};

// Streams one tensor's random data (uniform, variance 1/n_in; vectors = 1, biases U(-0.5, 0.5)).
void write_tensor_data(const gguf_writer::byte_sink& out, const tensor_spec& t, rng& r) {
  const int64_t n = t.n_in * t.n_out;
  std::vector<uint8_t> buf;
  buf.reserve(1 << 22);
  const float a = std::sqrt(3.0f / (float)t.n_in);  // U(-a, a) has variance 1/n_in
  auto flush = [&](bool force) {
    if (force || buf.size() >= (1u << 22) - 64) {
      out(buf.data(), buf.size());
      buf.clear();
    }
  };
  if (t.type == ggml_type::f32) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = t.bias ? (float)(r.next() >> 11) * 0x1.0p-53f - 0.5f : 1.0f;
      buf.insert(buf.end(), (const uint8_t*)&v, (const uint8_t*)&v + 4);
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
  } else {  // q8_0: int8 uniform in [-127, 127] x d; q4_0: nibbles uniform in [0, 15] -> (nibble - 8) x d
    const bool q8 = t.type == ggml_type::q8_0;
    const uint16_t d = f32_to_f16(a / (q8 ? 127.0f : 8.0f));
    for (int64_t b = 0; b < n / 32; ++b) {
      buf.push_back((uint8_t)d);
      buf.push_back((uint8_t)(d >> 8));
      for (int k = 0; k < (q8 ? 4 : 2); ++k) {  // 32 bytes (q8_0) or 16 (q4_0), 8 per random word
        uint64_t x = r.next();
        for (int j = 0; j < 8; ++j, x >>= 8) {
          uint8_t byte = (uint8_t)(x & 0xff);
          if (q8 && byte == 0x80) byte = 0x81;  // int8 -128 -> -127
          buf.push_back(byte);
        }
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
    if (s.arch == "qwen2") {
      ts.push_back({b + "attn_q.bias", ggml_type::f32, dq, 1, true});
      ts.push_back({b + "attn_k.bias", ggml_type::f32, dkv, 1, true});
      ts.push_back({b + "attn_v.bias", ggml_type::f32, dkv, 1, true});
    }
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

  const std::string a = s.arch + ".";
  gguf_writer w;
  w.set_str("general.architecture", s.arch);
  w.set_str("general.name", "synthetic " + s.name +
                                (L != s.n_layer ? " (" + std::to_string(L) + " layers)" : std::string()) + " " +
                                ggml_type_name(wt));
  w.set_u32(a + "context_length", (uint32_t)s.n_ctx_train);
  w.set_u32(a + "embedding_length", (uint32_t)E);
  w.set_u32(a + "block_count", (uint32_t)L);
  w.set_u32(a + "feed_forward_length", (uint32_t)s.n_ff);
  w.set_u32(a + "attention.head_count", (uint32_t)s.n_head);
  w.set_u32(a + "attention.head_count_kv", (uint32_t)s.n_kv_head);
  w.set_u32(a + "attention.key_length", (uint32_t)s.head_dim);
  w.set_u32(a + "attention.value_length", (uint32_t)s.head_dim);
  w.set_f32(a + "rope.freq_base", s.rope_freq_base);
  w.set_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  rng r{seed};
  for (const auto& t : ts) {
    const std::vector<int64_t> ne = t.n_out == 1 ? std::vector<int64_t>{t.n_in} : std::vector<int64_t>{t.n_in, t.n_out};
    w.add_tensor_streamed(t.name, t.type, ne, [&r, &t](const gguf_writer::byte_sink& out) { write_tensor_data(out, t, r); });
  }
  w.write(path, "bench");
  return model::load(path);  // the mapping outlives the unlink by guard
}

}  // namespace kvq
