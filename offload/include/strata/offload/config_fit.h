#pragma once
// Fitting a DeepSpeed config to memory caps: from "it does not fit" to a
// config that trains (`strata plan --fit`, `strata train --fit`).
//
// Note [Config fit]
// The engine knows every byte it will hold before it allocates anything
// (plan_engine_memory, a pure function of the options and the placement),
// so the search runs the plan itself, never an estimate:
//   1. candidates: every placement the engine runs (stage 0-3, optimizer
//      state none/cpu/nvme, parameters none/cpu/nvme at stage 3, ratio
//      0.75/0.5/0.25 at stage 3 + cpu), for each parameter dtype and each
//      optimizer-state storage (strata.optimizer_state_dtype) the caller
//      allows (the config's own when it allows none; int8 only where the
//      state is offloaded, ratio 1), with the NVMe placements only where an
//      NVMe folder was given;
//   2. each candidate starts from the user's knobs and lowers, one at a
//      time and only as far as needed, the knobs that bound a tier
//      (bisection: the plan is monotone in each): the device by
//      reduce_bucket_size, then stage3_max_live_parameters (with
//      stage3_prefetch_bucket_size kept at or below it); the host by the
//      NVMe slots (offload_optimizer.buffer_count, sub_group_size) and
//      offload_param.max_in_cpu / buffer_count. offload_param.buffer_size is
//      set to the largest NVMe shard when below it (the engine refuses a
//      smaller slot); pipeline_read/pipeline_write are turned on with the
//      optimizer state on NVMe (the step-time model: reads and writes overlap
//      the step);
//   3. a candidate fits when, on every rank, the plan's device bytes plus the
//      model's own buffers (the caller's device_reserve) are at most the
//      device cap, the pinned bytes at most the host cap's share per rank,
//      and the NVMe files (both versions of the optimizer state, the spare
//      room the swap stores reserve, their slots) at most the NVMe space;
//   4. fitting candidates are ranked by the step-time model's prediction,
//      ties by the config's own placement first, then by fewer changed keys, then by the candidate order above
//      (deterministic). The first is the answer; every changed key carries
//      its reason.
// With no fit, the closest candidate's shortfall is named per tier, and the
// search is run again with one thing changed (bf16, more ranks, a smaller
// micro batch) to say the smallest change that fits.
// Bounded: at most 3 dtypes x 3 storages x 3 gradient dtypes x 22 placements x (a few bisections of <= 64
// plans each), each plan O(layers x sub-groups x ranks); well under a second
// for a 113M-parameter GPT.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/dtype.h"
#include "strata/core/layered_model.h"
#include "strata/core/status.h"
#include "strata/offload/engine.h"
#include "strata/offload/hardware_profile.h"
#include "strata/offload/step_time_model.h"

namespace strata::offload {

struct FitCaps {
  uint64_t device_bytes = 0;  // per rank: the device's capacity (> 0)
  uint64_t host_bytes = 0;    // per node: pinned host memory for the engine (strata.host_memory_budget; > 0)
  // Per node: free space for NVMe state; nullopt: no NVMe folder given (no NVMe placement).
  std::optional<uint64_t> nvme_bytes;
  std::string nvme_path;  // where the NVMe state goes (written as both nvme_path keys)
  int ranks_per_node = 1;
};

struct FitRequest {
  // The model's layers (any parameter dtype: the search re-types them).
  std::vector<LayerSpec> layers;
  // The user's config ("auto" resolved; defaults when none was given).
  Config config;
  // Parameter dtypes the search may use; empty: the config's precision only.
  std::vector<DType> dtypes;
  // Optimizer-state storages the search may use; empty: the config's
  // strata.optimizer_state_dtype only. (A storage changes what training
  // computes, so the fit never picks one the caller did not allow.)
  std::vector<cpu_adam::MomentStorage> moment_storages;
  // Gradient accumulation dtypes (data_types.grad_accum_dtype) the search
  // may use; empty: the config's own (its key, or the training dtype without
  // one). Like a storage it changes what training computes (the gradients'
  // rounding), so the fit picks one only when allowed.
  std::vector<DType> grad_dtypes;
  int world = 1;
  int micro_batch = 1;
  int seq = 64;
  int grad_accum = 1;
  double flops_per_token = 0;  // training FLOPs per token (forward + backward)
  // Device bytes the model itself holds beside the engine (activations,
  // working copies) for a parameter dtype, gradient dtype and micro batch.
  std::function<uint64_t(DType param, DType grad, int micro_batch)> device_reserve;
  PlannedDevice device = PlannedDevice::cpu();
  HardwareProfile profile;
};

// One key the fit changed, with why.
struct FitChange {
  std::string key;     // "zero_optimization.reduce_bucket_size"
  std::string before;  // "500000000"
  std::string after;   // "589824"
  std::string reason;  // "the bucket must fit the device beside the live layers"
};

// Per-rank bytes of a candidate (the worst rank), against the caps.
struct FitMemory {
  uint64_t device = 0;          // engine plan + device_reserve
  uint64_t device_engine = 0;   // the plan's part
  uint64_t pinned = 0;          // per rank
  uint64_t nvme = 0;            // per rank: files the NVMe stores may hold
};

struct FitCandidate {
  std::string label;  // "s3 opt=nvme param=cpu bf16" (+ " m=int8" for moments not in fp32)
  Config config;      // the fitted config (complete: config_to_json writes it)
  EngineOptions options;
  FitMemory memory;
  bool fits = false;
  // What bounds it: for a fitting one, the tightest tier ("device 91% of the cap");
  // else what is missing ("NVMe needs 2.75 GiB, /mnt/nvme has 1.20 GiB free").
  std::string bound;
  std::vector<FitChange> changes;
  StepTimePrediction predicted;
};

struct FitResult {
  std::vector<FitCandidate> fitting;   // ranked, fastest first
  std::vector<FitCandidate> rejected;  // every other candidate, with its shortfall (candidate order)
  // With no fit: what is missing (the closest candidate's shortfall) and the
  // smallest single changes that fit ("--ranks 4", "--batch 2", "bf16").
  std::string missing;
  std::vector<std::string> suggestions;
  bool ok() const { return !fitting.empty(); }
};

// The search (Note [Config fit]). Errors only for bad inputs (caps of 0, a
// world, batch or profile out of range), naming the flag; no fit is a
// FitResult with no fitting candidate.
Result<FitResult> fit_config(const FitRequest& request, const FitCaps& caps);

// For a single placement the caller already chose (a `strata plan` row):
// the knobs that make it fit, or its shortfall. Same rules as fit_config.
Result<FitCandidate> fit_placement(const FitRequest& request, const FitCaps& caps, int stage, OffloadDevice optimizer,
                                   OffloadDevice param, double ratio, DType dtype,
                                   const cpu_adam::MomentStorage& moments);

// "1.5 GiB" style, and the knob's value as DeepSpeed writes it.
std::string describe_fit_change(const FitChange& change);

}  // namespace strata::offload
