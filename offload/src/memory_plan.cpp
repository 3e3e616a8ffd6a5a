// The engine's memory plan (Engine::predicted_memory), without an engine:
// what one rank of a run with these options, this model and this world size
// would hold per tier. `strata estimate --config --model` prints it.
#include <algorithm>

#include <fmt/format.h>

#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/partition.h"
#include "strata/offload/state_placement.h"
#include "strata/offload/state_tier.h"

#include "prefetch_policy.h"

namespace strata::offload {

namespace {

// Each layer's own buffers where the placement puts them: its parameters,
// a persistent gradient, the gradient shard and copies, update staging.
EngineMemory layer_buffers(const Partition& part, const StatePlacement& placement, size_t grad_bytes) {
  EngineMemory m;
  // Every device buffer is counted as the device counts it: its footprint.
  auto on_device = [&](uint64_t bytes) { return placement.device_footprint(bytes); };
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerPartition& layer = part.layer(li);
    const LayerPlacement& where = placement.layers[li];
    const uint64_t padded = layer.padded_elements, shard = layer.shard_elements;
    const uint64_t owned = placement.owned_elements(layer);
    const size_t param_bytes = where.param_element_bytes;
    switch (where.params) {
      case ParamHome::kWholeOnDevice: m.device_params += on_device(padded * param_bytes); break;
      case ParamHome::kShardOnDevice: m.device_params += on_device(shard * param_bytes); break;
      case ParamHome::kShardInPinnedHost: m.pinned_params += shard * param_bytes; break;
      case ParamHome::kShardOnNvme: m.nvme += shard * param_bytes; break;  // read through the parameter slots
    }
    if (where.gradients == GradientBuffer::kPersistent) m.device_grads += on_device(padded * grad_bytes);
    if (where.pinned_gradient_shard) m.pinned_grads += std::max<uint64_t>(64, owned * grad_bytes);
    if (where.staging == UpdateStaging::kLayer) m.pinned_staging += std::max<uint64_t>(64, owned * param_bytes);
    if (where.device_gradient_shard) m.device_optimizer += on_device(std::max<uint64_t>(64, owned * grad_bytes));
    if (where.norm_gradient_copy)
      m.pinned_grads += std::max<uint64_t>(64, (placement.gradients_in_place ? padded : owned) * grad_bytes);
  }
  return m;
}

// The optimizer state of this rank's pieces (those of the ranks it owns),
// in its home; frozen layers have none.
struct StatePieces {
  uint64_t device = 0, pinned = 0, nvme = 0;
  uint64_t largest_nvme_piece = 0;  // bytes of the largest NVMe state piece (its slot)
  uint64_t largest_piece = 0;       // elements of this rank's largest piece (every rank saves its own)
};

StatePieces optimizer_state_pieces(const EngineOptions& opt, const Partition& part, const StatePlacement& placement) {
  StatePieces s;
  auto on_device = [&](uint64_t bytes) { return placement.device_footprint(bytes); };
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerPartition& layer = part.layer(li);
    const LayerPlacement& where = placement.layers[li];
    if (where.frozen) continue;
    for (const SubGroup& g : layer.groups)
      s.largest_piece = std::max<uint64_t>(s.largest_piece, layer.piece_real(g, placement.rank));
    for (const SubGroup& g : layer.groups)
      for (const LayerPartition::PieceRun& run :
           layer.piece_runs(g, placement.owned_rank_begin(), placement.owned_rank_end())) {
        // Every rank of the run holds a piece of the same size.
        const uint64_t count = run.real, host = host_part(placement.ratio, count), ranks = run.ranks;
        switch (placement.optimizer_state) {
          case StateHome::kNvme: {
            const uint64_t b = nvme_piece_bytes(host, true, opt.moments);
            // The committed and the newest version, and an early update's
            // pending one (Note [Piece versions]).
            s.nvme += ranks * (placement.early_updates ? 3 : 2) * b;
            s.largest_nvme_piece = std::max(s.largest_nvme_piece, b);
            break;
          }
          case StateHome::kPinnedHost:
            s.pinned += ranks * std::max<uint64_t>(64, memory_piece_bytes(host, where.master, opt.moments));
            break;
          case StateHome::kDevice:
            s.device += ranks * on_device(std::max<uint64_t>(64, memory_piece_bytes(host, where.master, opt.moments)));
            break;
        }
        // ratio < 1: the device part (fp32 parameters are their own master there).
        if (placement.split)
          s.device += ranks * on_device(std::max<uint64_t>(
              64, memory_piece_bytes(count - host, where.param_dtype != DType::kF32, opt.moments)));
      }
  }
  return s;
}

// What the executor allocates per step and frees after use: stage-3 layers
// gathered for use and stage 2-3 full gradients, before any cap bounds them.
struct TransientBuffers {
  uint64_t gathered_total = 0, gathered_real = 0, gathered_largest = 0;  // bytes, real elements, bytes
  size_t gathered_element_bytes = 2;
  uint64_t grads_total = 0, grads_largest = 0;  // bytes
};

TransientBuffers transient_buffers(const Partition& part, const StatePlacement& placement, size_t grad_bytes) {
  TransientBuffers t;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerPartition& layer = part.layer(li);
    const LayerPlacement& where = placement.layers[li];
    const uint64_t padded = layer.padded_elements;
    // World 1, shards on the device: a shard is its whole layer, acquired in
    // place (LayerPlacement::acquired_in_place): no gathered copy.
    if (!where.persistent() && !where.acquired_in_place) {
      const uint64_t gathered = placement.device_footprint(padded * where.param_element_bytes);
      t.gathered_total += gathered;
      t.gathered_real += layer.elements;
      t.gathered_largest = std::max(t.gathered_largest, gathered);
      t.gathered_element_bytes = where.param_element_bytes;
    }
    if (where.gradients == GradientBuffer::kPerStep) {
      const uint64_t grads = placement.device_footprint(padded * grad_bytes);
      t.grads_total += grads;
      t.grads_largest = std::max(t.grads_largest, grads);
    }
  }
  return t;
}

