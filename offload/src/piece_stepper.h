#pragma once
// PieceStepper: one layer's optimizer step over its pieces in one part of
// the optimizer state, on the calling (optimizer) thread. Private to
// offload/src.
//
// UpdateScheduler decides what is stepped, when and on which thread (the
// jobs, the gates, the early updates: Note [Update scheduling]); the
// stepper carries one step out. Where the device optimizer steps the main
// part (StatePlacement's device kernel), one fused launch per distinct set
// of hyper-parameters steps the layer. Otherwise the CPU optimizer steps it
// piece by piece: the piece's gradient read back from NVMe first when it
// was spilled (the next piece's read started meanwhile: Note [Gradient
// shards on NVMe]), the kernel over the piece's runs of equal hyper-
// parameters (8-bit moments: whole blocks of one run, the blocks a run
// boundary cuts through fp32: Note [Runs in 8-bit blocks]), each finished
// tile's values copied to the device while later tiles compute, then the
// piece closed, or written as its pending version for an early update
// (Note [Pending versions in memory] in state_tier.h). A failure part-way
// through state kept in place is recorded as torn (kTorn).
#include <atomic>
#include <cstddef>
#include <functional>
#include <vector>

#include "engine_context.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/state_tier.h"

namespace strata::offload::engine_detail {

// One piece's part in a layer's update, its pointers computed on the
// driving thread (UpdateScheduler::jobs_of); the optimizer thread only steps.
struct PieceJob {
  StateId id;
  size_t count = 0;
  // The piece's runs of equal hyper-parameters: offsets from the job's first element.
  struct Run {
    size_t offset = 0, count = 0;
    cpu_adam::HyperParams hyper;
  };
  std::vector<Run> runs;
  const std::byte* grads = nullptr;  // null: on NVMe, read back piece by piece (Note [Gradient shards on NVMe])
  std::byte* param = nullptr;    // where the kernel writes the updated value (staging, or fp32 in place)
  // UpdateStaging::kParameterSlot: `param` is this far into the slot the
  // update borrows, placed when it runs (null until then).
  size_t slot_offset = 0;
  bool param_is_master = false;  // fp32 parameters stepped in place
  // Device parameters the updated values are copied to, tile by tile, from
  // the optimizer's tile callback while later tiles compute; null: none.
  std::byte* h2d = nullptr;
  // An early update (Note [Early, exact updates]) leaves its values in
  // staging; they go here once the update is kept (EarlyUpdates::keep).
  std::byte* h2d_once_kept = nullptr;
};

// Which part of the optimizer state a step is over (Note [Split optimizer
// state]): the main part may be stepped by the device kernel, and a test's
// injected update failure (testing::UpdateFault) hits it.
enum class StatePart : uint8_t { kMain, kDevicePart };

class PieceStepper {
 public:
  // `update_stream`: the H2D copies of updated tiles; `kernel_stream`: the
  // device kernel's (null unless the device optimizer steps the main part).
  PieceStepper(EngineContext& ctx, Stream& update_stream, Stream* kernel_stream)
      : ctx_(ctx), update_stream_(update_stream), kernel_stream_(kernel_stream) {}

  // `out_of_place`: an early update, written into the pieces' pending
  // buffers (the state untouched: a failure is never torn). Otherwise a
  // failure part-way through state kept in place is recorded as torn.
  Status step(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
              const cpu_adam::StepArgs& args, DType param_dtype, StatePart part, bool out_of_place);

 private:
  struct HostStep;   // one layer's CPU step: what its pieces share
  struct OpenPiece;  // one piece open in it
  using PointMoments = std::function<void(cpu_adam::StateSpans&)>;

  // The fused device kernel over the layer's pieces; this thread waits for it.
  Status step_on_device(OptimizerStateTier& t, const std::vector<PieceJob>& jobs, const cpu_adam::StepArgs& args,
                        DType param_dtype);
  // One piece through the CPU optimizer, its gradient at `grads`.
  Status step_piece(HostStep& h, const PieceJob& j, const std::byte* grads);
  // 8-bit moments: the piece's whole blocks, then the blocks runs share.
  Status step_blocked(HostStep& h, OpenPiece& p);
  // One kernel call over elements [first, first + count) of the piece with
  // one run's hyper-parameters; `point_moments` sets the spans' moments.
  Status step_range(HostStep& h, OpenPiece& p, size_t first, size_t count, const cpu_adam::HyperParams& hyper,
                    bool last_call, const PointMoments& point_moments);
  // The moments of the piece itself (and, out of place, their source) from element `first`.
  static PointMoments moments_in_piece(const HostStep& h, const OpenPiece& p, size_t first);

  EngineContext& ctx_;
  Stream& update_stream_;
  Stream* kernel_stream_;
};

}  // namespace strata::offload::engine_detail
