// StatePlacement::compute: every placement decision of the engine (Note
// [State placement]).
#include "strata/offload/state_placement.h"

#include <algorithm>

#include <fmt/format.h>

#include "strata/core/host_memory.h"
#include "strata/core/printable.h"
#include "strata/core/spec_model.h"
#include "strata/core/units.h"
#include "strata/offload/engine.h"
#include "strata/offload/state_tier.h"

namespace strata::offload {

namespace {

// Note [Early, exact updates]: where updates may run under the backward.
// They hide the CPU step of offloaded state (offload_optimizer cpu or
// nvme), and write out of place: into a second buffer per piece of state
// the host holds in pinned memory (Note [Pending versions in memory]), or
// as a third version of a piece on NVMe (Note [Piece versions]). With a
// ratio < 1 the host part runs early, the device part at the step's end; a
// stage-3 shard on NVMe is written back by the early update and rewritten
// from the untouched master when the step does not keep it.
std::string early_updates_blocker(const StatePlacement& p) {
  if (!p.optimizer_on_host())
    return "the optimizer state is on the device (offload_optimizer.device none): early updates hide the CPU step of "
           "offloaded state (offload_optimizer.device cpu)";
  return {};
}

// Note [Update staging]: each trained layer's, from the placement so far
// (early updates decided or assumed), and the shared buffer's size.
void decide_update_staging(const Partition& partition, StatePlacement& p) {
  p.shared_staging_bytes = 0;
  for (size_t li = 0; li < p.layers.size(); ++li) {
    LayerPlacement& l = p.layers[li];
    l.staging = UpdateStaging::kNone;
    if (l.frozen || !p.optimizer_on_host() || l.shard_in_host()) continue;
    if (l.shard_on_nvme()) {
      l.staging = UpdateStaging::kParameterSlot;  // an early update's too: written back at once, rewritten on a skip
    } else if (p.early_updates) {
      l.staging = UpdateStaging::kLayer;
    } else {
      l.staging = UpdateStaging::kSharedPiece;
      const LayerPartition& layer = partition.layer(li);
      for (const SubGroup& g : layer.groups)
        for (const LayerPartition::PieceRun& run : layer.piece_runs(g, p.owned_rank_begin(), p.owned_rank_end()))
          p.shared_staging_bytes =
              std::max<uint64_t>(p.shared_staging_bytes, host_part(p.ratio, run.real) * l.param_element_bytes);
    }
  }
}

// Note [Gradient shards on NVMe]: every trained layer's reduced gradient
// shard goes to NVMe, through the gradient slots.
void put_gradient_shards_on_nvme(const EngineOptions& opt, const Partition& partition, StatePlacement& p) {
  const size_t grad_bytes = dtype_size(opt.grad_dtype);
  uint64_t largest = 0, total = 0;
  for (size_t li = 0; li < p.layers.size(); ++li) {
    LayerPlacement& l = p.layers[li];
    if (l.frozen) continue;
    l.pinned_gradient_shard = false;
    l.gradient_shard_on_nvme = true;
    const uint64_t owned_ranks = static_cast<uint64_t>(p.owned_rank_end() - p.owned_rank_begin());
    for (const SubGroup& g : partition.layer(li).groups) {
      largest = std::max<uint64_t>(largest, g.piece * grad_bytes);
      total += owned_ranks * g.piece * grad_bytes;
    }
  }
  p.gradient_nvme_bytes = total;
  p.gradient_folder = p.optimizer_on_nvme() ? StatePlacement::GradientFolder::kOptimizerState
                                            : StatePlacement::GradientFolder::kParameterShards;
  // The slots of the tier whose folder they share.
  const int64_t buffer_count = p.optimizer_on_nvme() ? opt.nvme.buffer_count : opt.nvme_param.buffer_count;
  p.gradient_slot_count = static_cast<size_t>(std::max<int64_t>(2, buffer_count));
  p.gradient_slot_bytes = (std::max<uint64_t>(largest, 1) + 4095) / 4096 * 4096;
}

Status decide_gradient_shards(const EngineOptions& opt, const Partition& partition, StatePlacement& p) {
  if (opt.gradient_shards == GradientShardsMode::kPinned) {
    p.gradient_shards_why = "strata.gradient_shards pinned";
    return Status::Ok();
  }
  std::string blocker = gradient_shards_nvme_blocker(opt.placement(), opt.ratio);
  if (!blocker.empty()) {
    if (opt.gradient_shards == GradientShardsMode::kNvme)
      return Unsupported(fmt::format("{}: strata.gradient_shards nvme: {}; set it to auto or pinned", opt.source,
                                     blocker));
    p.gradient_shards_why = std::move(blocker);
    return Status::Ok();
  }
  if (opt.gradient_shards == GradientShardsMode::kNvme) {
    p.gradient_shards_why = "strata.gradient_shards nvme";
    put_gradient_shards_on_nvme(opt, partition, p);
    return Status::Ok();
  }
  // auto: NVMe only where pinned shards do not fit the budget (the NVMe way
  // costs a write and a read of every gradient byte per step).
  if (opt.host_memory_budget == 0) {
    p.gradient_shards_why = "no strata.host_memory_budget to fit (auto keeps them pinned, saving their NVMe write and read)";
    return Status::Ok();
  }
  const uint64_t planned = plan_engine_memory(opt, partition, p).pinned;
  if (planned <= opt.host_memory_budget) {
    p.gradient_shards_why = fmt::format("pinned shards fit strata.host_memory_budget ({} of {})",
                                        format_bytes(planned, true), format_bytes(opt.host_memory_budget, true));
    return Status::Ok();
  }
  StatePlacement on_nvme = p;
  put_gradient_shards_on_nvme(opt, partition, on_nvme);
  const uint64_t spilled = plan_engine_memory(opt, partition, on_nvme).pinned;
  if (spilled >= planned) {
    p.gradient_shards_why = fmt::format(
        "the pinned plan ({}) does not fit strata.host_memory_budget ({}), but the gradient slots would hold more "
        "than the shards (lower zero_optimization.sub_group_size: a slot holds one piece)",
        format_bytes(planned, true), format_bytes(opt.host_memory_budget, true));
    return Status::Ok();
  }
  on_nvme.gradient_shards_why =
      fmt::format("the plan with pinned shards ({}) does not fit strata.host_memory_budget ({}); on NVMe: {}",
                  format_bytes(planned, true), format_bytes(opt.host_memory_budget, true),
                  format_bytes(spilled, true));
  p = std::move(on_nvme);
  return Status::Ok();
}

Status decide_early_updates(const EngineOptions& opt, const Partition& partition, StatePlacement& p) {
  p.early_pending_bytes.assign(p.layers.size(), 0);
  if (opt.speculative_optimizer == SpeculationMode::kOff) return Status::Ok();
  std::string blocker = early_updates_blocker(p);
  if (!blocker.empty()) {
    if (opt.speculative_optimizer == SpeculationMode::kOn)
      return Unsupported(fmt::format("{}: strata.speculative_optimizer on: {}; set it to auto or off", opt.source,
                                     blocker));
    p.early_updates_off = std::move(blocker);
    return Status::Ok();
  }
  // The pending buffers of a layer: its owned pieces' state as the tier
  // holds it (with a master: the host optimizer keeps one for every dtype).
  // On NVMe the pending state is a version on NVMe (the plan's nvme bytes),
  // none in pinned memory.
  uint64_t total = 0;
  for (size_t li = 0; li < p.layers.size() && !p.optimizer_on_nvme(); ++li) {
    const LayerPlacement& l = p.layers[li];
    if (l.frozen) continue;
    const LayerPartition& layer = partition.layer(li);
    uint64_t bytes = 0;
    for (const SubGroup& g : layer.groups)
      for (const LayerPartition::PieceRun& run : layer.piece_runs(g, p.owned_rank_begin(), p.owned_rank_end())) {
        // offload_optimizer.ratio < 1: only the host part is stepped early.
        const size_t count = host_part(p.ratio, run.real);
        bytes += run.ranks * memory_piece_bytes(count, l.master, opt.moments);
      }
    p.early_pending_bytes[li] = std::max<uint64_t>(64, bytes);
    total += p.early_pending_bytes[li];
  }
  p.early_updates = true;
  if (opt.speculative_optimizer == SpeculationMode::kAuto && p.device.host_addressable) {
    // Measured on the 2-core VM (docs/performance.md, "Early, exact updates"):
    // where the model's compute runs on the host's own cores, the update
    // under the backward competes with it for cores and memory bandwidth:
    // 1.26-1.46x slower steps with the first version's copy of the state,
    // 0.95-1.05x (no faster) written out of place.
    p.early_updates = false;
    p.early_updates_off = "the cpu device's compute shares the host's cores and memory bandwidth with the optimizer "
                          "(measured no faster there); strata.speculative_optimizer on forces it";
    // With the state on NVMe the phase is I/O more than CPU: without the
    // pipelines early updates measured faster at fp32 moments; with them the
    // late updates hide as well (docs/performance.md, "Read-ahead at the
    // step's end").
    if (p.optimizer_on_nvme())
      p.early_updates_off += " (with the state on NVMe, offload_optimizer.pipeline_read and pipeline_write hide its "
                             "I/O under the next forward: measured 0.98-1.04x the in-memory step on a 2-core VM with "
                             "8-bit moments, no slower than early updates)";
    p.early_pending_bytes.assign(p.layers.size(), 0);
    return Status::Ok();
  }
  if (opt.speculative_optimizer == SpeculationMode::kAuto) {
    // auto: the plan with the pending buffers must fit this rank's share of
    // strata.host_memory_budget or, without one, of half this machine's
    // memory (every rank counted as if on this machine: conservative).
    const bool budgeted = opt.host_memory_budget != 0;
    const uint64_t budget = budgeted ? opt.host_memory_budget : physical_memory_bytes() / 2 / std::max(1, p.world);
    decide_update_staging(partition, p);  // per layer while early updates are on
    const uint64_t planned = plan_engine_memory(opt, partition, p).pinned;  // the pending buffers included
    if (planned > budget) {
      p.early_updates = false;
      p.early_updates_off = fmt::format("the pending versions of its state ({}) do not fit {} ({}) beside the rest of the plan ({})",
                                        format_bytes(total, true),
                                        budgeted ? "strata.host_memory_budget" : "half this machine's memory per rank",
                                        format_bytes(budget, true), format_bytes(planned - total, true));
      p.early_pending_bytes.assign(p.layers.size(), 0);
    }
  }
  return Status::Ok();
}

}  // namespace

const char* state_home_name(StateHome home) {
  switch (home) {
    case StateHome::kDevice: return "device";
    case StateHome::kPinnedHost: return "pinned host";
    case StateHome::kNvme: return "nvme";
  }
  return "?";
}

const char* param_home_name(ParamHome home) {
  switch (home) {
    case ParamHome::kWholeOnDevice: return "whole on the device";
    case ParamHome::kShardOnDevice: return "shard on the device";
    case ParamHome::kShardInPinnedHost: return "shard in pinned host memory";
    case ParamHome::kShardOnNvme: return "shard on nvme";
  }
  return "?";
}

namespace {

// The layer's one parameter dtype (the engine steps a layer as one flat
// run), checked: back to back tensors, a float dtype, trainable or frozen as a whole.
Result<DType> layer_dtype(const LayerSpec& spec, size_t li) {
  const DType dtype = spec.params.empty() ? DType::kF32 : spec.params.front().dtype;
  const bool frozen = layer_frozen(spec);
  for (const ParamTensorSpec& t : spec.params) {
    if (t.dtype != dtype || t.offset_bytes != t.offset_elements * dtype_size(t.dtype))
      return Unsupported(fmt::format("layer {} '{}': tensor '{}' ({}) — the engine needs one dtype per layer, "
                                     "tensors back to back",
                                     li, printable(spec.name, 64), printable(t.name, 64), dtype_name(t.dtype)));
    if (t.trainable == frozen)
      return InvalidArgument(fmt::format("layer {} '{}': tensor '{}' is {} but the layer's first tensor is not; a "
                                         "layer is trainable or frozen as a whole",
                                         li, printable(spec.name, 64), printable(t.name, 64),
                                         t.trainable ? "trainable" : "frozen"));
  }
  if (!is_state_float(dtype))
    return Unsupported(fmt::format("layer {} '{}' has dtype {}; the engine trains fp32, bf16 or fp16 parameters", li,
                                   printable(spec.name, 64), dtype_name(dtype)));
  return dtype;
}

}  // namespace

Result<StatePlacement> StatePlacement::compute(const EngineOptions& opt, std::span<const LayerSpec> layers,
                                               const Partition& partition, int rank, const PlannedDevice& device) {
  const int world = partition.world();
  if (rank < 0 || rank >= world) return InvalidArgument(fmt::format("rank {} is not in 0..{}", rank, world - 1));
  if (layers.size() != partition.layer_count())
    return InvalidArgument(fmt::format("{} layer specs for a partition of {} layers", layers.size(),
                                       partition.layer_count()));
  StatePlacement p;
  p.choice = opt.placement();
  const Placement& choice = p.choice;
  p.world = world;
  p.rank = rank;
  p.optimizer_state = choice.optimizer_on_nvme()          ? StateHome::kNvme
                      : choice.optimizer_in_host_memory() ? StateHome::kPinnedHost
                                                          : StateHome::kDevice;
  p.ratio = opt.ratio;
  p.split = opt.ratio < 1.0;
  p.gradients_in_place = choice.gradients_in_place();
  p.device = device;
  p.device_kernel = !p.optimizer_on_host() && !device.host_addressable;
  p.layers.resize(layers.size());
  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerSpec& spec = layers[li];
    const LayerPartition& part = partition.layer(li);
    LayerPlacement& l = p.layers[li];
    STRATA_ASSIGN_OR_RETURN(l.param_dtype, layer_dtype(spec, li));
    l.param_element_bytes = dtype_size(l.param_dtype);
    l.frozen = layer_frozen(spec);
    if (!choice.params_sharded() || static_cast<int64_t>(spec.param_count) < opt.persistence_threshold) {
      l.params = ParamHome::kWholeOnDevice;
    } else if (!choice.params_offloaded()) {
      l.params = ParamHome::kShardOnDevice;
      l.acquired_in_place = choice.shards_acquired_in_place(world);
    } else if (choice.params_in_host_memory() ||
               p.param_elements_in_host + part.shard_elements <= static_cast<uint64_t>(opt.nvme_param.max_in_cpu)) {
      // offload_param nvme keeps the first max_in_cpu shard elements in host memory.
      l.params = ParamHome::kShardInPinnedHost;
      if (choice.params_on_nvme()) p.param_elements_in_host += part.shard_elements;
    } else {
      l.params = ParamHome::kShardOnNvme;
      p.largest_nvme_shard_bytes =
          std::max<uint64_t>(p.largest_nvme_shard_bytes, part.shard_elements * l.param_element_bytes);
    }
    if (l.frozen) {
      l.gradients = GradientBuffer::kNone;
      continue;  // parameters only
    }
    l.gradients = choice.gradients_sharded() ? GradientBuffer::kPerStep : GradientBuffer::kPersistent;
    l.master = !(l.param_dtype == DType::kF32 && !p.optimizer_on_host());
    l.pinned_gradient_shard = p.optimizer_on_host();
    l.device_gradient_shard = (!p.optimizer_on_host() && !p.gradients_in_place) || p.split;
    l.norm_gradient_copy = p.device_kernel;
  }
  STRATA_RETURN_IF_ERROR(decide_early_updates(opt, partition, p));
  decide_update_staging(partition, p);
  STRATA_RETURN_IF_ERROR(decide_gradient_shards(opt, partition, p));
  return p;
}

}  // namespace strata::offload
