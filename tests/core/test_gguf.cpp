// GGUF reader on real files (known values) and writer -> reader round trips of every value type.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/gguf_prefault.h"
#include "kvq/error.h"
#include "kvq/gguf.h"
#include "kvq/gguf_writer.h"
#include "support/data_dir.h"

namespace kvq {
namespace {

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvq_test_gguf_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

// Writes `w` to a temporary file, opens it, removes the file (the mapping stays valid).
std::unique_ptr<gguf_file> round_trip(const gguf_writer& w, const std::string& name) {
  const std::string p = tmp_path(name);
  w.write(p);
  auto f = gguf_file::open(p);
  std::filesystem::remove(p);
  return f;
}

std::string open_error(const std::vector<uint8_t>& bytes, const std::string& name) {
  const std::string p = tmp_path(name);
  {
    FILE* fp = std::fopen(p.c_str(), "wb");
    if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), fp);
    std::fclose(fp);
  }
  std::string msg;
  try {
    gguf_file::open(p);
  } catch (const error& e) {
    msg = e.what();
  }
  std::filesystem::remove(p);
  return msg;
}

TEST(gguf, stories260k_known_values) {
  KVQ_REQUIRE_DATA(path, "models/stories260K/stories260K.gguf");
  auto f = gguf_file::open(path);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 5);
  EXPECT_EQ(f->get_int("llama.embedding_length"), 64);
  EXPECT_EQ(f->get_int("llama.attention.head_count"), 8);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(f->get_int("llama.feed_forward_length"), 172);
  EXPECT_EQ(f->get_int("llama.context_length"), 2048);
  EXPECT_FLOAT_EQ((float)f->get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5f);
  EXPECT_EQ(f->get_int("tokenizer.ggml.padding_token_id"), 4294967295LL);  // u32 widened
  EXPECT_FALSE(f->try_int("llama.rope.freq_base").has_value());
  const gguf_value* toks = f->find("tokenizer.ggml.tokens");
  ASSERT_NE(toks, nullptr);
  EXPECT_EQ(toks->type, gguf_value_type::array);
  EXPECT_EQ(toks->elem_type, gguf_value_type::string);
  EXPECT_EQ(toks->arr_str.size(), 512u);
  EXPECT_EQ(toks->arr_n, 512u);
  EXPECT_EQ(toks->arr_str[0], "<unk>");
  EXPECT_EQ(toks->arr_str[1], "<s>");
  EXPECT_EQ(toks->arr_str[2], "</s>");
  const gguf_value* types = f->find("tokenizer.ggml.token_type");
  ASSERT_NE(types, nullptr);
  EXPECT_EQ(types->arr_int.size(), 512u);
  EXPECT_EQ(f->find("tokenizer.ggml.scores")->arr_float.size(), 512u);

  // 2 + 9 per layer * 5 + output_norm = 48 tensors; all f32.
  ASSERT_EQ(f->tensors().size(), 48u);
  const gguf_tensor_info& emb = f->tensor("token_embd.weight");
  EXPECT_EQ(emb.type, ggml_type::f32);
  EXPECT_EQ(emb.ne, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(emb.n_bytes, 64u * 512 * 4);
  EXPECT_EQ(f->tensor("blk.4.attn_k.weight").ne, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f->tensor("blk.0.ffn_down.weight").ne, (std::vector<int64_t>{172, 64}));
  EXPECT_EQ(f->tensor("output_norm.weight").ne, (std::vector<int64_t>{64}));
  uint64_t total = 0;
  for (const auto& t : f->tensors()) {
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    EXPECT_EQ((int64_t)t.n_bytes, t.n_elements() * 4) << t.name;
    total += t.n_bytes;
  }
  // The data section (aligned offsets, f32 sizes are multiples of 32) ends at the file end.
  const gguf_tensor_info& last = f->tensors().back();
  EXPECT_EQ((uint64_t)(last.data + last.n_bytes - f->tensors().front().data), total);
  EXPECT_THROW(f->tensor("no.such.tensor"), error);
  try {
    f->get_int("general.architecture");
    FAIL();
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("'general.architecture' has type string"), std::string::npos)
        << e.what();
  }
  try {
    f->get_string("missing.key");
    FAIL();
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_input);
    EXPECT_NE(std::string(e.what()).find("missing metadata 'missing.key'"), std::string::npos);
  }
}

