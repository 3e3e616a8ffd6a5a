#pragma once
// Where one rank's training state lives: the engine's placement decisions,
// made once.
//
// Note [State placement]
// The options (stage, offload_optimizer, offload_param, ratio, max_in_cpu,
// the persistence threshold), the partition and the device decide, for
// every layer, where each kind of its state lives: the 16-bit parameters
// (the whole layer on the device, or this rank's shard on the device, in
// pinned host memory or on NVMe), the gradients (a buffer that lives across
// steps, one per backward, or none for a frozen layer), the master weights
// and moments (device, pinned host, NVMe; split with the device at ratio
// < 1) and the buffers between them (the reduced gradient's host or device
// shard, the staging of updated values, the gradient copy for the norm).
// StatePlacement::compute makes every one of those decisions, and only it:
// the engine allocates what the placement says, and the memory plan
// (plan_engine_memory) is a pure function of the placement, so the plan
// cannot drift from what the engine holds. It builds on the config's
// choice, strata::Placement (strata/core/placement.h, Note [Placement
// questions]), kept as `choice`: the rank-wide questions (are gradients
// sharded, are the parameter shards off the device) are asked of it here,
// and the same value answers the estimator, the step-time model and the
// config fit, so none of them tests a stage or an OffloadDevice itself.
//
// Named StatePlacement because strata::Placement is the estimator's row
// (stage, optimizer device, parameter device) in core/estimator.h.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/layered_model.h"
#include "strata/core/placement.h"
#include "strata/core/status.h"
#include "strata/offload/partition.h"

namespace strata::offload {

struct EngineOptions;

// The home of one kind of state.
enum class StateHome : uint8_t { kDevice, kPinnedHost, kNvme };
const char* state_home_name(StateHome home);

// A layer's 16-bit (working) parameters.
enum class ParamHome : uint8_t {
  kWholeOnDevice,      // stages 0-2, and stage-3 layers below the persistence threshold
  kShardOnDevice,      // stage 3, offload_param none: gathered for each use
  kShardInPinnedHost,  // stage 3, offload_param cpu (and nvme's first max_in_cpu elements)
  kShardOnNvme,        // stage 3, offload_param nvme: read through the parameter slots
};
const char* param_home_name(ParamHome home);

// A layer's full (unreduced) gradient buffer on the device.
enum class GradientBuffer : uint8_t {
  kNone,        // a frozen layer: no gradient at all
  kPersistent,  // stages 0-1: allocated once, kept across steps
  kPerStep,     // stages 2-3: allocated at the first backward, freed once reduced (bounded by reduce_bucket_size)
};

// Note [Update staging]
// The host optimizer writes a layer's updated 16-bit values (fp32 ones: a
// copy of the master) somewhere pinned before they go to the device or back
// to NVMe. How long they must stay there decides where:
//  - kSharedPiece: each piece's values are copied to the device tile by tile
//    while the piece is stepped, and those copies are waited for before the
//    next piece: one buffer of the largest piece serves every layer (the
//    optimizer thread steps one piece at a time). What was 2 B per parameter
//    (bf16) of pinned memory is one piece.
//  - kLayer: an early update (Note [Early, exact updates]) keeps its values
//    until the step commits, so each layer has its own buffer.
//  - kParameterSlot: a stage-3 shard on NVMe is written back whole after its
//    layer's update: the update borrows one of offload_param's pinned slots
//    (the ones gathers read shards into), and returns it when the write
//    ends, so staging costs no memory beyond the configured slots.
//  - kNone: the optimizer writes in place (a stage-3 shard in pinned host
//    memory, or the device optimizer).
enum class UpdateStaging : uint8_t { kNone, kSharedPiece, kLayer, kParameterSlot };

struct LayerPlacement {
  DType param_dtype = DType::kF32;
  size_t param_element_bytes = 4;
  ParamHome params = ParamHome::kWholeOnDevice;
  GradientBuffer gradients = GradientBuffer::kPersistent;
  // A stage-3 shard on the device at world size 1 is the whole layer,
  // padding included (shard layout = padded layout): acquire lends the
  // shard itself, with no gathered copy and nothing against
  // stage3_max_live_parameters; its update then waits for the layer's last
  // release, since the model reads the memory the update writes.
  bool acquired_in_place = false;
  bool frozen = false;  // parameters only: no gradient, no optimizer state
  // fp32 master weights beside the parameters (every trained layer but an
  // fp32 one stepped on the device, which is its own master).
  bool master = false;
  // The reduced gradient the optimizer reads, in the owned layout:
  bool pinned_gradient_shard = false;  // in pinned host memory (the optimizer runs on the host)
  // on NVMe (the optimizer state's folder, or the parameter shards'), piece by piece through the gradient
  // slots (Note [Gradient shards on NVMe] in offload/src/gradient_spill.h)
  bool gradient_shard_on_nvme = false;
  bool device_gradient_shard = false;  // on the device (a device optimizer not reading in place, or the ratio's device part)
  // Where the host optimizer writes the updated values (Note [Update staging]).
  UpdateStaging staging = UpdateStaging::kNone;
  // The device optimizer on a device the host cannot read: the reduced
  // gradient is also copied to the host for the norm's block sums.
  bool norm_gradient_copy = false;

