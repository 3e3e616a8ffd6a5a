#pragma once
// StepNvmeBytes: the NVMe bytes a step's report carries, counted exactly.
// Private to offload/src.
//
// Note [A step's NVMe bytes]
// The NVMe state tier counts a read when an update consumes it (open()) and
// a write-back when it ends; the gradient spill (Note [Gradient shards on
// NVMe]) counts a write when it is issued and a read back when the update
// consumes it. With overlap a step's updates run on while the next step
// computes, so counting between two moments of the driving thread (as the
// step's times are counted) put the last updates' bytes in one step or the
// next as the threads' timing went, and a one-step bench row could miss a
// piece. Each kind is counted instead between two points where it is known
// to be complete:
//  - the updates' bytes (state read and written back, gradients read back):
//    from the previous step's commit point (or begin_step() when no update
//    was pending: I/O between steps, a checkpoint's reads, is not a step's)
//    to this step's commit point, after the tier's flush() (every write-back
//    ended);
//  - the gradients written under the backward: from begin_step() to the
//    point where the norm has every layer's block sums (a spill completes
//    after its writes).
// A step's report carries its backward's writes and the updates committed
// since the previous report: with overlap on those of the previous step (as
// StepMetrics::optimizer_ms does), with it off its own.
// Early updates (Note [Early, exact updates] in docs/engine.md) of state on
// NVMe run under the backward, before the previous step's commit point. So
// the optimizer thread, before the first of them, flushes the tier (the
// previous step's write-backs end) and marks where the previous step's
// updates ended (previous_updates_done); that step's commit point counts up
// to the mark, and the next window starts there.
//
// Who tells it what, one method per source: Engine::Impl's step calls
// (step_begins in begin_step, backward_done once the norm has every block
// sum, take for the step's report); CommitPoint::settle (updates_settled);
// the optimizer thread (previous_updates_done, queued by EarlyUpdates when
// open() was handed this counter). Nothing else writes it.
#include <cstdint>
#include <mutex>
#include <optional>

#include "engine_context.h"
#include "update_scheduler.h"

namespace strata::offload::engine_detail {

class StepNvmeBytes {
 public:
  StepNvmeBytes(EngineContext& ctx, UpdateScheduler& updates) : ctx_(ctx), updates_(updates) {}

  struct Bytes {
    uint64_t read = 0, written = 0;
  };
  // begin_step(): `updates_pending` says whether a step's updates still run.
  void step_begins(bool updates_pending);
  // Every layer's block sums are in (GradientReduction::global_norm_squared).
  void backward_done();
  // On the optimizer thread, before step `pending_step + 1`'s first early
  // update: the updates of step `pending_step` (not committed yet) have run;
  // their write-backs are waited for here.
  void previous_updates_done(int64_t pending_step);
  // Step `step`'s updates and write-backs are done (CommitPoint::settle,
  // before its vote; also when the step is then rolled back).
  void updates_settled(int64_t step);
  // This step's report: its backward's writes and the updates settled since
  // the last take().
  Bytes take();

 private:
  Bytes updates_now() const;  // the counters the updates move, since the engine began
  uint64_t spill_written_now() const;

  EngineContext& ctx_;
  UpdateScheduler& updates_;
  std::mutex mu_;                // the optimizer thread marks, the driving thread counts
  Bytes updates_from_;           // updates_now() where the current update window began
  struct Mark {
    int64_t step = 0;
    Bytes at;
  };
  std::optional<Mark> mark_;     // previous_updates_done()'s
  Bytes settled_;                // settled updates not reported yet
  uint64_t backward_from_ = 0;   // spill_written_now() at begin_step()
  uint64_t backward_written_ = 0;
};

}  // namespace strata::offload::engine_detail
