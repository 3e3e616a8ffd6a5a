#pragma once
// SplitStateTier: a rank's optimizer state as one value, held by
// UpdateScheduler alone. Private to offload/src.
//
// Note [Split optimizer state]
// The state lives in one OptimizerStateTier (device, pinned host or NVMe),
// except with offload_optimizer.ratio < 1: then each piece's first
// EngineContext::host_n(count) elements live in the main tier (pinned host
// memory, stepped by the CPU optimizer) and the rest in a device part (a
// device-memory tier, stepped on the device by a second thread), both under
// the piece's StateId. The two parts are one state: a step is committed,
// or abandoned, in both; the engine's other components ask the
// UpdateScheduler about the state as a whole and never learn that a second
// part exists. Only the scheduler, which steps each part with its own
// optimizer and thread and splits a piece's reads and writes at host_n,
// reaches a part.
//
// The split is refused unless the main tier is pinned host memory
// (EngineOptions: stage 3, offload_optimizer cpu, offload_param none), so
// neither part is versioned when there are two: the whole-state calls below
// act on the main tier and then the device part, whose flush and commit
// always succeed (a memory tier writes in place).
#include <memory>
#include <string>

#include "strata/core/status.h"
#include "strata/offload/state_tier.h"

namespace strata::offload::engine_detail {

class SplitStateTier {
 public:
  // `device_part`: null at ratio 1.
  SplitStateTier(std::unique_ptr<OptimizerStateTier> main, std::unique_ptr<OptimizerStateTier> device_part)
      : main_(std::move(main)), device_part_(std::move(device_part)) {}

  // Every element of a piece at ratio 1; its first host_n(count) with ratio < 1.
  OptimizerStateTier& main() { return *main_; }
  const OptimizerStateTier& main() const { return *main_; }
  // ratio < 1: the rest of every piece, in device memory; null otherwise.
  OptimizerStateTier* device_part() { return device_part_.get(); }

  // "pinned host memory", "NVMe ...": where the main part lives.
  std::string describe() const { return main_->describe(); }
  // A versioned state keeps the last committed step beside the pending one
  // (NVMe: Note [Piece versions]); otherwise it is updated in place.
  bool versioned() const { return main_->versioned(); }
  // NVMe traffic (the device part moves none).
  StateTierIoStats io_stats() const { return main_->io_stats(); }
  // Every write-back of every part waited for; the first failure not reported yet.
  Status flush() {
    STRATA_RETURN_IF_ERROR(main_->flush());
    return device_part_ ? device_part_->flush() : Status::Ok();
  }
  // Ok when commit() would commit: no write-back was lost, whoever it was reported to.
  Status committable() const { return main_->committable(); }
  // flush() and committable(): the pending step may be committed.
  Status ready_to_commit() {
    STRATA_RETURN_IF_ERROR(flush());
    return committable();
  }
  // The pending step becomes the committed one in every part.
  Status commit() {
    STRATA_RETURN_IF_ERROR(main_->commit());
    return device_part_ ? device_part_->commit() : Status::Ok();
  }
  // The pending step is not committed: a versioned state goes back to its
  // committed version; state updated in place holds the step (no copy of
  // the one before exists) and keeps it, committed as it is.
  Status abandon_step() {
    STRATA_RETURN_IF_ERROR(main_->versioned() ? main_->rollback() : main_->commit());
    return device_part_ ? device_part_->commit() : Status::Ok();
  }
  // abandon_step()s that went back so far: a reader that must see one
  // step's state (a checkpoint snapshot) checks that none happened while it read.
  uint64_t rollbacks() const { return main_->rollbacks(); }

 private:
  std::unique_ptr<OptimizerStateTier> main_;
  std::unique_ptr<OptimizerStateTier> device_part_;
};

}  // namespace strata::offload::engine_detail
