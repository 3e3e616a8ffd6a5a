#pragma once
// A model as the Python side describes it to the engine (strata.engine.Engine,
// strata.torch): layers of (name, shape, dtype, trainable, weight_decay or
// None, lr_scale) tuples, torch's dtype names.
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "errors.h"
#include "torch_dtypes.h"
#include "strata/core/printable.h"
#include "strata/core/spec_model.h"

namespace strata::python {

using TensorTuple = std::tuple<std::string, std::vector<int64_t>, std::string, bool, std::optional<double>, double>;
using LayerTuple = std::pair<std::string, std::vector<TensorTuple>>;

// The layers as SpecModel descriptions; a dtype torch has but the engine
// does not is an InvalidArgument naming the tensor (raised).
inline std::vector<LayerDescription> describe_layers(const std::vector<LayerTuple>& layers) {
  std::vector<LayerDescription> described;
  described.reserve(layers.size());
  for (const auto& [layer_name, tensors] : layers) {
    LayerDescription layer{layer_name, {}};
    for (const auto& [name, shape, dtype, trainable, weight_decay, lr_scale] : tensors) {
      const DType type = value_or_raise(dtype_from_torch_name(dtype, fmt::format("tensor '{}'", printable(name, 64))));
      layer.tensors.push_back(TensorDescription{name, shape, type, trainable, weight_decay, lr_scale});
    }
    described.push_back(std::move(layer));
  }
  return described;
}

}  // namespace strata::python
