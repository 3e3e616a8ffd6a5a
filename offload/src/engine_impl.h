#pragma once
// Engine::Impl: one rank's engine, the orchestrator of its components
// (Note [How the engine is built] in docs/engine.md):
//   EngineContext (engine_context.h)          options, partition, placement, device, comm, streams,
//                                             transfer counters, step failures, bounded waits
//   ParameterGathering (parameter_gathering.h) the 16-bit parameters: kept whole or sharded, gathers,
//                                             prefetch along the recorded trace, live and reuse caps
//   GradientReduction (gradient_reduction.h)  gradient buffers, reductions in canonical order, the norm
//   UpdateScheduler (update_scheduler.h)      optimizer state tiers, optimizer threads, per-layer updates
//   StepNvmeBytes (step_nvme_bytes.h)         a step's NVMe bytes, counted where that I/O is complete
//   CommitPoint (commit_point.h)              the vote, commit or rollback of the pending step
//   CheckpointIO (checkpoint_io.h)            asynchronous snapshots, atomic saves, loads
// Impl itself holds what the step's calls share: where the driving thread
// is (Phase, StepInProgress), the step counters, the schedule and loss
// scaler, the exposed-wait probes; engine.cpp (set-up, public methods),
// engine_passes.cpp (acquire, release), engine_step.cpp (the step's calls,
// evaluation) and engine_recovery.cpp (marks, bounded waits) implement it; engine.cpp
// also joins checkpoints to the step counters and loss scaler.
//
// Threads: the driving thread calls the step's calls (Note [Driving the
// engine]) and acquire/release. It issues every collective (one issuing
// thread per comm queue: kReduce for gradients, norms and losses, kGather
// for stage-3 gathers in acquire order, kUpdate for the gathers that follow
// a persistent layer's update, in update order: a gate per layer, so a
// gather waiting for a late update never holds up the next forward's). The
// optimizer runs on UpdateScheduler's threads; copies and memsets run on
// `xfer`, a stream of the Device; frees on `frees`; the zeroing of gradient
// buffers on `zeroing` (Note [Gradient buffers zeroed apart]) and the H2D of
// host parameter shards on `shard_h2d`, so neither waits behind a gradient's
// copy out. Completions order everything (docs/async.md); the driving thread
// blocks only where the step needs a number (the loss, the global norm).
#include <atomic>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "checkpoint_io.h"
#include "commit_point.h"
#include "engine_context.h"
#include "gradient_reduction.h"
#include "gradient_spill.h"
#include "parameter_gathering.h"
#include "serial_worker.h"
#include "step_nvme_bytes.h"
#include "update_scheduler.h"
#include "strata/comm/host_collective.h"
#include "strata/offload/checkpoint.h"
#include "strata/offload/engine.h"
#include "strata/offload/loss_scaler.h"
#include "strata/offload/lr_schedule.h"

namespace strata::offload {

using namespace engine_detail;

// Wall-clock moments of one pass's wait for a layer's parameters, filled by
// callbacks on other threads.
struct WaitProbe {
  size_t layer = 0;
  bool backward = false;                // in a micro-batch's backward (after its first backward acquire)
  std::atomic<int64_t> reached_ns{-1};  // the model's stream reached the layer
  std::atomic<int64_t> update_ns{-1};   // the optimizer's update of the layer was in place
  std::atomic<int64_t> ready_ns{-1};    // everything the layer waited for was done
};

struct Engine::Impl : EngineContext {
  Impl(const EngineOptions& o, ModelRunner* r, const LayeredModel& m, Device& d, comm::Communicator& c)
      : EngineContext(o, m, d, c), runner(r) {}

  ModelRunner* runner = nullptr;  // null: a caller drives (Note [Driving the engine])
  Engine* self = nullptr;
  Stream* model_stream = nullptr;
  std::optional<LrSchedule> schedule;
  std::optional<LossScaler> scaler;
  EngineMemory predicted;
  std::string job_name;  // the swap folders' run name, the same on every rank

  // Note [Gradient shards on NVMe]: null unless the placement puts them
  // there (EngineContext::gradient_spill points to it); outlives the
  // components that use it.
  std::unique_ptr<GradientSpill> gradient_spill_owner;
  // The components (declaration order: each is built on the ones before it).
  ParameterGathering params{*this};
  UpdateScheduler updates{*this, params};
  GradientReduction grads{*this, updates};
  StepNvmeBytes nvme_bytes{*this, updates};
  CommitPoint commit{*this, params, updates, grads, nvme_bytes,
                     [this](const StepMark& m) { return restore_counters(m); }};