// Gathered layers: at most one copy per layer is valid, and a dropped copy
// lives on until the pass that used it has run. When the reuse or prefetch
// window spans a whole micro-batch nothing is dropped within a step, so at
// most every layer once; otherwise the next pass's gathers may be issued
// while the last pass's copies still wait for their free: twice.
// The keep window is the prefetch policy's (Note [Prefetch policy]).
uint64_t gathered_bytes(const EngineOptions& opt, const StatePlacement& placement, const TransientBuffers& t) {
  const uint64_t window = PrefetchPolicy::keep_window({static_cast<uint64_t>(opt.prefetch_bucket_size),
                                                       static_cast<uint64_t>(opt.max_live_parameters),
                                                       static_cast<uint64_t>(opt.max_reuse_distance)});
  const bool spans = window >= 2 * t.gathered_real;
  const uint64_t unbounded = spans ? t.gathered_total : 2 * t.gathered_total;
  return std::min(unbounded, std::max<uint64_t>(placement.device_footprint(static_cast<uint64_t>(opt.max_live_parameters) *
                                                                            t.gathered_element_bytes),
                                                t.gathered_largest));
}

// With gradient accumulation every layer's full gradient lives until the
// last micro-batch reduces it (the sum over micro-batches is taken before
// the sum over ranks, as at stage 0), so the bucket cannot bound them.
uint64_t per_step_gradient_bytes(const EngineOptions& opt, const StatePlacement& placement, const TransientBuffers& t,
                                 size_t grad_bytes) {
  if (opt.grad_accum > 1) return t.grads_total;
  return std::min(t.grads_total,
                  std::max<uint64_t>(placement.device_footprint(static_cast<uint64_t>(opt.reduce_bucket_size) * grad_bytes),
                                     t.grads_largest));
}

// A checkpoint snapshot slot: the largest piece as fp32 master [4 B] and
// moments [8 B], each part 4 KiB-aligned (checkpoint_io.cpp).
uint64_t snapshot_slot_of(uint64_t largest_piece) {
  auto aligned = [](uint64_t n) { return (n + 4095) / 4096 * 4096; };
  return aligned(4 * largest_piece) + aligned(8 * largest_piece);
}

}  // namespace

// What init_layer and the step allocate, summed without allocating: a pure
// function of the placement (Note [State placement]). Stage-3 gathers and
// stage 2-3 full gradients are transient: the executor enqueues a whole pass
// before the stream runs it, so all of them are alive at once unless the
// caps (stage3_max_live_parameters, reduce_bucket_size) bound them, and a
// cap is never below one layer.
EngineMemory plan_engine_memory(const EngineOptions& opt, const Partition& part, const StatePlacement& placement) {
  const size_t grad_bytes = dtype_size(opt.grad_dtype);
  EngineMemory m = layer_buffers(part, placement, grad_bytes);
  const StatePieces state = optimizer_state_pieces(opt, part, placement);
  m.device_optimizer += state.device;
  m.pinned_optimizer += state.pinned;
  m.nvme += state.nvme;
  const TransientBuffers transient = transient_buffers(part, placement, grad_bytes);
  m.device_gathered = gathered_bytes(opt, placement, transient);
  m.device_grads += per_step_gradient_bytes(opt, placement, transient, grad_bytes);
  m.device = m.device_params + m.device_grads + m.device_optimizer + m.device_gathered;
  // NVMe: the state streams through buffer_count pinned slots of the largest piece.
  if (placement.optimizer_on_nvme())
    m.pinned_optimizer = static_cast<uint64_t>(opt.nvme.buffer_count) * std::max(state.largest_nvme_piece, kNvmeStateAlign);
  if (placement.largest_nvme_shard_bytes != 0)
    m.pinned_params += static_cast<uint64_t>(opt.nvme_param.buffer_count) *
                       std::max<uint64_t>(placement.largest_nvme_shard_bytes, 4096);
  // Note [Gradient shards on NVMe]: the gradient slots, and each piece's
  // gradient on NVMe (as the engine counts it: once, at its first write).
  m.pinned_grads += placement.gradient_slot_count * placement.gradient_slot_bytes;
  m.nvme += placement.gradient_nvme_bytes;
  // Note [Update staging]: kParameterSlot borrows the parameter slots above.
  if (placement.shared_staging_bytes != 0) m.pinned_staging += std::max<uint64_t>(64, placement.shared_staging_bytes);
  for (uint64_t bytes : placement.early_pending_bytes) m.pinned_speculation += bytes;
  m.pinned = m.pinned_optimizer + m.pinned_grads + m.pinned_staging + m.pinned_params + m.pinned_speculation;
  m.snapshot_slot_bytes = snapshot_slot_of(state.largest_piece);
  return m;
}

Result<EngineMemory> plan_engine_memory(const EngineOptions& opt, std::span<const LayerSpec> layers, int world,
                                        int rank, const PlannedDevice& device) {
  STRATA_ASSIGN_OR_RETURN(Partition part, Partition::create(layers, world, opt.sub_group_size));
  // (StatePlacement::compute checks the rank.)
  STRATA_ASSIGN_OR_RETURN(StatePlacement placement,
                          StatePlacement::compute(opt, layers, part, rank, device));
  return plan_engine_memory(opt, part, placement);
}

}  // namespace strata::offload
