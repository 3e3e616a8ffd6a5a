#pragma once
// Placement rows: one way of placing a model's training state (ZeRO stage,
// where the optimizer state and the parameters live, the offloaded fraction
// of the optimizer state, the parameter dtype). `strata bench offload`
// measures rows and `strata plan` predicts them; both read the same row
// files and build the same default matrix.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/model/gpt_config.h"
#include "strata/offload/engine.h"
#include "strata/offload/step_time_model.h"

namespace strata::cli {

struct PlacementRow {
  int stage = 0;
  OffloadDevice optimizer = OffloadDevice::kNone;
  OffloadDevice param = OffloadDevice::kNone;
  double ratio = 1.0;  // offload_optimizer.ratio (< 1: stage 3, optimizer cpu, params none)
  DType dtype = DType::kBF16;
  // strata.optimizer_state_dtype; unset: the base options' (a --config's, else fp32).
  std::optional<cpu_adam::MomentStorage> moments;
  // strata.gradient_shards (Note [Gradient shards on NVMe]); unset: the base options' (auto).
  std::optional<offload::GradientShardsMode> gradient_shards;
  bool gradients_on_nvme() const { return gradient_shards == offload::GradientShardsMode::kNvme; }
  // strata.speculative_optimizer (Note [Early, exact updates]); unset: the base options' (auto).
  std::optional<offload::SpeculationMode> speculation;
  // offload_optimizer.pipeline_read / pipeline_write of an NVMe optimizer
  // row; unset: the base options' (DeepSpeed's false).
  std::optional<bool> pipeline_read, pipeline_write;

  // The stage and offload devices as the engine and the step-time model ask them.
  Placement placement() const { return {stage, optimizer, param}; }
  // Everything on the device: the rows penalties are measured against.
  bool in_memory() const { return !placement().optimizer_offloaded() && !placement().params_offloaded(); }
  bool uses_nvme() const { return placement().uses_nvme(); }
  // "s3 opt=cpu param=none r=0.50 bf16" (+ " m=int8" for a row's own moments not in fp32, " grads=nvme" for
  // gradient shards on NVMe, " early=on" or " early=off" for a row's own strata.speculative_optimizer,
  // " pipe=rw" (r, w, off) for a row's own NVMe pipelining)
  std::string label() const;
  // Why the engine cannot run this row at all (whatever the memory), or "".
  std::string unsupported_reason() const;
  // `base` with this row's stage, placement, ratio, gradient dtype (the
  // parameters'; fp16 gets DeepSpeed's dynamic loss scale), moments and gradient shards when it has its
  // own; a base's gradient shards on NVMe become auto on a row without the optimizer state there.
  offload::EngineOptions apply(offload::EngineOptions base) const;
};

// The default matrix for each moment storage and dtype: the 16 placements
// `strata estimate` prints (stage 0; stages 1-2 x optimizer none/cpu/nvme;
// stage 3 x optimizer x params), then stage 3 + optimizer cpu at ratios
// 0.25, 0.5 and 0.75; for moments other than fp32 only the rows the engine
// can run with them (int8: optimizer offloaded, ratio 1). No `moments`: one
// matrix whose rows keep the base options' moments.
std::vector<PlacementRow> default_matrix(const std::vector<DType>& dtypes,
                                         const std::vector<cpu_adam::MomentStorage>& moments = {});

// "fp32,bf16" -> dtypes; each must be fp32, bf16 or fp16, and given once. `flag` names the
// culprit, `what` the dtypes' role in the message ("parameter", "gradient").
Result<std::vector<DType>> parse_dtype_list(const std::string& text, const char* flag, const char* what = "parameter");
// "fp32,int8" -> moment storages (strata.optimizer_state_dtype values), each given once. `flag` names the culprit.
Result<std::vector<cpu_adam::MomentStorage>> parse_moment_list(const std::string& text, const char* flag);

// A row file: {"rows": [{"stage": 3, "offload_optimizer": "cpu", "offload_param": "none", "ratio": 0.5,
// "dtype": "bf16", "optimizer_state_dtype": "int8", "gradient_shards": "auto", "speculative_optimizer": "on",
// "pipeline_read": true, "pipeline_write": true}, ...]} (or the bare array; the pipeline keys need the
// optimizer state on NVMe). stage is required; the rest default to none, none, 1, `default_dtype`, fp32 and
// the base options' gradient shards and speculation. Unknown keys, wrong types and out-of-range values are errors naming the file, the row and
// the key. The file is read strictly (strata/core/json_file.h: bounded, regular files only, no duplicate
// keys).
Result<std::vector<PlacementRow>> load_rows(const std::string& path, DType default_dtype);

// The rows --configs FILE names (when given), else --matrix (only "default"):
// what `bench offload` and `plan` both run over. `moments` are the
// --optimizer-states given (empty: not given). With --configs, a non-default
// --matrix, --optimizer-states or more than one --dtype (which the file's rows
// would ignore) are refused. Errors name the flags.
Result<std::vector<PlacementRow>> select_rows(const std::string& configs, const std::string& matrix,
                                              const std::vector<DType>& dtypes,
                                              const std::vector<cpu_adam::MomentStorage>& moments = {});

// The step-time model's input for `row` of the reference GPT `g` (its own
// dtype: the row's) on `world` ranks, `batch` x `seq` x `grad_accum` tokens per rank; layers
// below `persistence_threshold` elements stay whole at stage 3.
offload::StepTimeInput gpt_step_input(const model::GptConfig& g, const PlacementRow& row, int world, int batch, int seq,
                                      int grad_accum,
                                      int64_t persistence_threshold = offload::EngineOptions{}.persistence_threshold);

// The order rows run in repeat `repeat` (0-based) of `row_count` rows: the
// list rotated left by `repeat`, so every row takes every position in turn
// and drift on a shared machine does not favour the rows that run first.
std::vector<size_t> interleaved_order(size_t row_count, size_t repeat);

}  // namespace strata::cli
