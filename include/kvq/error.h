// kvq error model. The library never calls exit(); every failure is a kvq::error whose message
// starts with the operation name in brackets, e.g. "[gguf] model.gguf: tensor 'blk.0.attn_q.weight'
// offset 123456 + 4096 bytes runs past the end of the file (100000 bytes)".
#pragma once
#include <stdexcept>
#include <string>

namespace kvq {

enum class errc {
  invalid_input,  // bad user input or malformed file (tools exit with code 2)
  unsupported,    // valid input that kvq does not implement (tools exit with code 2)
  io,             // file cannot be opened/read/written (tools exit with code 2)
  internal,       // a bug in kvq (tools exit with code 1)
  count
};

class error : public std::runtime_error {
 public:
  error(errc code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  errc code() const noexcept { return code_; }

 private:
  errc code_;
};

[[noreturn]] inline void fail(errc code, const std::string& msg) { throw error(code, msg); }
[[noreturn]] inline void fail_input(const std::string& msg) { throw error(errc::invalid_input, msg); }
[[noreturn]] inline void fail_unsupported(const std::string& msg) { throw error(errc::unsupported, msg); }

}  // namespace kvq

#define KVQ_ASSERT(cond)                                                                          \
  do {                                                                                            \
    if (!(cond))                                                                                  \
      ::kvq::fail(::kvq::errc::internal, std::string("[assert] ") + __FILE__ + ":" +              \
                                             std::to_string(__LINE__) + ": " #cond);              \
  } while (0)
