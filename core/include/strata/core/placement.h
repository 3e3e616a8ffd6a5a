#pragma once
// A placement as a config chooses it: the ZeRO stage and where the
// optimizer state and (stage 3) the parameter shards live.
//
// Note [Placement questions]
// Every question about where state lives that the config's three values
// answer alone is a query of Placement, so the estimator (core), the
// step-time model, the config fit and the engine (offload's StatePlacement,
// Note [State placement], which builds on this value and adds what needs
// the partition, the rank and the device) ask the same rule instead of each
// testing `stage >= 2` or an OffloadDevice. A new home or stage rule is
// changed here, and every reader follows.

#include "strata/core/config.h"

namespace strata {

struct Placement {
  int stage = 0;
  OffloadDevice optimizer = OffloadDevice::kNone;  // zero_optimization.offload_optimizer.device
  OffloadDevice param = OffloadDevice::kNone;      // zero_optimization.offload_param.device
  bool operator==(const Placement&) const = default;

  // The stage admits the offloads: a stage in 0..3, optimizer offload at
  // stages 1-3 and parameter offload at stage 3 (the engine asks more:
  // parameter offload with the optimizer state offloaded too).
  bool stage_admits_offloads() const {
    if (stage < 0 || stage > 3) return false;
    if (stage == 0 && optimizer_offloaded()) return false;
    if (!params_sharded() && params_offloaded()) return false;
    return true;
  }

  // The optimizer state (master weights and moments) lives off the device
  // (pinned host memory or NVMe) and the host steps it.
  bool optimizer_offloaded() const { return optimizer != OffloadDevice::kNone; }
  bool optimizer_in_host_memory() const { return optimizer == OffloadDevice::kCpu; }
  bool optimizer_on_nvme() const { return optimizer == OffloadDevice::kNvme; }
  // Stage 0 keeps and steps every rank's optimizer state on every rank
  // (and reduces gradients whole); stages 1-3 keep this rank's shard.
  bool optimizer_sharded() const { return stage >= 1; }
  // Stages 2-3 keep only the reduced gradient's shard: a layer's full
  // gradient buffer lives for one step, given back once it is reduced.
  bool gradients_sharded() const { return stage >= 2; }
  // Stage 3 shards the 16-bit parameters too and gathers each layer for its
  // use; stages 1-2 all-gather each layer once after its update.
  bool params_sharded() const { return stage == 3; }
  bool updated_params_all_gathered() const { return optimizer_sharded() && !params_sharded(); }
  // Stage-3 parameter shards live off the device (pinned host memory or NVMe).
  bool params_offloaded() const { return param != OffloadDevice::kNone; }
  bool params_in_host_memory() const { return param == OffloadDevice::kCpu; }
  bool params_on_nvme() const { return param == OffloadDevice::kNvme; }
  bool uses_nvme() const { return optimizer_on_nvme() || params_on_nvme(); }
  // The optimizer reads the reduced gradient straight from the full device
  // buffer (the state on the device, the gradient kept whole): no shard copy.
  bool gradients_in_place() const { return !optimizer_offloaded() && !gradients_sharded(); }
  // A stage-3 shard on the device at world size 1 is the whole layer: it is
  // lent as it is, with no gathered copy (LayerPlacement::acquired_in_place
  // for the layers not kept whole).
  bool shards_acquired_in_place(int world) const {
    return params_sharded() && !params_offloaded() && world == 1;
  }
  // offload_optimizer.ratio < 1 may keep part of each piece on the device:
  // stage 3 with the optimizer state offloaded.
  bool partial_offload_possible() const { return params_sharded() && optimizer_offloaded(); }
};

// A config's choice (zero_optimization.stage, offload_optimizer.device,
// offload_param.device).
inline Placement placement_of(const ZeroConfig& zero) {
  return {zero.stage, zero.offload_optimizer.device, zero.offload_param.device};
}

}  // namespace strata
