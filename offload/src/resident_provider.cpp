#include "strata/offload/resident_provider.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::offload {
namespace {
void* alloc64(size_t bytes) { return std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64); }
}  // namespace

Result<std::unique_ptr<ResidentProvider>> ResidentProvider::create(const LayeredModel& model, MemoryStats& stats) {
  std::unique_ptr<ResidentProvider> p(new ResidentProvider(stats));
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
    const uint64_t bytes = l.param_bytes + l.grad_count * sizeof(float);
    p->bytes_ += bytes;
    stats.on_allocate(Tier::kPageableHost, bytes);
    STRATA_RETURN_IF_ERROR(model.init_layer(i, {l.params, l.param_bytes}));
    std::memset(l.grads, 0, l.grad_count * sizeof(float));
  }
  return p;
}

ResidentProvider::~ResidentProvider() {
  // The model's stream may still write a gradient; never free under it.
  (void)wait_gradients();
  for (Layer& l : layers_) {
    std::free(l.params);
    std::free(l.grads);
  }
  if (bytes_ != 0) stats_.on_free(Tier::kPageableHost, bytes_);
}

Result<LayerMemory> ResidentProvider::acquire(size_t layer_index, Pass pass) {
  if (layer_index >= layers_.size())
    return InvalidArgument(fmt::format("acquire: layer {} out of range ({} layers)", layer_index, layers_.size()));
  Layer& l = layers_[layer_index];
  if (l.held++ == 0) {
    ++held_now_;
    max_held_ = std::max(max_held_, held_now_);
  }
  record(HookEvent::acquire(layer_index, pass));
  LayerMemory mem;
  mem.params = l.params;
  mem.params_tier = Tier::kPageableHost;
  if (pass == Pass::kBackward) {
    mem.grads = l.grads;
    mem.grad_dtype = DType::kF32;
    mem.grads_tier = Tier::kPageableHost;
  }
  return mem;  // ready: default, already complete
}

Status ResidentProvider::release(size_t layer_index, Pass pass, const Completion& done) {
  if (layer_index >= layers_.size() || layers_[layer_index].held == 0)
    return Internal(fmt::format("release: layer {} ({}) is not held", layer_index, pass_name(pass)));
  Layer& l = layers_[layer_index];
  if (--l.held == 0) --held_now_;
  if (pass == Pass::kBackward) l.grads_done = done;
  record(HookEvent::release(layer_index, pass));
  return Status::Ok();
}

Status ResidentProvider::begin_step() {
  record(HookEvent::begin_step());
  // Blocking on purpose: zeroing is a host write into buffers the model's
  // stream may still be accumulating into (the last step's backward).
  STRATA_RETURN_IF_ERROR(wait_gradients());
  zero_grads();
  return Status::Ok();
}

Status ResidentProvider::end_micro_batch(bool last) {
  record(HookEvent::end_micro_batch(last));
  return Status::Ok();
}

Status ResidentProvider::wait_gradients() {
  Status first;
  for (Layer& l : layers_) {
    // Blocking on purpose: the caller (norm, optimizer) reads the gradient on
    // the host next; stage 0 has nothing to overlap with it. The engine will
    // chain per-layer work on grads_done instead of waiting here.
    Status st = l.grads_done.wait();
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

std::span<std::byte> ResidentProvider::params(size_t i) {
  STRATA_CHECK(i < layers_.size(), "params: layer index out of range");
  return {layers_[i].params, layers_[i].param_bytes};
}

std::span<float> ResidentProvider::grads(size_t i) {
  STRATA_CHECK(i < layers_.size(), "grads: layer index out of range");
  return {layers_[i].grads, layers_[i].grad_count};
}

void ResidentProvider::zero_grads() {
  for (Layer& l : layers_) std::memset(l.grads, 0, l.grad_count * sizeof(float));
}

}  // namespace strata::offload
