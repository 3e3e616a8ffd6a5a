#pragma once
// The GPT-2 style decoder as a LayeredModel: its layers, their parameter
// tensors, and their seeded initial values.
//
// Layers, in order:
//   0        "embedding"   wte [V, C], wpe [max_seq, C]   (wte is also the LM head)
//   1..L     "h<l>"        ln1.{weight,bias}, attn.qkv.{weight [3C,C], bias},
//                          attn.proj.{weight [C,C], bias}, ln2.{weight,bias},
//                          mlp.fc.{weight [4C,C], bias}, mlp.proj.{weight [C,4C], bias}
//   L+1      "final_norm"  lnf.{weight,bias}
// Each layer's tensors lie back to back in one flat allocation, in this
// order, with no padding (offset_bytes = offset_elements * dtype size).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/core/layered_model.h"
#include "strata/model/gpt_config.h"

namespace strata::model {

// Index of each tensor inside a block layer's spec.
enum BlockTensor : int {
  kLn1W = 0, kLn1B, kQkvW, kQkvB, kAttnProjW, kAttnProjB,
  kLn2W, kLn2B, kFcW, kFcB, kFcProjW, kFcProjB, kBlockTensorCount
};
enum EmbeddingTensor : int { kWte = 0, kWpe = 1 };
enum FinalTensor : int { kLnfW = 0, kLnfB = 1 };

class GptModel final : public LayeredModel {
 public:
  // Validates the config. `seed` fixes every initial value.
  static Result<std::unique_ptr<GptModel>> create(const GptConfig& config, uint64_t seed);

  const GptConfig& config() const { return config_; }
  uint64_t seed() const { return seed_; }
  std::span<const LayerSpec> layers() const override { return layers_; }
  // GPT-2 initialisation: weights N(0, 0.02), residual projections
  // N(0, 0.02/sqrt(2L)), biases 0, LayerNorm weight 1. Each layer draws from
  // its own stream (seed, layer index), so layers initialise independently.
  Status init_layer(size_t layer_index, std::span<std::byte> params) const override;
  Status init_layer_fp32(size_t layer_index, std::span<float> values) const override;
  // Same values as init_layer, in fp32 / fp64 (before any dtype rounding of
  // the stored copy; used by optimizers' fp32 master weights and tests).
  void init_layer_values(size_t layer_index, std::span<float> out) const;
  void init_layer_values(size_t layer_index, std::span<double> out) const;

  size_t embedding_layer() const { return 0; }
  size_t block_layer(int block) const { return 1 + static_cast<size_t>(block); }
  size_t final_layer() const { return layers_.size() - 1; }

 private:
  GptModel(const GptConfig& config, uint64_t seed);
  template <typename T>
  void init_values(size_t layer_index, std::span<T> out) const;
  GptConfig config_;
  uint64_t seed_;
  std::vector<LayerSpec> layers_;
};

}  // namespace strata::model