TEST(gguf, tinylit_f16_tensors) {
  KVQ_REQUIRE_DATA(path, "models/tinylit-hd64-gqa4/tinylit-hd64-gqa4.gguf");
  auto f = gguf_file::open(path);
  EXPECT_EQ(f->get_int("llama.block_count"), 6);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv"), 2);
  EXPECT_DOUBLE_EQ(f->get_float("llama.rope.freq_base"), 10000.0);
  EXPECT_EQ(f->tensors().size(), 57u);
  const gguf_tensor_info& up = f->tensor("blk.3.ffn_up.weight");
  EXPECT_EQ(up.type, ggml_type::f16);
  EXPECT_EQ(up.ne, (std::vector<int64_t>{512, 1408}));
  EXPECT_EQ(up.n_bytes, 512u * 1408 * 2);
  EXPECT_EQ(f->tensor("blk.3.ffn_norm.weight").type, ggml_type::f32);
  const gguf_tensor_info& emb = f->tensor("token_embd.weight");
  const gguf_tensor_info& out = f->tensor("output.weight");
  EXPECT_EQ(emb.offset, 0u);
  EXPECT_EQ((uint64_t)(out.data - emb.data), out.offset);
  // The last tensor ends exactly at the end of the file.
  const uint64_t header = std::filesystem::file_size(path) - (out.offset + out.n_bytes);
  EXPECT_EQ(header % 32, 0u);
  EXPECT_LT(header, 20000u);
}