  std::optional<double> caller_lr;  // set_step_lr(): the lr of every step from then on
  // Note [Early, exact updates]: whether the next step starts its updates
  // under its backward; not after a step that clipped (gradient norms change
  // slowly, so its early updates would most likely be redone).
  bool speculate_next_step = true;
  int64_t optimizer_steps = 0;  // applied updates (steps_begun, in the context, counts steps begun)
  // Every layer's initial values are in place (put_initial_layer, for a model without its own).
  std::vector<bool> initialized;

  // Where the driving thread is (Note [Driving the engine]): set by the
  // bracket calls, read by acquire and release.
  using Phase = Engine::Phase;
  // Atomic: Engine::phase() may be asked from another thread (a front end
  // deciding whether the engine can be handed over) while this one moves it.
  std::atomic<Phase> phase{Phase::kIdle};
  static const char* phase_name(Phase p);
  Status expect_phase(Phase want, const char* call) const;
  // Checkpoints hold every layer's master weights and moments; a frozen
  // layer has neither, and its parameters are not saved yet: refused,
  // naming it, before anything is written or read (every rank alike).
  Status expect_frozen_layers_initialized(const char* call) const;
  Status expect_initialized() const;
  // The step in progress (begin_step .. finish_step).
  struct StepInProgress {
    Clock::time_point started;
    double scale = 1;             // the loss scale
    int micro = 0;                // micro-batches begun
    bool last_micro = false;      // the one in progress is the step's last
    Clock::time_point micro_started;
    // The micro-batch in progress is in its backward: it acquired a layer
    // for backward (from then on until end_micro_batch it counts as backward).
    bool in_backward = false;
    Clock::time_point backward_started;
    double forward_ms = 0;        // micro-batches' forwards: begin_micro_batch .. first backward acquire
    double backward_ms = 0;       // micro-batches' backwards: first backward acquire .. end_micro_batch
    double loss_sum = 0;          // this rank's micro-batch mean losses
    uint64_t tokens = 0;
  } progress;
  std::vector<std::shared_ptr<WaitProbe>> probes;  // this step's exposed-wait probes
  StateTierIoStats io_before;  // the tier's counters at the start of the step (its wait times)

  EngineMemory plan() const;
  Status init();
  // init()'s steps, in order.
  Status place_state();
  Result<std::string> agree_swap_job_name();
  Status init_components();
  Status check_plan_fits_device() const;
  Status check_plan_fits_host_budget() const;
  Status init_layers();
  Status init_layer(size_t li);
  Result<LayerMemory> acquire(size_t li, Pass pass, AcquireWaiter waiter = AcquireWaiter::model_stream());
  Status release(size_t li, Pass pass, const Completion& done, const Completion& memory_returned = {});
  Status put_initial_layer(size_t li, std::span<const std::byte> params, std::span<const float> fp32);
  Status begin_step();
  double gradient_scale() const { return progress.scale / (static_cast<double>(opt.grad_accum) * world); }
  Status begin_micro_batch(bool last);
  Status end_micro_batch(double mean_loss, int64_t tokens);
  Result<StepOutcome> finish_step();
  Status abandon_step();
  Status begin_evaluation();
  Result<double> finish_evaluation(double loss_sum, int64_t batches);
  // The runner-driven loops over the calls above.
  Result<StepMetrics> step();
  Result<double> evaluate();
  // The step's updates queued (and, with overlap off, committed); its metrics.
  Result<StepMetrics> finish_applied_step();
  // Its steps, in order.
  Result<double> wait_for_backwards();
  Result<double> step_norm_squared();
  Status check_step_finite(double loss, bool finite_norm, double grad_norm) const;
  Status apply_or_skip_step(const StepMark& call, bool finite, double scale, StepMetrics& m);
  void report_step_times(StepMetrics& m, Clock::time_point t0, double bwd_ms, double wait_reduce_ms, bool finite,
                         double previous_update_ms);
  void report_exposed_waits(StepMetrics& m) const;
  void report_step_traffic(StepMetrics& m);
  // The hyper-parameters of optimizer step `step` (1-based): the lr of
  // set_step_lr() or the schedule, the schedule's betas.
  cpu_adam::HyperParams hyper_of_step(int64_t step) const;
  // The updates of a step whose early updates (Note [Early, exact updates])
  // ran: kept, redone or queued in forward order; counts into `m`.
  Status queue_step_updates(const StepMark& call, double clip, double scale, const cpu_adam::HyperParams& hyper,
                            StepMetrics& m);

  // Note [Atomic steps] in engine.h (engine_recovery.cpp).
  StepMark mark() const;
  // The counters, loss scale and data position back at `m` (not the
  // gradients' zeroing: CommitPoint and abandon_step say that themselves).
  Status restore_counters(const StepMark& m);
  StepMark step_start;  // the counters at begin_step() (the step in progress is dropped back to them)

  // Last: its writer thread is joined first, before anything a save's task may use.
  CheckpointIO checkpoints{*this, params, updates};
};

}  // namespace strata::offload
