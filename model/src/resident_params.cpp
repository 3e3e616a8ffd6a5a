#include "strata/model/resident_params.h"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::model {
namespace {
void* alloc64(size_t bytes) { return std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64); }
}  // namespace

Result<std::unique_ptr<ResidentParameters>> ResidentParameters::create(const LayeredModel& model) {
  std::unique_ptr<ResidentParameters> p(new ResidentParameters());
  for (size_t i = 0; i < model.layers().size(); ++i) {
    const LayerSpec& spec = model.layers()[i];
    Layer l;
    l.param_bytes = spec.param_bytes;
    l.grad_count = spec.param_count;
    l.params = static_cast<std::byte*>(alloc64(l.param_bytes));
    l.grads = static_cast<float*>(alloc64(l.grad_count * sizeof(float)));
    if (l.params == nullptr || l.grads == nullptr) {
      std::free(l.params);
      std::free(l.grads);
      return OutOfMemory(fmt::format("host memory: cannot allocate {} for layer '{}'; use a smaller preset",
                                     format_bytes(l.param_bytes + 4 * l.grad_count, true), spec.name));
    }
    p->layers_.push_back(l);
    p->bytes_ += l.param_bytes + l.grad_count * sizeof(float);
    STRATA_RETURN_IF_ERROR(model.init_layer(i, {l.params, l.param_bytes}));
    std::memset(l.grads, 0, l.grad_count * sizeof(float));
  }
  return p;
}

ResidentParameters::~ResidentParameters() {
  for (Layer& l : layers_) {
    std::free(l.params);
    std::free(l.grads);
  }
}

Result<LayerMemory> ResidentParameters::acquire(size_t layer_index, Pass pass) {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("acquire: layer {} out of range ({} layers)", layer_index, layers_.size()));
  Layer& l = layers_[layer_index];
  if (l.held++ == 0) {
    ++held_now_;
    max_held_ = std::max(max_held_, held_now_);
  }
  if (recording_) events_.push_back({layer_index, pass, true});
  return LayerMemory{l.params, pass == Pass::kBackward ? l.grads : nullptr};
}

Status ResidentParameters::release(size_t layer_index, Pass pass) {
  if (layer_index >= layers_.size() || layers_[layer_index].held == 0)
    return Internal(fmt::format("release: layer {} ({}) is not held", layer_index, pass_name(pass)));
  if (--layers_[layer_index].held == 0) --held_now_;
  if (recording_) events_.push_back({layer_index, pass, false});
  return Status::Ok();
}

std::span<std::byte> ResidentParameters::params(size_t i) {
  STRATA_CHECK(i < layers_.size(), "params: layer index out of range");
  return {layers_[i].params, layers_[i].param_bytes};
}

std::span<float> ResidentParameters::grads(size_t i) {
  STRATA_CHECK(i < layers_.size(), "grads: layer index out of range");
  return {layers_[i].grads, layers_[i].grad_count};
}

void ResidentParameters::zero_grads() {
  for (Layer& l : layers_) std::memset(l.grads, 0, l.grad_count * sizeof(float));
}

}  // namespace strata::model
