#pragma once
// The model-shape flags --layers, --heads, --embd, --vocab and --max-seq that
// override a GPT preset, shared by train, plan, estimate and bench offload so
// that each takes the model's own ranges (model::GptLimits) and says them
// the same way in --help.
#include <string_view>

#include <CLI/CLI.hpp>

#include "strata/model/gpt_config.h"

namespace strata::cli {

struct ModelShapeFlags {
  int layers = 0, heads = 0, embd = 0, vocab = 0, max_seq = 0;  // 0: not given (the preset's)

  // `g` with every given flag applied; GptConfig::validate checks the result.
  void apply_to(model::GptConfig& g) const;
};

// Adds the five flags to `cmd`, each bounded by GptLimits (an explicit 0 is
// refused). `scope` starts each description: "" or e.g. "With --model: ".
void add_model_shape_flags(CLI::App& cmd, ModelShapeFlags& flags, std::string_view scope);

}  // namespace strata::cli
