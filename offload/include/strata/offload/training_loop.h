#pragma once
// Stage-0 training on one rank: a ResidentProvider holds every parameter and
// gradient in host memory, a ModelRunner (the model on its device stream)
// runs the micro-batches against it, and the project's CPU optimizer
// (strata/cpu_adam) steps every layer. The baseline that offloaded runs are
// compared against, and what `strata train` runs. It sees the model only
// through core's contract (strata/core/layered_model.h); apps/ joins a
// concrete model to it.
//
// One step (Note [Steps and micro-batches] in layered_model.h):
//   provider.begin_step()                 (waits, then zeroes the gradients)
//   for k < grad_accum: runner.train_micro_batch(1/grad_accum); provider.end_micro_batch(k == last)
//   provider.wait_gradients()             (the model's stream finished them)
//   global gradient norm over every layer (cpu_adam grad_stats, layer order)
//   non-finite: skip; else one clipped optimizer step per layer
//
// Mixed precision: compute and gradients are fp32. Layers stored in bf16 or
// fp16 get fp32 master weights (from LayeredModel::init_layer_fp32), and the
// optimizer writes the rounded copy back into the provider's parameters in
// the same pass.

#include <cstdint>
#include <memory>

#include "strata/core/device.h"
#include "strata/core/layered_model.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/offload/resident_provider.h"

namespace strata::offload {

struct TrainingOptions {
  int grad_accum = 1;       // micro batches per optimizer step
  cpu_adam::OptimizerKind optimizer = cpu_adam::OptimizerKind::kAdamW;
  cpu_adam::HyperParams hyper{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0,
                              .bias_correction = true};
  double grad_clip = 1.0;   // global L2 norm; 0 = off
  int optimizer_threads = 0;  // 0: all cores
};

struct StepResult {
  int64_t step = 0;         // 1-based
  double loss = 0;          // mean training loss over the step's micro batches
  double grad_norm = 0;     // before clipping
  bool skipped = false;     // gradient was not finite: no update
  double tokens_per_s = 0;
  double step_ms = 0;
  // Peaks since the start of the run, per tier:
  uint64_t peak_device_bytes = 0;  // the model's Device, device tier
  uint64_t peak_pinned_bytes = 0;  // the process's pinned-host tier (every Device, pool and engine)
  uint64_t peak_host_bytes = 0;    // this loop's pageable host state: parameters, gradients, optimizer state
  uint64_t peak_nvme_bytes = 0;    // the process's nvme tier (swap files)
};

class TrainingLoop {
 public:
  // `runner` and `device` (the Device the runner's model runs on, whose
  // memory stats give peak_device_bytes) must outlive the loop.
  static Result<std::unique_ptr<TrainingLoop>> create(ModelRunner& runner, const Device& device,
                                                      const TrainingOptions& options);
  ~TrainingLoop();

  // One optimizer step over grad_accum micro batches.
  Result<StepResult> step();
  // Mean loss over the runner's evaluation batches (Pass::kEval).
  Result<double> evaluate();

  ResidentProvider& provider() { return *provider_; }
  const TrainingOptions& options() const { return options_; }
  int64_t steps_done() const { return step_; }
  // Host bytes of the training state (parameters, gradients, optimizer state).
  uint64_t host_bytes() const;

 private:
  struct OptState;
  TrainingLoop(ModelRunner& runner, const Device& device, const TrainingOptions& options);
  Status optimizer_step(double grad_norm);
  ModelRunner& runner_;
  const Device& device_;
  TrainingOptions options_;
  MemoryStats host_stats_;  // pageable host state of this loop (feeds the process's stats)
  std::unique_ptr<ResidentProvider> provider_;
  std::unique_ptr<OptState> opt_;
  int64_t step_ = 0;
};

}  // namespace strata::offload
