#pragma once
// EarlyUpdates: a step's early, exact updates (Note [Early, exact updates]
// in update_scheduler.h) and the order a versioned tier reads ahead in
// (Note [Read-ahead at the step's end] in docs/engine.md). Private to
// offload/src; the UpdateScheduler owns one (UpdateScheduler::early()).
//
// It decides when a layer is stepped early, with which assumed arguments,
// and what the step's end does with it (kept, redone, undone); it builds a
// layer's jobs and steps it through the scheduler that owns it (jobs_of,
// step_layer, queue_device_part, on its optimizer thread and stream, into
// its LayerUpdate), which is why it is the scheduler's friend.
//
// Threads: the driving thread calls; the early updates run on the
// optimizer thread.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine_context.h"
#include "gradient_reduction.h"
#include "parameter_gathering.h"
#include "piece_stepper.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/state_tier.h"
#include "update_scheduler.h"

namespace strata::offload::engine_detail {

class StepNvmeBytes;  // step_nvme_bytes.h

class EarlyUpdates {
 public:
  EarlyUpdates(EngineContext& ctx, ParameterGathering& params, UpdateScheduler& updates)
      : ctx_(ctx), params_(params), updates_(updates) {}

  // init_layer: piece `id` is opened next in the forward order (the order of
  // the tier's add()).
  void add_to_forward_walk(const StateId& id) { forward_walk_.push_back(id); }

  // The step's last micro-batch begins: early updates assume step number
  // `step`, loss scale `scale`, `hyper` (its lr and betas), clip
  // coefficient 1 and finite gradients until close().
  // `previous_step_bytes`, when given (the previous step's updates of state
  // on NVMe are still pending): on the optimizer thread, before the step's
  // first early update (the updates queued before it have run), the
  // previous step's updates end there (StepNvmeBytes::previous_updates_done;
  // Note [A step's NVMe bytes]).
  void open(int64_t step, double scale, const cpu_adam::HyperParams& hyper, StepNvmeBytes* previous_step_bytes);
  bool is_open() const { return open_; }
  // Layer li's reduced gradient is in: its update is queued now.
  Status queue(size_t li, const GradientReduction::UpdateInput& input);
  // The step's end (or its abandonment): the early updates not started are
  // claimed back; the started ones are waited for (bounded).
  Status close();
  // After close: layer li's early update started (its state may differ from
  // the previous step's); `matches`: it ran to the end with exactly these
  // arguments, so it is the step's update.
  bool ran(size_t li) const { return li < per_layer_.size() && per_layer_[li].ran; }
  bool matches(size_t li, int64_t step, double clip, double scale, const cpu_adam::HyperParams& hyper) const;
  // Every piece of layer li's early update is whole in the tier (waits for
  // a versioned tier's pending writes; false names nothing: the caller
  // redoes the layer, which rewrites the piece).
  bool written(size_t li);
  // The kept early update of layer li, as UpdateScheduler::queue_update
  // would have returned it: its pending buffers become the state, its staged
  // values are copied to the device now; with offload_optimizer.ratio < 1
  // the layer's device part (never stepped early) is queued now from `input`.
  Result<UpdateScheduler::Queued> keep(size_t li, const GradientReduction::UpdateInput& input);
  // Every layer whose early update started: the parameters it wrote are
  // rewritten from the (untouched) state, on the calling (driving) thread;
  // the early updates are forgotten. For a skipped or dropped step; returns
  // how many.
  Result<int64_t> undo_every();
  // The step's updates are queued (kept, redone or normal): its early
  // updates are forgotten, so no later commit point undoes them.
  void forget() { per_layer_.clear(); }
  // Behind the updates queued so far: a versioned tier reads ahead for the
  // next step, its early updates' walk when `next_step_early`, else the
  // forward one (Note [Read-ahead at the step's end] in docs/engine.md).
  void read_ahead_for_next_step(bool next_step_early);
  // The same before the first step, every layer's state added (nothing is
  // queued yet): the tier is told on this thread.
  void read_ahead_for_first_step(bool first_step_early);
  // Nanoseconds the early updates of the step spent (they count in the
  // step's update time: UpdateScheduler::start_timing), handed over once.
  int64_t take_spent_ns() {
    const int64_t ns = spent_ns_ ? spent_ns_->load() : 0;
    spent_ns_.reset();
    return ns;
  }

 private:
  // One layer's early update of the current step.
  struct EarlyUpdate {
    // Whoever sets it first steps the layer: the early task, or the step's
    // end claiming it back. A fresh one per step: a claimed task still
    // queued holds its own.
    std::shared_ptr<std::atomic<bool>> claimed;
    bool queued = false;
    bool ran = false;       // close(): the task started
    Completion done;        // the task (its failure included)
    // UpdateStaging::kParameterSlot: the shard's write-back the task started
    // (set by the task; read after `done`).
    std::shared_ptr<Completion> write_back;
    std::vector<PieceJob> jobs;
  };
  // A versioned tier reads ahead in the order it will be opened: the
  // pieces in add() order for the step's updates (forward), the layers
  // in reverse for the early ones (the backward's reductions), set when
  // the first early update of a step is queued; at that step's end, the
  // layers stepped late, then the kept ones in the early walk (Note
  // [Read-ahead at the step's end] in docs/engine.md).
  enum class Walk : uint8_t { kForward, kEarly, kStepEnd };

  OptimizerStateTier& main_tier();  // the scheduler's (Note [Split optimizer state])
  const std::vector<StateId>& early_walk();  // built from forward_walk_ on first use
  // Queues the main tier's set_order(walk) (unless the tier reads in `which`
  // already), then `then` (when given), on the optimizer thread.
  void set_walk(const std::vector<StateId>& walk, Walk which, const char* label, std::function<void()> then = {});
  // The parameters layer li's jobs write, rewritten from the (untouched)
  // state, as an update writes them (a shard on NVMe: written back, waited for).
  Status rewrite_params(size_t li, const std::vector<PieceJob>& jobs);

  EngineContext& ctx_;
  ParameterGathering& params_;
  UpdateScheduler& updates_;
  bool open_ = false;
  cpu_adam::StepArgs args_;  // the step's assumed arguments
  std::vector<EarlyUpdate> per_layer_;
  std::vector<StateId> forward_walk_, early_walk_;
  Walk walk_ = Walk::kForward;  // the walk last given to the tier (add() order at first)
  bool walk_set_this_step_ = false;  // this step's early updates set theirs
  StepNvmeBytes* previous_step_bytes_ = nullptr;  // open()'s, told once per step
  std::shared_ptr<std::atomic<int64_t>> spent_ns_;  // the early updates' time (a step's last backward)
};

}  // namespace strata::offload::engine_detail
