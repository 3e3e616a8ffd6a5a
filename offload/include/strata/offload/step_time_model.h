#pragma once
// Predicts one training step of the engine from bytes per link and the
// component rates of a hardware profile (hardware_profile.h), with the
// overlap the engine's schedule achieves (docs/engine.md, "Exact overlap";
// docs/offload-bench.md, "The step-time model"). `strata plan` prints it for
// every placement row; `strata bench offload` measures the same rows.
//
// Note [The engine's schedule, as a model]
// Per rank, with C the forward + backward compute (forward C/3, backward 2C/3):
//   - backward: each layer's gradient is reduced (reduce-scatter, rank
//     order) and, with the optimizer offloaded, copied D2H as soon as the
//     layer's backward ends; only the part longer than the backward, plus
//     the last layer's share, is exposed (exposed reduce).
//   - the optimizer of every layer is queued once the norm is known and runs
//     under the next forward (exact overlap): each updated tile goes H2D from
//     the optimizer's callback, stages 1-2 all-gather the updated shards; only
//     the part longer than the forward is exposed (exposed optimizer).
//     NVMe optimizer state is read and written around each sub-group's step
//     (serially with the default pipeline_read/pipeline_write off). The
//     forward's first layer waits for its own update, so it starts after
//     the first layers' share of the host phase (CPU step, copy back, and
//     the NVMe read and write unless both pipelines take them off the path;
//     first_update_share, or 1 / layers) and runs behind the rest:
//     exposed = max(that share, the part beyond the window) (measured 2026-12-02 on 8- and 16-block GPTs at stage 3:
//     the step was over-predicted by +14 % and +60 % when the NVMe phase was
//     charged whole; 2026-12-05 on `small`, stage 1-3: 26-28 ms exposed
//     without the pipelines, 6-8 ms with them; docs/offload-bench.md).
//   - stage 3 gathers each layer ahead of use (prefetch from the recorded
//     order; parameter offload adds the shard's H2D, and NVMe reads beyond
//     max_in_cpu); only the part longer than the compute, plus the first
//     layer's share, is exposed (exposed gather).
//   step = C + exposed optimizer + exposed reduce + exposed gather.
// With shared_cores (the cpu device) the optimizer's kernels, the copies and
// the collectives run on the cores the compute runs on, so they do not hide:
// step = C + optimizer + every transfer; only NVMe transfers (DMA, no core)
// still hide under the forward (optimizer state) or the compute (parameters),
// and the pipelines' overlap of the state's NVMe phase with the CPU step saves
// no core time.
// With early updates (strata.speculative_optimizer, where early_updates_run
// says the engine runs them) each layer's host step starts under the
// backward: it hides under forward + backward, and so does the state's NVMe
// phase on shared cores; with a ratio < 1 the device part still starts at
// the step's end and hides under the forward only.
#include <cstdint>
#include <string>

#include "strata/core/config.h"
#include "strata/core/dtype.h"
#include "strata/core/placement.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/moment_storage.h"
#include "strata/offload/hardware_profile.h"
#include "strata/offload/speculation_mode.h"

namespace strata::offload {

struct StepTimeInput {
  uint64_t params = 0;           // Psi, elements of the whole model
  int layers = 1;                // units the engine gathers / reduces one at a time (>= 1)
  // Note [The first layer's update]: the share of the parameters whose
  // update the forward waits for before its first layer computes (a GPT: the
  // embeddings and the first block); 0: one layer's, 1 / layers.
  double first_update_share = 0;
  int world = 1;                 // data-parallel ranks
  double tokens_per_rank = 0;    // per optimizer step (batch x seq x grad_accum)
  double flops_per_token = 0;    // training FLOPs (forward + backward)
  // The stage and the offload devices: the model asks it the questions
  // the engine's StatePlacement asks (Note [Placement questions] in
  // strata/core/placement.h), so the two cannot disagree on a placement.
  Placement placement;
  double ratio = 1.0;            // offload_optimizer.ratio
  DType param_dtype = DType::kBF16;
  DType grad_dtype = DType::kBF16;
  // strata.optimizer_state_dtype: the state's bytes per element on NVMe (K
  // = 4 B master + the moments: 12, 8, or ~6.03 with int8) and the CPU rate.
  cpu_adam::MomentStorage moments;
  int64_t max_live_parameters = 1'000'000'000; // stage3_max_live_parameters
  // Stage 3: padded elements (Note [Partition]) of the layers kept whole
  // (below stage3_param_persistence_threshold), all-gathered after their update;
  // at world size 1 with the shards on the device the other layers are
  // acquired in place (LayerPlacement::acquired_in_place) and move nothing.
  uint64_t persistent_params = 0;
  int64_t max_in_cpu = 1'000'000'000;          // offload_param.max_in_cpu
  bool nvme_pipeline = false;                  // offload_optimizer.pipeline_read and pipeline_write
  // Note [Early, exact updates]: strata.speculative_optimizer. Where the
  // engine runs them (early_updates_run below) the CPU step may start under
  // the backward, so on a machine whose compute is not on the optimizer's
  // cores it hides under forward + backward, not the forward; on shared
  // cores the state's NVMe phase does.
  SpeculationMode speculation = SpeculationMode::kOff;
  // Note [Gradient shards on NVMe]: each reduced gradient is written under
  // the backward and read back by the step (StatePlacement's decision).
  bool gradients_on_nvme = false;
};

// Whether these options let the CPU step start under the backward: the
// placement's rule (StatePlacement::early_updates) without auto's memory check.
bool early_updates_allowed(SpeculationMode mode, const Placement& placement);
// Whether the engine runs them on this hardware: allowed, and `auto` is off
// where the model's compute shares the host's cores (the cpu device).
bool early_updates_run(const StepTimeInput& in, const HardwareProfile& hw);

// Bytes one rank moves per step on each link, as the engine's StepMetrics count them.
struct LinkBytes {
  uint64_t h2d = 0, d2h = 0, gather = 0, reduce = 0, nvme_read = 0, nvme_write = 0;
};

struct StepTimePrediction {
  LinkBytes bytes;
  double compute_ms = 0, forward_ms = 0, backward_ms = 0;
  double optimizer_ms = 0;   // the optimizer's work (host and device parts in parallel, NVMe included)
  double update_ms = 0;      // updated parameters back: H2D, stages 1-2 all-gather
  double grad_ms = 0;        // gradients: reduce-scatter + D2H
  double param_ms = 0;       // stage 3: gathers, parameter shard H2D, NVMe parameter reads
  double nvme_ms = 0;        // NVMe reads + writes (part of optimizer_ms / param_ms)
  double exposed_optimizer_ms = 0, exposed_reduce_ms = 0, exposed_gather_ms = 0;
  double step_ms = 0;
  // Perfect overlap of independent resources: the largest of compute,
  // optimizer, update, gradients and parameters. With shared_cores not
  // reachable (they share the cores), the bound the engine's schedule aims at otherwise.
  double ideal_ms = 0;
  double tokens_per_s = 0;   // all ranks
  std::string bound;         // the resource the step waits on most: "compute", "cpu optimizer", "nvme", ...
};

// The bytes per link of one step (no rates needed). Padding is ignored
// (shards are padded to 2048 elements: < 1% on real models).
LinkBytes predict_link_bytes(const StepTimeInput& in);

// The step time on `profile` (Note [The engine's schedule, as a model]).
// Fails on inputs out of range (naming the field).
Result<StepTimePrediction> predict_step_time(const StepTimeInput& in, const HardwareProfile& profile);

}  // namespace strata::offload
