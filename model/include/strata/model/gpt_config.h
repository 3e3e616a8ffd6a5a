#pragma once
// Shape of a GPT-2 style decoder and its named presets.
//
//   tiny         L=2  H=4  C=64   vocab 256    max_seq 64    (~0.13M, tests)
//   small        L=8  H=8  C=512  vocab 256    max_seq 1024  (~25.8M)
//   gpt2         L=12 H=12 C=768  vocab 50304  max_seq 1024  (~124M)
//   gpt2-medium  L=24 H=16 C=1024 vocab 50304  max_seq 1024  (~355M)
//   1b           L=24 H=16 C=2048 vocab 50304  max_seq 1024  (~1.3B)
//
// The GPT-2 sized presets keep GPT-2's (padded) vocabulary so that their
// parameter counts, memory and FLOPs are the familiar ones; with the byte
// tokenizer only ids 0..255 occur in the data. Every field can be overridden.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::model {

// The shapes validate() accepts; the CLI's --layers, --heads, --embd,
// --vocab and --max-seq take exactly these ranges.
struct GptLimits {
  static constexpr int kMaxLayers = 1024;
  static constexpr int kMaxEmbd = 65536;  // also the most heads (n_embd is a multiple of n_head)
  static constexpr int kMaxSeqLen = 65536;
  static constexpr int kMinVocab = 256;   // the byte tokenizer's ids
  static constexpr int kMaxVocab = 1 << 24;
};

struct GptConfig {
  std::string preset = "custom";
  int vocab_size = 256;
  int max_seq_len = 64;
  int n_layer = 2;
  int n_head = 4;
  int n_embd = 64;
  DType param_dtype = DType::kF32;

  // Parameter count (elements) including the tied embedding once.
  int64_t param_count() const;
  // Training FLOPs per token for sequence length T: 6 * (non-embedding params
  // + LM head) + 12 * L * T * C for attention (forward 1/3, backward 2/3).
  double train_flops_per_token(int seq_len) const;
  // "gpt2: L=12 H=12 C=768 V=50304 T<=1024 params=124.48M fp32"
  std::string describe() const;
  // Checks every field; names the offending field and gives a hint.
  Status validate() const;
};

// Names accepted by preset().
std::vector<std::string> preset_names();
// Looks up a preset; unknown names list the valid ones. The message names
// no flag (the name may come from --preset, --model or --calibrate-model):
// callers add theirs with with_context.
Result<GptConfig> preset(std::string_view name);

}  // namespace strata::model
