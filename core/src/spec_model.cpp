// SpecModel (spec_model.h): a LayeredModel built from tensor descriptions.
#include "strata/core/spec_model.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata {

namespace {

constexpr int64_t kMaxElements = int64_t{1} << 48;  // far above any tensor; keeps byte counts from overflowing

std::string where(size_t li, const LayerDescription& l, const TensorDescription* t = nullptr) {
  std::string s = fmt::format("layer {} '{}'", li, printable(l.name, 64));
  if (t != nullptr) s += fmt::format(", tensor '{}'", printable(t->name, 64));
  return s;
}

}  // namespace

Result<SpecModel> SpecModel::create(std::vector<LayerDescription> layers) {
  if (layers.empty()) return InvalidArgument("a model needs at least one layer");
  SpecModel m;
  m.layers_.reserve(layers.size());
  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerDescription& d = layers[li];
    if (d.name.empty()) return InvalidArgument(fmt::format("layer {} has no name", li));
    if (d.tensors.empty())
      return InvalidArgument(fmt::format("{} has no tensors; leave a layer without parameters out of the model",
                                         where(li, d)));
    LayerSpec spec;
    spec.name = d.name;
    const DType dtype = d.tensors.front().dtype;
    const bool trainable = d.tensors.front().trainable;
    for (const TensorDescription& t : d.tensors) {
      if (t.name.empty()) return InvalidArgument(fmt::format("{}: a tensor has no name", where(li, d)));
      if (!is_state_float(t.dtype))
        return InvalidArgument(fmt::format("{}: dtype {} is not fp32, bf16 or fp16", where(li, d, &t),
                                           dtype_name(t.dtype)));
      if (t.dtype != dtype)
        return InvalidArgument(fmt::format("{}: dtype {} differs from the layer's first tensor ({}); a layer has one "
                                           "dtype: put tensors of another dtype in a layer of their own",
                                           where(li, d, &t), dtype_name(t.dtype), dtype_name(dtype)));
      if (t.trainable != trainable)
        return InvalidArgument(fmt::format("{} is {} but the layer's first tensor is {}; a layer is trainable or "
                                           "frozen as a whole: put frozen tensors in a layer of their own",
                                           where(li, d, &t), t.trainable ? "trainable" : "frozen",
                                           trainable ? "trainable" : "frozen"));
      if (t.weight_decay && !(std::isfinite(*t.weight_decay) && *t.weight_decay >= 0.0))
        return InvalidArgument(fmt::format("{}: weight_decay {} must be finite and >= 0", where(li, d, &t),
                                           *t.weight_decay));
      if (!(std::isfinite(t.lr_scale) && t.lr_scale >= 0.0))
        return InvalidArgument(fmt::format("{}: lr_scale {} must be finite and >= 0", where(li, d, &t), t.lr_scale));
      int64_t n = 1;
      for (int64_t e : t.shape) {
        if (e < 1)
          return InvalidArgument(fmt::format("{}: shape extent {} must be >= 1", where(li, d, &t), e));
        if (n > kMaxElements / e)
          return InvalidArgument(fmt::format("{}: the shape has more than 2^48 elements", where(li, d, &t)));
        n *= e;
      }
      ParamTensorSpec p;
      p.name = t.name;
      p.shape = t.shape;
      p.dtype = t.dtype;
      p.offset_elements = spec.param_count;
      p.offset_bytes = spec.param_count * dtype_size(t.dtype);
      p.trainable = t.trainable;
      p.weight_decay = t.weight_decay;
      p.lr_scale = t.lr_scale;
      spec.param_count += static_cast<size_t>(n);
      if (spec.param_count > static_cast<size_t>(kMaxElements))
        return InvalidArgument(fmt::format("{}: the layer has more than 2^48 elements", where(li, d)));
      spec.params.push_back(std::move(p));
    }
    spec.param_bytes = spec.param_count * dtype_size(dtype);
    m.layers_.push_back(std::move(spec));
  }
  return m;
}

Status SpecModel::init_layer(size_t layer_index, std::span<std::byte> params) const {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("layer {} is out of range (the model has {})", layer_index, layers_.size()));
  std::memset(params.data(), 0, params.size());
  return Status::Ok();
}

Status SpecModel::init_layer_fp32(size_t layer_index, std::span<float> values) const {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("layer {} is out of range (the model has {})", layer_index, layers_.size()));
  std::fill(values.begin(), values.end(), 0.0f);
  return Status::Ok();
}

bool SpecModel::frozen(size_t layer_index) const {
  return layer_index < layers_.size() && layer_frozen(layers_[layer_index]);
}

}  // namespace strata
