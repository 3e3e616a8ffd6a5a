#pragma once
// Stage-0 training of the GPT on one rank: a ResidentParameters provider,
// a GptExecutor on the chosen device, and the project's CPU optimizer
// (strata/cpu_adam) stepping every layer. The baseline that offloaded
// runs are compared against, and what `strata train` runs.
//
// Mixed precision: compute and gradients are fp32. With bf16/fp16
// parameters the optimizer keeps fp32 master weights per layer and writes
// the rounded copy back into the provider's parameters in the same pass.

#include <cstdint>
#include <memory>
#include <optional>

#include "strata/core/status.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/resident_params.h"
#include "strata/model/text_data.h"

namespace strata::model {

struct TrainOptions {
  int batch = 8;            // micro batch (sequences per forward)
  int seq_len = 64;
  int grad_accum = 1;       // micro batches per optimizer step
  cpu_adam::OptimizerKind optimizer = cpu_adam::OptimizerKind::kAdamW;
  cpu_adam::HyperParams hyper{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0,
                              .bias_correction = true};
  double grad_clip = 1.0;   // global L2 norm; 0 = off
  uint64_t seed = 1234;     // initial weights and batch order
  int eval_batches = 8;     // validation batches per evaluation (fewer if the split is short)
  DeviceKind device = DeviceKind::kCpu;
  uint64_t device_memory_bytes = 0;  // 0: see GptExecutor::create
  int optimizer_threads = 0;         // 0: all cores
};

struct StepResult {
  int64_t step = 0;         // 1-based
  double loss = 0;          // mean training loss over the step's micro batches
  double grad_norm = 0;     // before clipping
  bool skipped = false;     // gradient was not finite: no update
  double tokens_per_s = 0;
  double step_ms = 0;
  uint64_t peak_device_bytes = 0;
  uint64_t peak_pinned_bytes = 0;  // stage 0 pins nothing
  uint64_t peak_host_bytes = 0;    // parameters, gradients, optimizer state
  uint64_t peak_nvme_bytes = 0;    // stage 0 swaps nothing
};

class Trainer {
 public:
  // `data` must outlive the trainer.
  static Result<std::unique_ptr<Trainer>> create(const GptConfig& config, const TrainOptions& options,
                                                 const TextDataset& data);
  ~Trainer();

  // One optimizer step over grad_accum micro batches.
  Result<StepResult> step();
  // Mean loss over the first eval_batches validation batches.
  Result<double> evaluate();

  const GptModel& model() const { return *model_; }
  ResidentParameters& params() { return *params_; }
  GptExecutor& executor() { return *executor_; }
  int64_t steps_done() const { return step_; }
  size_t eval_batch_count() const { return eval_count_; }
  uint64_t host_bytes() const;

 private:
  struct OptState;
  Trainer() = default;
  std::unique_ptr<GptModel> model_;
  std::unique_ptr<ResidentParameters> params_;
  std::unique_ptr<GptExecutor> executor_;
  std::unique_ptr<OptState> opt_;
  std::unique_ptr<BatchLoader> loader_;
  const TextDataset* data_ = nullptr;
  TrainOptions options_;
  int64_t step_ = 0;
  size_t eval_count_ = 0;
  std::vector<int32_t> inputs_, targets_;
};

}  // namespace strata::model
