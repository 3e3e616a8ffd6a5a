#pragma once
// Faults an engine can be created with, for tests only (Note [Testing seam]
// in engine_seam.h). Plain data and one observer: the engine (strata_offload)
// reads it privately; nothing here is installed or part of EngineOptions.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace strata::nvme {
class IoEngine;
}

namespace strata::offload::testing {

// Overwrites element 0 of layer `layer`'s local gradient with `value` on
// rank `rank` in the `step`-th begun step (1-based), before it is reduced.
// Inf/NaN model an overflow.
struct GradientFault {
  int64_t step = 1;
  int rank = 0;
  size_t layer = 0;
  float value = 0;
};

// The optimizer step of layer `layer` on rank `rank` fails in optimizer
// step `step` (1-based) after the kernel wrote the layer's last piece: a
// kernel that fails half-way (host-stepped state only).
struct UpdateFault {
  int64_t step = 1;
  int rank = 0;
  size_t layer = 0;
  // Only the early update under the backward fails (Note [Early, exact
  // updates]); its redo at the step's end succeeds.
  bool early_only = false;
};

// The first stage-3 gather of layer `layer` on rank `rank` in the `step`-th
// begun step (1-based) fails after its buffer was allocated and its shard's
// copies were queued (a prefetch's, when the layer is prefetched).
struct GatherFault {
  int64_t step = 1;
  int rank = 0;
  size_t layer = 0;
};

// Kills the process with SIGKILL at `point` of rank 0's checkpoint commit
// (after-rank-files, before-manifest, before-rename, before-latest,
// after-latest), in the save of `tag` only when `tag` is not empty: how the
// tests show that a kill -9 at any moment leaves the previous checkpoint
// loadable through `latest`.
struct CheckpointCrash {
  std::string point;
  std::string tag;
};

struct EngineFaults {
  std::optional<GradientFault> gradient;
  std::optional<UpdateFault> update;
  std::optional<GatherFault> gather;
  // The optimizer state's NVMe I/O (offload_optimizer nvme) through this
  // engine (e.g. a fault-injecting one) instead of one made from the aio
  // options; must outlive the engine. Null: the usual one.
  nvme::IoEngine* optimizer_io = nullptr;
  // The same for the stage-3 parameter shards on NVMe (offload_param nvme).
  nvme::IoEngine* param_io = nullptr;
  // The same for gradient shards on NVMe (strata.gradient_shards nvme).
  nvme::IoEngine* gradient_io = nullptr;
  std::optional<CheckpointCrash> checkpoint_crash;
  // Note [Early, exact updates]: the step's end waits for every early update
  // to run instead of claiming back the ones not started, so a test sees the
  // kept, redone and restored paths whatever the threads' timing.
  bool run_every_early_update = false;
  // Called on the optimizer thread as an early update of layer `layer`
  // starts stepping (after it claimed the layer), so a test can see that it
  // runs while the backward still does; must not block for long.
  std::function<void(size_t layer)> early_update_started;
  // Called on the optimizer thread once a layer's updated values have gone
  // to the device's copy queue: after a normal update (`kept` false) or for
  // an early update the step kept (true); may block, to hold the thread.
  std::function<void(size_t layer, bool kept)> update_values_queued;
};

}  // namespace strata::offload::testing
