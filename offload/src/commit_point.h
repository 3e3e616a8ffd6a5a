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

#include "engine_context.h"
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
  using Restore = std::function<Status(const StepMark&)>;
  CommitPoint(EngineContext& ctx, ParameterGathering& params, UpdateScheduler& updates, StepNvmeBytes& nvme_bytes,
              Restore restore)
      : ctx_(ctx), params_(params), updates_(updates), nvme_bytes_(nvme_bytes), restore_(std::move(restore)) {}

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
  // Every layer's parameters from the committed master weights (a
  // collective: stage 1-3 layers kept whole are gathered again).
  Status rederive_params();

  EngineContext& ctx_;
  ParameterGathering& params_;
  UpdateScheduler& updates_;
  StepNvmeBytes& nvme_bytes_;
  Restore restore_;
  bool pending_ = false;           // a step's updates are queued and not committed yet
  bool pending_complete_ = false;  // every layer's update of that step was queued
  StepMark pending_mark_;          // the counters before that step
};

}  // namespace strata::offload::engine_detail
