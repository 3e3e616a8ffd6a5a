#include "strata/model/gpt_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "strata/core/printable.h"
#include "strata/core/units.h"

namespace strata::model {
namespace {

GptConfig make(std::string name, int vocab, int max_seq, int layers, int heads, int embd) {
  GptConfig c;
  c.preset = std::move(name);
  c.vocab_size = vocab;
  c.max_seq_len = max_seq;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = embd;
  return c;
}

const std::vector<GptConfig>& presets() {
  static const std::vector<GptConfig> all = {
      make("tiny", 256, 64, 2, 4, 64),
      make("small", 256, 1024, 8, 8, 512),
      make("gpt2", 50304, 1024, 12, 12, 768),
      make("gpt2-medium", 50304, 1024, 24, 16, 1024),
      make("1b", 50304, 1024, 24, 16, 2048),
  };
  return all;
}

}  // namespace

int64_t GptConfig::param_count() const {
  const int64_t C = n_embd;
  const int64_t per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) +
                            (4 * C * C + C);
  return static_cast<int64_t>(vocab_size) * C + static_cast<int64_t>(max_seq_len) * C +
         n_layer * per_block + 2 * C;
}

double GptConfig::train_flops_per_token(int seq_len) const {
  const double C = n_embd;
  const double matmul_params = n_layer * 12.0 * C * C + static_cast<double>(vocab_size) * C;
  return 6.0 * matmul_params + 12.0 * n_layer * seq_len * C;
}

std::string GptConfig::describe() const {
  return fmt::format("{}: L={} H={} C={} V={} T<={} params={} {}", preset, n_layer, n_head, n_embd,
                     vocab_size, max_seq_len, format_count(static_cast<uint64_t>(param_count())),
                     dtype_name(param_dtype));
}

Status GptConfig::validate() const {
  auto bad = [](std::string_view field, int64_t value, std::string_view hint) {
    return InvalidArgument(fmt::format("model config: {}={} is invalid; {}", field, value, hint));
  };
  using L = GptLimits;
  if (vocab_size < L::kMinVocab) return bad("vocab_size (--vocab)", vocab_size, "the byte tokenizer needs at least 256");
  if (vocab_size > L::kMaxVocab)
    return bad("vocab_size (--vocab)", vocab_size, fmt::format("use at most {}", L::kMaxVocab));
  if (max_seq_len < 1 || max_seq_len > L::kMaxSeqLen)
    return bad("max_seq_len (--max-seq)", max_seq_len, fmt::format("use 1..{}", L::kMaxSeqLen));
  if (n_layer < 1 || n_layer > L::kMaxLayers)
    return bad("n_layer (--layers)", n_layer, fmt::format("use 1..{}", L::kMaxLayers));
  if (n_head < 1 || n_head > L::kMaxEmbd) return bad("n_head (--heads)", n_head, fmt::format("use 1..{}", L::kMaxEmbd));
  if (n_embd < 1 || n_embd > L::kMaxEmbd) return bad("n_embd (--embd)", n_embd, fmt::format("use 1..{}", L::kMaxEmbd));
  if (!is_state_float(param_dtype))
    return InvalidArgument(fmt::format("model config: param dtype {} is not supported; use fp32, bf16 or fp16 "
                                       "(--dtype)", dtype_name(param_dtype)));
  if (n_embd % n_head != 0)
    return InvalidArgument(fmt::format("model config: n_embd={} is not a multiple of n_head={}; "
                                       "pick --embd divisible by --heads (e.g. {})",
                                       n_embd, n_head, (n_embd / n_head + 1) * n_head));
  return Status::Ok();
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const GptConfig& c : presets()) names.push_back(c.preset);
  return names;
}

Result<GptConfig> preset(std::string_view name) {
  for (const GptConfig& c : presets())
    if (c.preset == name) return c;
  return InvalidArgument(fmt::format("unknown model preset '{}'; valid presets: {}", printable(name, 64),
                                     fmt::join(preset_names(), ", ")));
}

}  // namespace strata::model
