// The engine's memory plan (Engine::predicted_memory), without an engine:
// what one rank of a run with these options, this model and this world size
// would hold per tier. `strata estimate --config --model` prints it.
#include <algorithm>

#include <fmt/format.h>

#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/partition.h"

namespace strata::offload {

// What init_layer and the step allocate, summed without allocating. Stage-3
// gathers and stage 2-3 full gradients are transient: the executor enqueues
// a whole pass before the stream runs it, so all of them are alive at once
// unless the caps (stage3_max_live_parameters, reduce_bucket_size) bound
// them, and a cap is never below one layer.
Result<EngineMemory> plan_engine_memory(const EngineOptions& opt, std::span<const LayerSpec> layers, int world,
                                        int rank) {
  if (rank < 0 || rank >= world)
    return InvalidArgument(fmt::format("rank {} is not in 0..{}", rank, world - 1));
  STRATA_ASSIGN_OR_RETURN(Partition part, Partition::create(layers, world, opt.sub_group_size));
  const bool opt_on_host = opt.offload_optimizer != OffloadDevice::kNone;
  const bool param_on_host = opt.offload_param != OffloadDevice::kNone;
  const bool stage0 = opt.stage == 0;
  const bool grads_in_place = !opt_on_host && opt.stage <= 1;
  const bool split = opt.ratio < 1.0;
  const size_t ge = dtype_size(opt.grad_dtype);
  const int owned_begin = stage0 ? 0 : rank, owned_end = stage0 ? world : rank + 1;
  EngineMemory m;
  const size_t me = dtype_size(opt.moment_dtype);
  uint64_t np_total = 0, np_max = 0, g_total = 0, g_max = 0, np_total_real = 0, nvme_largest = 0;
  uint64_t param_cached = 0, param_slot = 0;
  uint64_t largest_piece = 0;  // of this rank's pieces (every rank saves its own), for the snapshot slot
  size_t np_pe = 2;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerSpec& spec = layers[li];
    const LayerPartition& lp = part.layer(li);
    const DType pd = spec.params.empty() ? DType::kF32 : spec.params.front().dtype;
    const size_t pe = dtype_size(pd);
    const bool persistent = opt.stage < 3 || static_cast<int64_t>(spec.param_count) < opt.persistence_threshold;
    const bool master = !(pd == DType::kF32 && !opt_on_host);
    const uint64_t F = lp.padded_elements, S = lp.shard_elements, owned = stage0 ? lp.padded_elements : lp.shard_elements;
    // offload_param nvme: shards past the first max_in_cpu elements live on
    // NVMe (engine.cpp make_param_swap decides the same way).
    bool on_nvme = false;
    if (!persistent && opt.offload_param == OffloadDevice::kNvme) {
      if (param_cached + S <= static_cast<uint64_t>(opt.nvme_param.max_in_cpu)) {
        param_cached += S;
      } else {
        on_nvme = true;
        m.nvme += S * pe;
        param_slot = std::max<uint64_t>(param_slot, S * pe);
      }
    }
    if (persistent) {
      m.device_params += F * pe;
    } else {
      if (on_nvme)
        ;  // on NVMe, read through the slots below
      else if (param_on_host)
        m.pinned_params += S * pe;
      else
        m.device_params += S * pe;
      np_total += F;
      np_total_real += lp.elements;
      np_max = std::max(np_max, F);
      np_pe = pe;
    }
    if (layer_frozen(spec)) continue;  // parameters only: no gradient, no optimizer state
    if (opt.stage <= 1) {
      m.device_grads += F * ge;
    } else {
      g_total += F;
      g_max = std::max(g_max, F);
    }
    if (opt_on_host) {
      m.pinned_grads += std::max<uint64_t>(64, owned * ge);
      if (!(param_on_host && !persistent) || on_nvme) m.pinned_staging += std::max<uint64_t>(64, owned * pe);
    }
    if ((!opt_on_host && !grads_in_place) || split) m.device_optimizer += std::max<uint64_t>(64, owned * ge);
    for (const SubGroup& g : lp.groups) largest_piece = std::max<uint64_t>(largest_piece, lp.piece_real(g, rank));
    for (const SubGroup& g : lp.groups)
      for (int r = owned_begin; r < owned_end; ++r) {
        const uint64_t count = lp.piece_real(g, r), host = host_part(opt.ratio, count);
        if (opt.offload_optimizer == OffloadDevice::kNvme) {
          const uint64_t b = nvme_piece_bytes(host, true, opt.moment_dtype);
          m.nvme += 2 * b;  // the committed and the pending version (Note [Piece versions])
          nvme_largest = std::max(nvme_largest, b);
        } else {
          (opt_on_host ? m.pinned_optimizer : m.device_optimizer) +=
              std::max<uint64_t>(64, host * (2 * me + (master ? 4 : 0)));
        }
        // ratio < 1: the device part (fp32 parameters are their own master there).
        if (split)
          m.device_optimizer +=
              std::max<uint64_t>(64, (count - host) * (2 * me + (pd == DType::kF32 ? 0 : 4)));
      }
  }
  // Gathered layers: at most one copy per layer is valid, and a dropped copy
  // lives on until the pass that used it has run. When the reuse or prefetch
  // window spans a whole micro-batch nothing is dropped within a step, so at
  // most every layer once; otherwise the next pass's gathers may be issued
  // while the last pass's copies still wait for their free: twice.
  const uint64_t window = static_cast<uint64_t>(std::max(opt.max_reuse_distance, opt.prefetch_bucket_size));
  const bool spans = window >= 2 * np_total_real;
  const uint64_t unbounded = spans ? np_total : 2 * np_total;
  m.device_gathered = std::min(unbounded, std::max<uint64_t>(opt.max_live_parameters, np_max)) * np_pe;
  // World 1, shards on the device: a shard is its whole layer, acquired in
  // place (Engine::Impl::aliased): no gathered copies.
  if (world == 1 && opt.offload_param == OffloadDevice::kNone) m.device_gathered = 0;
  // With gradient accumulation every layer's full gradient lives until the
  // last micro-batch reduces it (the sum over micro-batches is taken before
  // the sum over ranks, as at stage 0), so the bucket cannot bound them.
  m.device_grads += (opt.grad_accum > 1 ? g_total : std::min(g_total, std::max<uint64_t>(opt.reduce_bucket_size, g_max))) * ge;
  m.device = m.device_params + m.device_grads + m.device_optimizer + m.device_gathered;
  // NVMe: the state streams through buffer_count pinned slots of the largest piece.
  if (opt.offload_optimizer == OffloadDevice::kNvme)
    m.pinned_optimizer = static_cast<uint64_t>(opt.nvme.buffer_count) * std::max(nvme_largest, kNvmeStateAlign);
  if (param_slot != 0) m.pinned_params += static_cast<uint64_t>(opt.nvme_param.buffer_count) * std::max<uint64_t>(param_slot, 4096);
  m.pinned = m.pinned_optimizer + m.pinned_grads + m.pinned_staging + m.pinned_params;
  // A checkpoint snapshot slot: the largest piece as fp32 master [4 B] and
  // moments [8 B], each part 4 KiB-aligned (engine_checkpoint.cpp).
  auto aligned = [](uint64_t n) { return (n + 4095) / 4096 * 4096; };
  m.snapshot_slot_bytes = aligned(4 * largest_piece) + aligned(8 * largest_piece);
  return m;
}

}  // namespace strata::offload
