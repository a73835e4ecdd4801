// kvq tokenize: print token ids of a text, as llama-tokenize --ids.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "kvq/gguf.h"
#include "kvq/tokenizer.h"

namespace kvq::cli {
namespace {

struct tokenize_opts {
  std::string model_path, prompt;
  bool no_bos = false, no_parse_special = false, show_pieces = false;
};

int run_tokenize(tokenize_opts& o) {
  auto f = gguf_file::open(o.model_path);
  auto tok = tokenizer::from_gguf(*f);
  const auto ids = tok->encode(o.prompt, !o.no_bos && tok->add_bos_default(), !o.no_parse_special);
  if (o.show_pieces) {
    for (int32_t id : ids) std::printf("%6d -> '%s'\n", id, tok->token_to_piece(id, /*special=*/true).c_str());
    return 0;
  }
  std::printf("%s\n", json_text(nlohmann::json(ids)).c_str());
  return 0;
}

const registrar reg{{"tokenize", "print the token ids of a text", [](CLI::App* app) {
  auto o = std::make_shared<tokenize_opts>();
  app->add_option("-m,--model", o->model_path, "GGUF model (or vocabulary-only GGUF) file")->required();
  app->add_option("-p,--prompt", o->prompt, "text to tokenize")->required();
  app->add_flag("--no-bos", o->no_bos, "do not add BOS");
  app->add_flag("--no-parse-special", o->no_parse_special, "do not recognise special tokens in the text");
  app->add_flag("--pieces", o->show_pieces, "print one id and its piece per line (control tokens as their text, as llama-tokenize --show-pieces)");
  return [o] { return run_tokenize(*o); };
}}};

}  // namespace
}  // namespace kvq::cli
