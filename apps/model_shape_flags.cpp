#include "model_shape_flags.h"

#include <cctype>
#include <string>

namespace strata::cli {

void ModelShapeFlags::apply_to(model::GptConfig& g) const {
  if (layers) g.n_layer = layers;
  if (heads) g.n_head = heads;
  if (embd) g.n_embd = embd;
  if (vocab) g.vocab_size = vocab;
  if (max_seq) g.max_seq_len = max_seq;
}

void add_model_shape_flags(CLI::App& cmd, ModelShapeFlags& flags, std::string_view scope) {
  using model::GptLimits;
  auto describe = [scope](std::string text) {
    if (scope.empty()) text[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(text[0])));
    return std::string(scope) + text;
  };
  cmd.add_option("--layers", flags.layers, describe("number of blocks (default: the preset's)"))
      ->check(CLI::Range(1, GptLimits::kMaxLayers));
  cmd.add_option("--heads", flags.heads, describe("attention heads, dividing --embd (default: the preset's)"))
      ->check(CLI::Range(1, GptLimits::kMaxEmbd));
  cmd.add_option("--embd", flags.embd, describe("embedding width (default: the preset's)"))
      ->check(CLI::Range(1, GptLimits::kMaxEmbd));
  cmd.add_option("--vocab", flags.vocab, describe("vocabulary size (default: the preset's)"))
      ->check(CLI::Range(GptLimits::kMinVocab, GptLimits::kMaxVocab));
  cmd.add_option("--max-seq", flags.max_seq, describe("maximum sequence length (default: the preset's)"))
      ->check(CLI::Range(1, GptLimits::kMaxSeqLen));
}

}  // namespace strata::cli
