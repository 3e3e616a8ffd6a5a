#pragma once
// The simplest ParameterProvider: every layer's parameters (in their
// declared dtypes) and fp32 gradients live in host memory for the whole
// run, one flat allocation per layer. This is ZeRO stage 0 without
// offload, the baseline every offloaded run is compared against. It also
// records the hook sequence so tests and the engine can see it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/core/layered_model.h"
#include "strata/core/status.h"

namespace strata::model {

struct HookEvent {
  size_t layer = 0;
  Pass pass = Pass::kForward;
  bool acquire = true;  // false: release
  bool operator==(const HookEvent&) const = default;
};

class ResidentParameters final : public ParameterProvider {
 public:
  // Allocates and initialises every layer through model.init_layer().
  static Result<std::unique_ptr<ResidentParameters>> create(const LayeredModel& model);
  ~ResidentParameters() override;
  ResidentParameters(const ResidentParameters&) = delete;
  ResidentParameters& operator=(const ResidentParameters&) = delete;

  Result<LayerMemory> acquire(size_t layer_index, Pass pass) override;
  Status release(size_t layer_index, Pass pass) override;

  std::span<std::byte> params(size_t layer_index);
  std::span<float> grads(size_t layer_index);
  void zero_grads();
  size_t layer_count() const { return layers_.size(); }

  // Host bytes held (parameters + gradients).
  uint64_t bytes() const { return bytes_; }
  // Largest number of layers held (acquired, not yet released) at once.
  size_t max_layers_held() const { return max_held_; }
  void set_recording(bool on) { recording_ = on; }
  const std::vector<HookEvent>& events() const { return events_; }
  void clear_events() { events_.clear(); }

 private:
  struct Layer {
    std::byte* params = nullptr;
    size_t param_bytes = 0;
    float* grads = nullptr;
    size_t grad_count = 0;
    int held = 0;
  };
  ResidentParameters() = default;
  std::vector<Layer> layers_;
  uint64_t bytes_ = 0;
  size_t held_now_ = 0, max_held_ = 0;
  bool recording_ = false;
  std::vector<HookEvent> events_;
};

}  // namespace strata::model
