#pragma once
// A model described from outside: layers of tensor specs (name, shape,
// dtype, trainable, weight decay and lr scale per tensor), with no values of
// its own. Whoever builds it (the Python front end, a test) owns the forward
// and backward and hands the initial values to the engine layer by layer
// (Engine::put_initial_layer), so no rank ever holds the whole model.
//
//   STRATA_ASSIGN_OR_RETURN(SpecModel model, SpecModel::create({
//       {"h0", {{"h0.weight", {64, 32}, DType::kBF16}, {"h0.bias", {64}, DType::kBF16, true, 0.0}}},
//       {"embed", {{"embed.weight", {256, 32}, DType::kBF16, /*trainable=*/false}}}}));
//
// Tensors of a layer lie back to back in its flat allocation, in the order
// given. A layer has one dtype and is trainable or frozen as a whole (the
// front end splits a module that mixes them into one layer per kind).
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/layered_model.h"
#include "strata/core/status.h"

namespace strata {

struct TensorDescription {
  std::string name;
  std::vector<int64_t> shape;          // every extent >= 1; a scalar is {} (one element)
  DType dtype = DType::kF32;           // fp32, bf16 or fp16
  bool trainable = true;
  std::optional<double> weight_decay;  // absent: the optimizer's
  double lr_scale = 1.0;
};

struct LayerDescription {
  std::string name;
  std::vector<TensorDescription> tensors;
};

class SpecModel final : public LayeredModel {
 public:
  // Checks every description (names, shapes, dtypes, one dtype and one
  // trainability per layer, finite non-negative decay and lr scale) and
  // names the layer and tensor of the first problem.
  static Result<SpecModel> create(std::vector<LayerDescription> layers);

  std::span<const LayerSpec> layers() const override { return layers_; }
  // Zeros: the values come from outside (provides_initial_values()).
  Status init_layer(size_t layer_index, std::span<std::byte> params) const override;
  Status init_layer_fp32(size_t layer_index, std::span<float> values) const override;
  bool provides_initial_values() const override { return false; }

  // The layer's tensors are frozen (no gradient, no optimizer state).
  bool frozen(size_t layer_index) const;

 private:
  std::vector<LayerSpec> layers_;
};

// Whether a layer is frozen: its tensors are not trainable (all of them;
// SpecModel::create refuses a mix).
inline bool layer_frozen(const LayerSpec& layer) {
  return !layer.params.empty() && !layer.params.front().trainable;
}

}  // namespace strata
