// A model, its tokenizer and a text tokenized as kvq perplexity tokenizes it (BOS first): the
// set-up shared by the tests that evaluate a model on a text file. Header-only, so that
// kvq_test_support itself needs no layer above cache (KVQ_BUILD_RUNTIME=OFF).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/model.h"
#include "kvq/perplexity.h"
#include "kvq/tokenizer.h"

namespace kvq::test {

struct model_text {
  std::unique_ptr<model> m;
  std::unique_ptr<tokenizer> tok;
  std::vector<int32_t> ids;  // the whole text
};

inline model_text load_model_text(const std::string& model_path, const std::string& text_path) {
  model_text l;
  l.m = model::load(model_path);
  l.tok = tokenizer::from_gguf(l.m->gguf());
  l.ids = perplexity_tokenize(*l.tok, read_text_file(text_path));
  return l;
}

}  // namespace kvq::test
