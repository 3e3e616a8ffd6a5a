#pragma once
// CommitPoint: the pending step's updates committed or rolled back, every
// rank alike (Note [Atomic steps] in engine.h). Private to offload/src.
//
// With overlap a step's updates run while the next step computes; they are
// "pending" until the next commit point (the next step's norm, an
// evaluation, synchronize, a save). There every rank waits for its updates
// and their write-backs, then votes: every rank's succeeded -> the tiers
// commit the step; one failed -> every rank rolls back (a versioned tier to
// the previous step, with the counters, loss scale and data position) or,
// for state kept in place whose update did run, keeps the step and
// re-derives the parameters from the master weights; an update torn
// part-way -> the engine stops. A failed parameter read of the call drops
// the call (nothing was updated from it). The vote also carries each rank's
// loss sum, so the step's loss costs no extra collective.
#include <functional>
#include <optional>
#include <vector>

#include "engine_context.h"
#include "gradient_reduction.h"
#include "parameter_gathering.h"
#include "step_nvme_bytes.h"
#include "strata/offload/loss_scaler.h"
#include "update_scheduler.h"

namespace strata::offload::engine_detail {

// The counters a rollback restores.
struct StepMark {
  int64_t optimizer_steps = 0, steps_begun = 0;
  LossScalerState scaler;
  std::optional<uint64_t> data;  // the runner's data position, when it has one
};

class CommitPoint {
 public:
  // Moves the orchestrator's step counters, loss scale and data position
  // back to a mark (Engine::Impl::restore_counters).
  using RestoreCounters = std::function<Status(const StepMark&)>;
  // A rollback re-derives parameters through `params`, rolls the state back
  // through `updates`, closes the step's NVMe byte window in `nvme_bytes`
  // (updates_settled) and, since gradients are zeroed once per step by step
  // number, makes `grads` zero them again for the repeated steps
  // (GradientReduction::forget_zeroing) once `restore_counters` moved the
  // counters back.
  CommitPoint(EngineContext& ctx, ParameterGathering& params, UpdateScheduler& updates, GradientReduction& grads,
              StepNvmeBytes& nvme_bytes, RestoreCounters restore_counters)
      : ctx_(ctx), params_(params), updates_(updates), grads_(grads), nvme_bytes_(nvme_bytes),
        restore_counters_(std::move(restore_counters)) {}

  // A step's updates are about to be queued; `before`: the counters before it.
  void begin_pending(const StepMark& before) {
    pending_ = true;
    pending_complete_ = false;
    pending_mark_ = before;
  }
  // Every layer's update of the pending step was queued.
  void pending_queued() { pending_complete_ = true; }
  bool pending() const { return pending_; }

  // The commit point: waits for the pending step's updates, lets every rank
  // vote (a collective when world > 1), commits them when every rank's
  // succeeded, else rolls every rank back and returns the error (with
  // ctx.recovered set when the rollback completed). `call`: the counters at
  // the start of the step in progress (dropped with the rollback), or null
  // outside a step. `loss` (a step only): this rank's loss sum in, the sum
  // over ranks in rank order out (the vote carries it).
  Status settle(const StepMark* call, double* loss = nullptr);

 private:
  struct RankOutcome;
  struct Vote;
  // settle()'s steps.
  Result<RankOutcome> pending_outcome();
  Result<Vote> take_vote(const RankOutcome& mine, double* loss);
  Status drop_call(const StepMark& call, const std::vector<int>& failed_read, const Status& read);
  Status stop_torn(int64_t t, const std::vector<int>& torn_update, const Status& torn);
  Status roll_back(int64_t t, const std::vector<int>& failed_update, const Status& update, const StepMark* call);
  Status undo_pending_step(bool versioned, const StepMark* call);
  // Every layer's parameters from the committed master weights (a
  // collective: stage 1-3 layers kept whole are gathered again).
  Status rederive_params();
  // The engine back at mark `m`: its counters (restore_counters_), and the
  // gradient buffers to be zeroed again by the steps repeated from there.
  Status back_to(const StepMark& m);

  EngineContext& ctx_;
  ParameterGathering& params_;
  UpdateScheduler& updates_;
  GradientReduction& grads_;
  StepNvmeBytes& nvme_bytes_;
  RestoreCounters restore_counters_;
  bool pending_ = false;           // a step's updates are queued and not committed yet
  bool pending_complete_ = false;  // every layer's update of that step was queued
  StepMark pending_mark_;          // the counters before that step
};

}  // namespace strata::offload::engine_detail