  bool persistent() const { return params == ParamHome::kWholeOnDevice; }
  bool shard_on_nvme() const { return params == ParamHome::kShardOnNvme; }
  bool shard_in_host() const { return params == ParamHome::kShardInPinnedHost; }
};

// What the placement and the plan need to know of the device.
struct PlannedDevice {
  // Its memory is host memory (the cpu device): a device optimizer is the
  // CPU one. Not so on cuda, where the fused device kernel steps the state.
  bool host_addressable = false;
  // A device buffer holds its size rounded up to this (DeviceCaps; both
  // backends: 256), which is what the device counts.
  size_t allocation_alignment = 256;
  static PlannedDevice cpu() { return {true, 256}; }
  static PlannedDevice gpu() { return {false, 256}; }
  static PlannedDevice of(const DeviceCaps& caps) { return {caps.host_addressable, caps.allocation_alignment}; }
};

struct StatePlacement {
  // The config's stage and offload devices (validated by EngineOptions).
  Placement choice;
  int world = 1, rank = 0;
  // Master weights and moments (of each piece's host part when split).
  StateHome optimizer_state = StateHome::kDevice;
  // offload_optimizer.ratio < 1: each piece's last elements stay on the
  // device, stepped there; host_part(ratio, count) elements go to the host.
  bool split = false;
  double ratio = 1.0;
  // The optimizer reads the reduced gradient straight from the full device
  // buffer (stages 0-1 with the state on the device): no shard copy.
  bool gradients_in_place = false;
  // The fused device Adam kernel steps the state (state on a device whose
  // memory the host cannot read, e.g. cuda) instead of the CPU optimizer.
  bool device_kernel = false;
  // Stage-3 shard elements kept in pinned host memory under offload_param
  // nvme's max_in_cpu; the largest shard on NVMe (bytes; 0: none).
  uint64_t param_elements_in_host = 0;
  uint64_t largest_nvme_shard_bytes = 0;
  std::vector<LayerPlacement> layers;
  // Note [Early, exact updates] (docs/engine.md): each layer's update starts
  // under the backward and writes the new state out of place into a second
  // buffer per piece (this many bytes of pinned host memory per layer, 0 for
  // a frozen one), kept as the state once the step commits. Off: `early_updates_off` says why (auto), empty when off
  // was asked for.
  bool early_updates = false;
  std::string early_updates_off;
  std::vector<uint64_t> early_pending_bytes;
  // Note [Gradient shards on NVMe]: the gradient slots (count x bytes, each
  // the largest owned piece's gradient, 4 KiB-aligned; 0: no layer's shard
  // is on NVMe), the bytes of every piece on NVMe; `gradient_shards_why`
  // says why the shards are where they are (auto).
  size_t gradient_slot_count = 0;
  uint64_t gradient_slot_bytes = 0;
  uint64_t gradient_nvme_bytes = 0;
  std::string gradient_shards_why;
  // Whose folder holds them: the optimizer state's (offload_optimizer
  // nvme_path) when the state is on NVMe, else the parameter shards'
  // (offload_param nvme_path; the state in host memory).
  enum class GradientFolder : uint8_t { kOptimizerState, kParameterShards };
  GradientFolder gradient_folder = GradientFolder::kOptimizerState;
  // Note [Update staging]: the one buffer every kSharedPiece layer stages
  // its pieces in (bytes of the largest such piece's host part; 0: none).
  uint64_t shared_staging_bytes = 0;

  PlannedDevice device;
  // A device buffer of `bytes` as the device counts it.
  uint64_t device_footprint(uint64_t bytes) const {
    const uint64_t align = std::max<uint64_t>(1, device.allocation_alignment);
    return (bytes + align - 1) / align * align;
  }

  // Every decision above.
  static Result<StatePlacement> compute(const EngineOptions& options, std::span<const LayerSpec> layers,
                                        const Partition& partition, int rank, const PlannedDevice& device);

  bool optimizer_on_host() const { return optimizer_state != StateHome::kDevice; }
  bool optimizer_on_nvme() const { return optimizer_state == StateHome::kNvme; }
  // Stages 2-3: a layer's full gradient lives for one step, given back once
  // reduced (the reduced shard is what stays).
  bool gradients_sharded() const { return choice.gradients_sharded(); }
  // Stage 3: the layers not kept whole are this rank's shard, gathered for each use.
  bool params_sharded() const { return choice.params_sharded(); }
  // offload_param cpu or nvme: the stage-3 shards live in pinned host
  // memory (nvme: the first max_in_cpu elements) or on NVMe, not on the
  // device; a gather first copies them H2D.
  bool param_shards_off_device() const { return choice.params_offloaded(); }
  // offload_param nvme: the parameter shards' swap folder exists (even when
  // every shard fits max_in_cpu: it also holds gradient shards).
  bool param_shards_use_nvme() const { return choice.params_on_nvme(); }
  // Stage 0 owns every rank's pieces in padded space; stages 1-3 own this
  // rank's, in the shard layout.
  bool owns_every_piece() const { return !choice.optimizer_sharded(); }
  int owned_rank_begin() const { return owns_every_piece() ? 0 : rank; }
  int owned_rank_end() const { return owns_every_piece() ? world : rank + 1; }
  size_t owned_elements(const LayerPartition& layer) const {
    return owns_every_piece() ? layer.padded_elements : layer.shard_elements;
  }
  size_t owned_offset(const LayerPartition& layer, const SubGroup& group, int piece_rank) const {
    return owns_every_piece() ? layer.piece_begin(group, piece_rank) : group.shard_offset;
  }
};

}  // namespace strata::offload
