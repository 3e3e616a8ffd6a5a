#pragma once
// The simplest ParameterProvider: every layer's parameters (in their
// declared dtypes) and fp32 gradients live in pageable host memory for the
// whole run, one flat allocation per layer: a provider for tests and
// benchmarks that drive a model by hand (the training baseline is the
// engine at stage 0, engine.h).
//
// Contract details (strata/core/layered_model.h):
//  - ready: always an already-complete Completion (the bytes never move);
//  - begin_step() zeroes every gradient; a gradient is read only after
//    wait_gradients(), which waits for the `done` of each layer's last
//    kBackward release (the model's stream may still be writing it);
//  - kEval acquires hand out no gradient buffer.
// It records every hook (acquire, release, begin_step, end_micro_batch) when
// recording is on, so tests and the engine can see the sequence.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/layered_model.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"

namespace strata::offload {

struct HookEvent {
  enum class Kind : uint8_t { kAcquire, kRelease, kBeginStep, kEndMicroBatch };
  Kind kind = Kind::kAcquire;
  size_t layer = 0;            // kAcquire, kRelease
  Pass pass = Pass::kForward;  // kAcquire, kRelease
  bool last = false;           // kEndMicroBatch
  bool operator==(const HookEvent&) const = default;

  static HookEvent acquire(size_t layer, Pass pass) { return {Kind::kAcquire, layer, pass, false}; }
  static HookEvent release(size_t layer, Pass pass) { return {Kind::kRelease, layer, pass, false}; }
  static HookEvent begin_step() { return {Kind::kBeginStep, 0, Pass::kForward, false}; }
  static HookEvent end_micro_batch(bool last) { return {Kind::kEndMicroBatch, 0, Pass::kForward, last}; }
};

class ResidentProvider final : public ParameterProvider {
 public:
  // Allocates and initialises every layer through model.init_layer(). The
  // bytes are counted in the pageable-host tier of `stats` (and so of the
  // process) until destruction.
  static Result<std::unique_ptr<ResidentProvider>> create(const LayeredModel& model, MemoryStats& stats);
  ~ResidentProvider() override;
  ResidentProvider(const ResidentProvider&) = delete;
  ResidentProvider& operator=(const ResidentProvider&) = delete;

  Result<LayerMemory> acquire(size_t layer_index, Pass pass) override;
  Status release(size_t layer_index, Pass pass, const Completion& done) override;
  Status begin_step() override;
  Status end_micro_batch(bool last) override;

  // Waits until the model's stream has finished every gradient it was
  // handed; returns the first failure (the stream's Status) in layer order.
  Status wait_gradients();

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
    Completion grads_done;  // `done` of the latest kBackward release
  };
  explicit ResidentProvider(MemoryStats& stats) : stats_(stats) {}
  void record(const HookEvent& e) {
    if (recording_) events_.push_back(e);
  }
  MemoryStats& stats_;
  std::vector<Layer> layers_;
  uint64_t bytes_ = 0;
  size_t held_now_ = 0, max_held_ = 0;
  bool recording_ = false;
  std::vector<HookEvent> events_;
};

}  // namespace strata::offload
