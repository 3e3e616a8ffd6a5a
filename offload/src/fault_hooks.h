#pragma once
// FaultHooks: the one place the engine reads the faults a test created it
// with (testing::EngineFaults, Note [Testing seam] in engine_seam.h). Private
// to offload/src.
//
// The components ask it named questions at the points where a fault enters
// (is this gather the one that fails? what value overwrites this gradient?)
// and never read testing::EngineFaults themselves: which step, rank and layer
// a fault matches, that a gather fault fires once, and how an injected
// gradient value is encoded in the gradient dtype are decided here. An engine
// made through Engine::create has none: every answer is "no fault" and every
// observer is a no-op.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/offload/testing/engine_faults.h"

namespace strata::nvme {
class IoEngine;
}

namespace strata::offload::engine_detail {

class FaultHooks {
 public:
  FaultHooks() = default;
  explicit FaultHooks(testing::EngineFaults faults) : faults_(std::move(faults)) {}

  // The I/O engine a test put in place of the one made from the aio section
  // (must outlive the engine); null: the usual one.
  nvme::IoEngine* optimizer_io() const { return faults_.optimizer_io; }
  nvme::IoEngine* param_io() const { return faults_.param_io; }
  nvme::IoEngine* gradient_io() const { return faults_.gradient_io; }

  // testing::GatherFault: the failure of the stage-3 gather of `layer` on
  // `rank` in begun step `step`; ok for every other gather, and after the
  // first failure.
  Status gather(int64_t step, int rank, size_t layer);
  // testing::GradientFault: the bytes (one element of `dtype`) written over
  // element 0 of `layer`'s local gradient on `rank` in begun step `step`, or
  // null. Valid until the next call (an asynchronous copy reads them).
  const std::byte* gradient_override(int64_t step, int rank, size_t layer, DType dtype);
  // testing::UpdateFault: the failure of the kernel call that wrote the last
  // piece of `layer`'s update on `rank` in optimizer step `step`; `early`
  // says whether it is an early update (Note [Early, exact updates]).
  Status update(int64_t step, int rank, size_t layer, bool early) const;

  // Note [Early, exact updates]: whether the step's end waits for every
  // early update instead of claiming back the ones not started.
  bool run_every_early_update() const { return faults_.run_every_early_update; }
  // The tests' observers on the optimizer thread (no-ops without a test's).
  void early_update_started(size_t layer) const {
    if (faults_.early_update_started) faults_.early_update_started(layer);
  }
  void update_values_queued(size_t layer, bool kept) const {
    if (faults_.update_values_queued) faults_.update_values_queued(layer, kept);
  }

  // testing::CheckpointCrash, copied into each save (its commit runs on the
  // checkpoint writer's thread).
  const std::optional<testing::CheckpointCrash>& checkpoint_crash() const { return faults_.checkpoint_crash; }
  // SIGKILL when `crash` names `point` of rank 0's commit of the save of
  // `tag` (any save when crash->tag is empty): how the tests show that a
  // kill -9 at any moment leaves the previous checkpoint loadable.
  static void checkpoint_point_reached(const std::optional<testing::CheckpointCrash>& crash, const char* point,
                                       const std::string& tag);

 private:
  testing::EngineFaults faults_;
  bool gather_failed_ = false;              // testing::GatherFault fires once
  // gradient_override()'s value, in the gradient dtype; aligned for the 16-bit conversions' stores (UBSan).
  alignas(4) std::array<std::byte, 4> gradient_bytes_{};
};

}  // namespace strata::offload::engine_detail