TEST(gguf, vocab_only_files) {
  KVQ_REQUIRE_DATA(dir, "golden/tokenizers");
  struct want {
    const char* file;
    const char* model;
    size_t n_vocab;
  };
  for (const want& w : {want{"ggml-vocab-llama-spm.gguf", "llama", 32000},
                        want{"ggml-vocab-phi-3.gguf", "llama", 32064},
                        want{"ggml-vocab-gpt-2.gguf", "gpt2", 50257},
                        want{"ggml-vocab-deepseek-llm.gguf", "gpt2", 102400}}) {
    auto f = gguf_file::open(dir + "/" + w.file);
    EXPECT_EQ(f->tensors().size(), 0u) << w.file;
    EXPECT_EQ(f->get_string("tokenizer.ggml.model"), w.model) << w.file;
    EXPECT_EQ(f->find("tokenizer.ggml.tokens")->arr_str.size(), w.n_vocab) << w.file;
  }
  auto g = gguf_file::open(dir + "/ggml-vocab-gpt-2.gguf");
  EXPECT_EQ(g->find("tokenizer.ggml.merges")->arr_str.size(), 50000u);
  EXPECT_EQ(g->get_int("tokenizer.ggml.bos_token_id"), 50256);
  auto s = gguf_file::open(dir + "/ggml-vocab-llama-spm.gguf");
  EXPECT_TRUE(s->get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_FALSE(s->get_bool("tokenizer.ggml.add_eos_token"));
}

TEST(gguf, round_trip_every_value_type) {
  for (uint32_t version : {2u, 3u}) {
    gguf_writer w;
    w.set_version(version);
    w.set_u8("v.u8", 250);
    w.set_i8("v.i8", -120);
    w.set_u16("v.u16", 65000);
    w.set_i16("v.i16", -32000);
    w.set_u32("v.u32", 4000000000u);
    w.set_i32("v.i32", -2000000000);
    w.set_u64("v.u64", 18000000000000000000ull);
    w.set_i64("v.i64", -9000000000000000000ll);
    w.set_f32("v.f32", 0.15625f);
    w.set_f64("v.f64", -1.0 / 3.0);
    w.set_bool("v.true", true);
    w.set_bool("v.false", false);
    w.set_str("v.str", std::string("h\0llo \xe2\x82\xac", 9));
    w.set_str("v.empty", "");
    w.set_arr_str("a.str", {"a", "", "ccc"});
    w.set_arr_f32("a.f32", {1.5f, -2.25f});
    w.set_arr_i32("a.i32", {-1, 7, 2147483647});
    w.set_arr_i32("a.empty", {});
    w.set_arr_raw("a.u8", gguf_value_type::u8, 3, {1, 2, 255});
    w.set_arr_raw("a.bool", gguf_value_type::boolean, 2, {1, 0});
    {
      std::vector<uint8_t> b(16);
      const double d[2] = {0.5, -7.0};
      std::memcpy(b.data(), d, 16);
      w.set_arr_raw("a.f64", gguf_value_type::f64, 2, b);
    }
    {
      std::vector<uint8_t> b(8);
      const uint64_t u = 1ull << 40;
      std::memcpy(b.data(), &u, 8);
      w.set_arr_raw("a.u64", gguf_value_type::u64, 1, b);
    }
    w.set_arr_arr_i32("a.nested", {{1, 2}, {}, {3}});
    w.set_u32("v.u32", 123);  // replacing keeps one key
    std::vector<float> vals(64);
    for (int i = 0; i < 64; ++i) vals[i] = 0.25f * (float)(i - 20);
    w.add_tensor_f32("t.f32", {32, 2}, vals);
    w.add_tensor_f32("t.f16", {8, 2, 2, 2}, vals, ggml_type::f16);
    w.add_tensor_f32("t.bf16", {64}, vals, ggml_type::bf16);
    w.add_tensor("t.q4_k", ggml_type::q4_k, {256}, std::vector<uint8_t>(144, 7));
    auto f = round_trip(w, "all_types_v" + std::to_string(version));

    EXPECT_EQ(f->version(), version);
    EXPECT_EQ(f->metadata().size(), 23u);
    auto sc = [&](const char* k) { return f->find(k); };
    EXPECT_EQ(sc("v.u8")->type, gguf_value_type::u8);
    EXPECT_EQ(f->get_int("v.u8"), 250);
    EXPECT_EQ(f->get_int("v.i8"), -120);
    EXPECT_EQ(f->get_int("v.u16"), 65000);
    EXPECT_EQ(f->get_int("v.i16"), -32000);
    EXPECT_EQ(f->get_int("v.u32"), 123);
    EXPECT_EQ(f->get_int("v.i32"), -2000000000);
    EXPECT_EQ(std::get<uint64_t>(sc("v.u64")->scalar), 18000000000000000000ull);
    EXPECT_THROW(f->get_int("v.u64"), error);  // does not fit int64
    EXPECT_EQ(f->get_int("v.i64"), -9000000000000000000ll);
    EXPECT_EQ(f->get_float("v.f32"), 0.15625);
    EXPECT_EQ(f->get_float("v.f64"), -1.0 / 3.0);
    EXPECT_EQ(f->get_float("v.i32"), -2e9);
    EXPECT_TRUE(f->get_bool("v.true"));
    EXPECT_FALSE(f->get_bool("v.false"));
    EXPECT_THROW(f->get_bool("v.u8"), error);
    EXPECT_EQ(f->get_string("v.str"), std::string("h\0llo \xe2\x82\xac", 9));
    EXPECT_EQ(f->get_string("v.empty"), "");
    EXPECT_EQ(*f->try_string("v.empty"), "");
    EXPECT_FALSE(f->try_float("nope").has_value());
    EXPECT_EQ(sc("a.str")->arr_str, (std::vector<std::string>{"a", "", "ccc"}));
    EXPECT_EQ(sc("a.f32")->arr_float, (std::vector<double>{1.5, -2.25}));
    EXPECT_EQ(sc("a.i32")->arr_int, (std::vector<int64_t>{-1, 7, 2147483647}));
    EXPECT_EQ(sc("a.empty")->arr_n, 0u);
    EXPECT_EQ(sc("a.empty")->elem_type, gguf_value_type::i32);
    EXPECT_EQ(sc("a.u8")->arr_int, (std::vector<int64_t>{1, 2, 255}));
    EXPECT_EQ(sc("a.bool")->arr_int, (std::vector<int64_t>{1, 0}));
    EXPECT_EQ(sc("a.f64")->arr_float, (std::vector<double>{0.5, -7.0}));
    EXPECT_EQ(sc("a.u64")->arr_int, (std::vector<int64_t>{1ll << 40}));
    EXPECT_EQ(sc("a.nested")->elem_type, gguf_value_type::array);
    EXPECT_EQ(sc("a.nested")->arr_n, 3u);
    EXPECT_THROW(f->get_string("a.str"), error);

    ASSERT_EQ(f->tensors().size(), 4u);
    const gguf_tensor_info& t32 = f->tensor("t.f32");
    EXPECT_EQ(t32.ne, (std::vector<int64_t>{32, 2}));
    float v5;
    std::memcpy(&v5, t32.data + 5 * 4, 4);
    EXPECT_EQ(v5, vals[5]);
    const gguf_tensor_info& t16 = f->tensor("t.f16");
    EXPECT_EQ(t16.ne.size(), 4u);
    EXPECT_EQ(t16.n_elements(), 64);
    EXPECT_EQ(t16.n_bytes, 128u);
    EXPECT_EQ(f->tensor("t.bf16").type, ggml_type::bf16);
    const gguf_tensor_info& tk = f->tensor("t.q4_k");
    EXPECT_EQ(tk.n_bytes, 144u);
    EXPECT_EQ(tk.data[143], 7);
    for (const auto& t : f->tensors()) EXPECT_EQ((uintptr_t)t.data % 32, 0u) << t.name;
  }
}

TEST(gguf, custom_alignment) {
  gguf_writer w;
  w.set_alignment(64);
  w.set_str("general.architecture", "llama");
  w.add_tensor_f32("a", {3}, {1, 2, 3});
  w.add_tensor_f32("b", {5}, {4, 5, 6, 7, 8});
  auto f = round_trip(w, "align64");
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(f->tensor("b").offset, 64u);
  float x;
  std::memcpy(&x, f->tensor("b").data + 4, 4);
  EXPECT_EQ(x, 5.0f);
}

// Resident bytes (Rss in /proc/self/smaps) of the mapping that holds address p; -1 when none does.
int64_t resident_bytes_at(const void* p) {
  std::ifstream f("/proc/self/smaps");
  const uintptr_t a = (uintptr_t)p;
  bool in = false;
  for (std::string line; std::getline(f, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream ls(line);
    if (line.find(':') > line.find(' ') && (ls >> std::hex >> lo >> dash >> hi) && dash == '-') {
      in = lo <= a && a < hi;  // a mapping's header line: "lo-hi perms offset dev inode path"
    } else if (in && line.rfind("Rss:", 0) == 0) {
      return std::stoll(line.substr(4)) * 1024;  // "Rss:   123 kB"
    }
  }
  return -1;
}

// gguf_prefault maps every page of the tensor data into the process (what kvq server does before it
// listens, issue 16): opening touches the header and metadata only, so a large tensor is not
// resident until it is read; after gguf_prefault the whole mapping is.
TEST(gguf, prefault_maps_every_tensor_page) {
  gguf_writer w;
  w.set_str("general.architecture", "llama");
  const size_t n_bytes = 16u << 20;  // 16 MiB of q8_0 blocks (34 bytes per 32 values)
  const size_t n_blocks = n_bytes / 34;
  std::vector<uint8_t> blocks(n_blocks * 34);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (uint8_t)(i * 131);
  w.add_tensor("t.q8_0", ggml_type::q8_0, {(int64_t)n_blocks * 32}, blocks);
  auto f = round_trip(w, "prefault");
  const gguf_tensor_info& t = f->tensor("t.q8_0");
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const int64_t before = resident_bytes_at(t.data);
  ASSERT_GE(before, 0) << "no mapping holds the tensor";
  EXPECT_LT(before, (int64_t)blocks.size() / 4) << "the tensor was resident before prefault";
  EXPECT_EQ(gguf_prefault(*f), blocks.size());  // the one tensor's bytes
  // the mapping holds the header page(s) before the tensor and the tensor's pages: all resident
  const int64_t end = (int64_t)(((uintptr_t)t.data + blocks.size() + page - 1) & ~(uintptr_t)(page - 1));
  const int64_t first = (int64_t)((uintptr_t)t.data & ~(uintptr_t)(page - 1));
  EXPECT_GE(resident_bytes_at(t.data), end - first);
  EXPECT_EQ(t.data[12345], blocks[12345]);  // the data is unchanged
}

TEST(gguf, type_names_and_blocks) {
  EXPECT_STREQ(ggml_type_name(ggml_type::q4_0), "q4_0");
  EXPECT_STREQ(ggml_type_name(ggml_type::bf16), "bf16");
  EXPECT_STREQ(ggml_type_name((ggml_type)4), "type4");
  EXPECT_STREQ(ggml_type_name((ggml_type)1000), "type1000");
  EXPECT_EQ(ggml_block_elems(ggml_type::q8_0), 32);
  EXPECT_EQ(ggml_block_bytes(ggml_type::q8_0), 34);
  EXPECT_EQ(ggml_block_bytes(ggml_type::q4_0), 18);
  EXPECT_EQ(ggml_block_bytes(ggml_type::bf16), 2);
  EXPECT_EQ(ggml_block_elems(ggml_type::q4_k), 256);
  EXPECT_EQ(ggml_block_bytes(ggml_type::q6_k), 210);
  EXPECT_EQ(ggml_block_elems(ggml_type::iq2_xxs), 0);  // kvq does not compute with it
  EXPECT_EQ(ggml_storage_block_elems(ggml_type::q4_k), 256);
  EXPECT_EQ(ggml_storage_block_bytes(ggml_type::q6_k), 210);
  EXPECT_EQ(ggml_storage_block_bytes((ggml_type)4), 0);
}

// --- malformed files built by hand -------------------------------------------------------------

std::vector<uint8_t> valid_bytes() {
  gguf_writer w;
  w.set_str("general.architecture", "llama");
  w.set_u32("llama.block_count", 1);
  w.add_tensor_f32("w", {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  return w.bytes();
}

void expect_error(const std::vector<uint8_t>& b, const std::string& name, const std::string& needle) {
  const std::string msg = open_error(b, name);
  EXPECT_NE(msg.find("[gguf] "), std::string::npos) << name << ": " << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << name << ": got '" << msg << "'";
}

template <class T>
void poke(std::vector<uint8_t>& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}

TEST(gguf, malformed_headers) {
  std::vector<uint8_t> b = valid_bytes();
  EXPECT_EQ(open_error(b, "ok"), "");
  {
    auto c = b;
    c[0] = 'X';
    expect_error(c, "magic", "bad magic");
  }
  {
    auto c = b;
    poke<uint32_t>(c, 4, 1);
    expect_error(c, "v1", "unsupported GGUF version 1");
    poke<uint32_t>(c, 4, 0x03000000);
    expect_error(c, "be", "big-endian");
  }
  {
    auto c = b;
    poke<uint64_t>(c, 8, 1ull << 40);
    expect_error(c, "ntensors", "tensor count 1099511627776 is absurd");
    c = b;
    poke<uint64_t>(c, 16, ~0ull);
    expect_error(c, "nkv", "metadata count 18446744073709551615 is absurd");
  }
  {
    auto c = b;
    poke<uint64_t>(c, 24, 1ull << 50);  // first key length
    expect_error(c, "keylen", "runs past the end");
  }
  expect_error(std::vector<uint8_t>(b.begin(), b.begin() + 40), "trunc", "metadata");
  expect_error({}, "empty", "empty");
}

TEST(gguf, malformed_values_and_tensors) {
  auto build = [](auto&& fn) {
    gguf_writer w;
    fn(w);
    return w.bytes();
  };
  // duplicate key: write two keys then rename the second to the first
  {
    auto b = build([](gguf_writer& w) {
      w.set_u32("dup.a", 1);
      w.set_u32("dup.b", 2);
    });
    const size_t second = 24 + 8 + 5 + 4 + 4 + 8;
    ASSERT_EQ(b[second + 4], 'b');
    b[second + 4] = 'a';
    expect_error(b, "dupkey", "duplicate metadata key 'dup.a'");
  }
  {
    auto b = build([](gguf_writer& w) { w.set_u32("k", 1); });
    poke<uint32_t>(b, 24 + 8 + 1, 13);
    expect_error(b, "vtype", "metadata 'k' type: unknown value type 13");
  }
  {
    auto b = build([](gguf_writer& w) { w.set_bool("k", true); });
    b[24 + 8 + 1 + 4] = 2;
    expect_error(b, "bool", "bool value 2");
  }
  {
    auto b = build([](gguf_writer& w) { w.set_arr_i32("k", {1, 2}); });
    poke<uint64_t>(b, 24 + 8 + 1 + 4 + 4, 1ull << 61);
    expect_error(b, "arrcount", "array of 2305843009213693952 i32 elements cannot fit");
  }
  {
    auto b = build([](gguf_writer& w) { w.set_u32("general.alignment", 48); });
    expect_error(b, "align48", "'general.alignment' = 48 is not a power of two");
  }
  {
    auto b = build([](gguf_writer& w) { w.set_str("general.alignment", "x"); });
    expect_error(b, "alignstr", "'general.alignment' has type string");
  }
  auto with_tensor = [&](ggml_type t, std::vector<int64_t> ne, size_t bytes) {
    return build([&](gguf_writer& w) {
      w.add_tensor("tt", (ggml_type)999, ne, std::vector<uint8_t>(bytes));  // unknown id: no checks
    });
  };
  // layout: header 24 | name len 8 + "tt" | n_dims 4 | ne... | type 4 | offset 8
  {
    auto b = with_tensor(ggml_type::f32, {4}, 16);
    const size_t type_at = 24 + 10 + 4 + 8;
    poke<uint32_t>(b, type_at, (uint32_t)ggml_type::f32);
    EXPECT_EQ(open_error(b, "tensor_ok"), "");
    poke<uint32_t>(b, type_at, (uint32_t)ggml_type::q8_0);
    expect_error(b, "blk", "ne[0] = 4 is not a multiple of the q8_0 block size 32");
    poke<uint32_t>(b, type_at, (uint32_t)ggml_type::f64);  // 32 bytes > 16 available
    expect_error(b, "past", "tensor 'tt' data at offset 0 + 32 bytes runs past the end");
    poke<uint32_t>(b, type_at, (uint32_t)ggml_type::f32);
    poke<uint64_t>(b, type_at + 4, 8);
    expect_error(b, "misaligned", "data offset 8 is not a multiple of the alignment 32");
    poke<uint64_t>(b, type_at + 4, ~0ull - 31);
    expect_error(b, "hugeoff", "runs past the end");
    poke<uint64_t>(b, type_at + 4, 0);
    poke<uint64_t>(b, 24 + 10 + 4, 0);
    expect_error(b, "dim0", "dimension ne[0] = 0");
    poke<uint32_t>(b, 24 + 10, 5);
    expect_error(b, "ndims", "n_dims 5 is not in [1, 4]");
  }
  {
    auto b = with_tensor(ggml_type::f32, {1ll << 32, 1ll << 32}, 0);
    expect_error(b, "overflow", "element count overflows");
  }
  {
    auto b = build([](gguf_writer& w) {
      w.add_tensor_f32("same", {1}, {1});
      w.add_tensor_f32("same", {1}, {2});
    });
    expect_error(b, "duptensor", "duplicate tensor name 'same'");
  }
  EXPECT_THROW(gguf_file::open("/nonexistent/dir/x.gguf"), error);
  try {
    gguf_file::open("/nonexistent/dir/x.gguf");
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::io);
  }
}

}  // namespace
}  // namespace kvq
