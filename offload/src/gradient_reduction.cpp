// GradientReduction (Note [Gradient reduction] in gradient_reduction.h).
#include "gradient_reduction.h"
#include "early_updates.h"

#include "gradient_spill.h"
#include "update_scheduler.h"

#include <cstring>

#include <fmt/format.h>

#include "strata/comm/host_collective.h"
#include "strata/offload/grad_norm.h"

namespace strata::offload::engine_detail {

void GradientReduction::init() {
  auto bounded = [this](const Completion& c, std::string_view what) { return ctx_.wait_bounded(c, what); };
  live_.emplace(ctx_.frees.get(), bounded);
  layers_.resize(ctx_.part.layer_count());
}

Status GradientReduction::init_layer(size_t li) {
  const LayerPlacement& where = ctx_.where(li);
  if (where.frozen) return Status::Ok();  // no gradient
  const LayerPartition& layer_part = ctx_.part.layer(li);
  LayerGradients& l = layers_[li];
  const std::string lname = ctx_.layer_label(li);
  const size_t gb = ctx_.grad_bytes();
  if (where.gradients == GradientBuffer::kPersistent) {
    STRATA_ASSIGN_OR_RETURN(l.full_grads, ctx_.alloc_device(layer_part.padded_elements * gb, "gradients of " + lname));
    STRATA_RETURN_IF_ERROR(ctx_.device.memset(l.full_grads.data(), 0, layer_part.padded_elements * gb));
  }
  const size_t owned = ctx_.owned_elements(layer_part);
  if (where.pinned_gradient_shard) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_host,
                            HostBuffer::create(ctx_.device, ctx_.stats, owned * gb, "gradient shard of " + lname));
  }
  if (where.device_gradient_shard) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_dev, ctx_.alloc_device(owned * gb, "gradient shard of " + lname));
  }
  if (where.norm_gradient_copy) {
    const size_t n = ctx_.grads_in_place() ? layer_part.padded_elements : owned;
    STRATA_ASSIGN_OR_RETURN(l.norm_grads, HostBuffer::create(ctx_.device, ctx_.stats, n * gb,
                                                             "gradient copy for the norm of " + lname));
  }
  l.block_sums.assign(owned / kShardAlign, 0.0);
  return Status::Ok();
}

void GradientReduction::begin_step() {
  for (LayerGradients& l : layers_) l.reduce_launched = false;
  gradient_complete_.assign(layers_.size(), false);
  for (size_t li = 0; li < layers_.size(); ++li) gradient_complete_[li] = ctx_.where(li).frozen;
  next_reduction_ = static_cast<int64_t>(layers_.size()) - 1;
}

void GradientReduction::begin_micro_batch() {
  for (LayerGradients& l : layers_) l.backward_releases = 0;
}

Status GradientReduction::check_backward_acquire(size_t li) const {
  if (!layers_[li].reduce_launched) return Status::Ok();
  return FailedPrecondition(fmt::format(
      "{} was acquired for backward after its gradient was complete by the recorded acquire sequence and its "
      "reduction had started: this micro-batch followed the recording up to the layer's last recorded backward, "
      "then acquired it again (Note [Acquire order]); a model that revisits a layer in backward must do it in every "
      "step, or acquire it in forward as often",
      ctx_.layer_label(li)));
}

// Note [Gradient buffers zeroed apart]
// A layer's backward waits for its gradient buffer to be zeroed. On the copy
// stream that memset queued behind the previous layer's reduction and copy
// out, which wait for that layer's backward: so each backward waited for its
// predecessor's copy out as well (measured on the cpu device, `small`, stage
// 2: 4-7 ms per layer). On a stream of its own, gated only by `readers` (the
// last step's readers of a kept buffer; none for a fresh one), the memset
// runs as soon as the layer is acquired, normally long before its backward.
Status GradientReduction::zero(LayerGradients& l, size_t li, const Completion& readers) {
  const size_t bytes = ctx_.part.layer(li).padded_elements * ctx_.grad_bytes();
  Stream& zeroing = *ctx_.zeroing;
  STRATA_RETURN_IF_ERROR(zeroing.wait(readers));
  STRATA_RETURN_IF_ERROR(zeroing.memset_async(l.full_grads.data(), 0, bytes));
  l.grads_zeroed = zeroing.record_completion();
  l.zeroed_step = ctx_.steps_begun;
  return Status::Ok();
}

Result<GradientReduction::Lease> GradientReduction::acquire_for_backward(size_t li) {
  LayerGradients& l = layers_[li];
  const LayerPartition& layer_part = ctx_.part.layer(li);
  if (!l.full_grads) {
    // Gradients waiting for their reduction are capped by reduce_bucket_size
    // (stages 2, 3): wait for earlier layers' reductions to free theirs.
    STRATA_RETURN_IF_ERROR(live_->make_room(layer_part.padded_elements, static_cast<uint64_t>(ctx_.opt.reduce_bucket_size))
                               .with_context("freeing reduced gradients"));
    live_->hold(layer_part.padded_elements);
    STRATA_ASSIGN_OR_RETURN(l.full_grads, ctx_.alloc_device(layer_part.padded_elements * ctx_.grad_bytes(),
                                                            [&] { return "gradients of " + ctx_.layer_label(li); }));
    STRATA_RETURN_IF_ERROR(zero(l, li, Completion()));  // the model waits for it
  } else if (l.zeroed_step != ctx_.steps_begun) {
    // Persistent gradients: zero once per step, after the last step's readers.
    STRATA_RETURN_IF_ERROR(zero(l, li, l.full_gradient_read));
  }
  return Lease{l.full_grads.as<std::byte>(), l.grads_zeroed};
}

Status GradientReduction::released_in_backward(size_t li, const Completion& done, std::optional<int> expected,
                                               bool completes) {
  LayerGradients& l = layers_[li];
  l.last_backward_released = done;
  ++l.backward_releases;
  // A layer's gradient is complete at its last backward release: as many as
  // the recorded sequence has, or, while a micro-batch is being recorded, as
  // many as its forward acquires (a backward mirrors its forward); once a
  // micro-batch departs from the recording, when it ends (Note [Acquire
  // order]). Reductions go out in canonical order.
  if (!ctx_.where(li).frozen && completes && expected && l.backward_releases == *expected && !l.reduce_launched)
    return gradient_completed(li);
  return Status::Ok();
}

Status GradientReduction::gradient_completed(size_t li) {
  gradient_complete_[li] = true;
  for (; next_reduction_ >= 0 && gradient_complete_[static_cast<size_t>(next_reduction_)]; --next_reduction_)
    if (!layers_[static_cast<size_t>(next_reduction_)].reduce_launched)
      STRATA_RETURN_IF_ERROR(launch_reduction(static_cast<size_t>(next_reduction_)));
  return Status::Ok();
}

Status GradientReduction::launch_every_reduction() {
  for (; next_reduction_ >= 0; --next_reduction_)
    if (!layers_[static_cast<size_t>(next_reduction_)].reduce_launched)
      STRATA_RETURN_IF_ERROR(launch_reduction(static_cast<size_t>(next_reduction_)));
  return Status::Ok();
}

Status GradientReduction::launch_reduction(size_t li) {
  LayerGradients& l = layers_[li];
  if (ctx_.where(li).frozen) return Status::Ok();  // no gradient (a frozen layer is acquired for backward all the same)
  l.reduce_launched = true;
  if (l.zeroed_step != ctx_.steps_begun) STRATA_RETURN_IF_ERROR(zero_untouched_gradient(l, li));
  std::byte* full = l.full_grads.as<std::byte>();
  STRATA_ASSIGN_OR_RETURN(const Completion local, gradient_to_reduce(l, li, full));
  STRATA_ASSIGN_OR_RETURN(const Completion reduced, sum_over_ranks(li, full, local));
  if (ctx_.where(li).gradient_shard_on_nvme) {
    spill_reduced_gradient(l, li, full, reduced);
    return reduction_issued(li);
  }
  STRATA_ASSIGN_OR_RETURN(std::byte* dst, move_to_optimizer_input(l, li, full, reduced));
  STRATA_ASSIGN_OR_RETURN(const std::byte* sums_src, copy_for_host_sums(l, li, full, dst, reduced));
  if (dst != nullptr) gradient_moved(l, li, reduced);
  queue_block_sums(l, li, sums_src != nullptr ? sums_src : full, dst == nullptr || ctx_.stage0());
  l.full_gradient_read = l.norm_partials_ready;
  return reduction_issued(li);
}

// No backward touched the layer this step: its gradient is zero (a
// persistent buffer still holds the last step's, once its readers are done).
Status GradientReduction::zero_untouched_gradient(LayerGradients& l, size_t li) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  Completion readers;  // none for a fresh buffer
  if (!l.full_grads) {
    live_->hold(layer_part.padded_elements);
    STRATA_ASSIGN_OR_RETURN(l.full_grads, ctx_.alloc_device(layer_part.padded_elements * ctx_.grad_bytes(),
                                                            fmt::format("gradients of layer {}", li)));
  } else {
    readers = l.full_gradient_read;  // the zeroing stream (not the host) waits for them
  }
  STRATA_RETURN_IF_ERROR(zero(l, li, readers));
  l.last_backward_released = l.grads_zeroed;
  return Status::Ok();
}

// When the layer's gradient in `full` is complete: its last backward, or
// the copy of a gradient FaultHooks injects, which lands after it.
Result<Completion> GradientReduction::gradient_to_reduce(LayerGradients& l, size_t li, std::byte* full) {
  const std::byte* injected =
      ctx_.faults.gradient_override(ctx_.steps_begun, ctx_.rank, li, ctx_.opt.grad_dtype);
  if (injected == nullptr) return l.last_backward_released;
  Stream& xfer = *ctx_.xfer;
  // A stream wait (no host wait): the injected value overwrites what the last backward wrote.
  STRATA_RETURN_IF_ERROR(xfer.wait(l.last_backward_released));
  STRATA_RETURN_IF_ERROR(xfer.copy_async(full, injected, ctx_.grad_bytes(), CopyKind::kHostToDevice));
  return xfer.record_completion();
}

// Sums the gradient over the ranks in place (each rank's owned pieces; at
// stage 0 all-gathered back whole) once `local` completes; returns when it is reduced.
Result<Completion> GradientReduction::sum_over_ranks(size_t li, std::byte* full, const Completion& local) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const EngineOptions& opt = ctx_.opt;
  comm::Communicator& comm = ctx_.comm;
  const int rank = ctx_.rank;
  const size_t e = ctx_.grad_bytes();
  Completion reduced = local;
  if (ctx_.world > 1) {
    // Queue gates, not host waits: the reduction starts once the layer's
    // backward wrote its gradient; the moves once it is reduced.
    STRATA_RETURN_IF_ERROR(comm.wait(local, comm::CommQueue::kReduce));
    for (const SubGroup& g : layer_part.groups) {
      std::byte* send = full + g.padded_begin * e;
      STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.reduce_scatter(send, send + g.piece * rank * e, g.piece,
                                                                    opt.grad_dtype, comm::ReduceOp::kSum,
                                                                    comm::CommQueue::kReduce));
      reduced = w.completion();
    }
    if (ctx_.stage0()) {
      for (const SubGroup& g : layer_part.groups) {
        STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(full + layer_part.piece_begin(g, rank) * e,
                                                                  full + g.padded_begin * e, g.piece, opt.grad_dtype,
                                                                  comm::CommQueue::kReduce));
        reduced = w.completion();
      }
    }
  }
  // (One rank: the sum over ranks is the gradient itself, bit for bit, so
  // nothing is queued; the bytes are counted as the collectives would move them.)
  ctx_.transfers.reduce_bytes += layer_part.padded_elements * e * (ctx_.stage0() ? 2 : 1);
  return reduced;
}

// Note [Gradient shards on NVMe]: the owned pieces go to NVMe from the
// device buffer, summed for the norm on the way, on the spill thread.
void GradientReduction::spill_reduced_gradient(LayerGradients& l, size_t li, std::byte* full,
                                               const Completion& reduced) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  ctx_.transfers.d2h_bytes += ctx_.owned_elements(layer_part) * ctx_.grad_bytes();
  l.norm_partials_ready = ctx_.gradient_spill->spill(
      li, full, reduced, [this, li](size_t block_offset, const std::byte* piece, size_t elements) {
        sum_piece_blocks(li, block_offset, piece, elements);
      });
  l.reduced_gradient_moved = l.norm_partials_ready;
  if (ctx_.where(li).gradients == GradientBuffer::kPerStep) {
    const Completion users[] = {l.last_backward_released, reduced, l.norm_partials_ready};
    live_->give_back(std::move(l.full_grads), when_all(users), layer_part.padded_elements);
  }
  l.full_gradient_read = l.norm_partials_ready;
}

// Moves the owned pieces to where the optimizer reads them once `reduced`
// completes; returns where the block sums read them (null: the optimizer
// reads them in place in `full`, and they count as moved once reduced).
Result<std::byte*> GradientReduction::move_to_optimizer_input(LayerGradients& l, size_t li, std::byte* full,
                                                              const Completion& reduced) {
  std::byte* dst = nullptr;
  CopyKind kind = CopyKind::kDeviceToDevice;
  if (ctx_.opt_on_host()) {
    dst = l.opt_grads_host.data();
    kind = CopyKind::kDeviceToHost;
  } else if (!ctx_.grads_in_place()) {
    dst = l.opt_grads_dev.as<std::byte>();
  }
  if (dst == nullptr) {
    l.reduced_gradient_moved = reduced;
    return dst;
  }
  if (ctx_.split()) return move_split_pieces(l, li, full, dst, reduced);
  STRATA_RETURN_IF_ERROR(move_owned_pieces(li, full, dst, kind, reduced));
  return dst;
}

// ratio < 1: the whole piece stays on the device (the device part steps
// from there, the block sums read it), only the host part goes D2H to
// `host_dst`; returns the device copy.
Result<std::byte*> GradientReduction::move_split_pieces(LayerGradients& l, size_t li, std::byte* full,
                                                        std::byte* host_dst, const Completion& reduced) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  Stream& xfer = *ctx_.xfer;
  const size_t e = ctx_.grad_bytes();
  STRATA_RETURN_IF_ERROR(xfer.wait(reduced));  // a stream wait: the copies read the summed gradient
  std::byte* dev = l.opt_grads_dev.as<std::byte>();
  for (const SubGroup& g : layer_part.groups) {
    const std::byte* piece = full + layer_part.piece_begin(g, ctx_.rank) * e;
    STRATA_RETURN_IF_ERROR(xfer.copy_async(dev + g.shard_offset * e, piece, g.piece * e, CopyKind::kDeviceToDevice));
    const size_t host = ctx_.host_n(layer_part.piece_real(g, ctx_.rank));
    STRATA_RETURN_IF_ERROR(xfer.copy_async(host_dst + g.shard_offset * e, piece, host * e, CopyKind::kDeviceToHost));
    ctx_.transfers.d2h_bytes += host * e;
  }
  return dev;  // where the block sums read
}

// The owned pieces (stage 0: the whole layer) copied to `dst` by `kind`.
Status GradientReduction::move_owned_pieces(size_t li, std::byte* full, std::byte* dst, CopyKind kind,
                                            const Completion& reduced) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  Stream& xfer = *ctx_.xfer;
  const size_t e = ctx_.grad_bytes();
  STRATA_RETURN_IF_ERROR(xfer.wait(reduced));  // a stream wait: the copies read the summed gradient
  if (ctx_.stage0()) {
    STRATA_RETURN_IF_ERROR(xfer.copy_async(dst, full, layer_part.padded_elements * e, kind));
  } else {
    for (const SubGroup& g : layer_part.groups)
      STRATA_RETURN_IF_ERROR(
          xfer.copy_async(dst + g.shard_offset * e, full + layer_part.piece_begin(g, ctx_.rank) * e, g.piece * e, kind));
  }
  if (kind == CopyKind::kDeviceToHost) ctx_.transfers.d2h_bytes += ctx_.owned_elements(layer_part) * e;
  return Status::Ok();
}

// device_opt(): the block sums are computed on the host, from a copy of the
// moved pieces (`dst`) or, in place, of the whole layer; returns where the
// block sums read (`dst` without device_opt()).
Result<const std::byte*> GradientReduction::copy_for_host_sums(LayerGradients& l, size_t li, const std::byte* full,
                                                               const std::byte* dst, const Completion& reduced) {
  if (!ctx_.device_opt()) return dst;
  const LayerPartition& layer_part = ctx_.part.layer(li);
  Stream& xfer = *ctx_.xfer;
  const size_t e = ctx_.grad_bytes();
  const std::byte* from = dst != nullptr ? dst : full;
  const size_t n = dst != nullptr ? ctx_.owned_elements(layer_part) : layer_part.padded_elements;
  // In place, nothing has ordered the copy after the sum yet (a stream wait, as for the moves above).
  if (dst == nullptr) STRATA_RETURN_IF_ERROR(xfer.wait(reduced));
  STRATA_RETURN_IF_ERROR(xfer.copy_async(l.norm_grads.data(), from, n * e, CopyKind::kDeviceToHost));
  ctx_.transfers.d2h_bytes += n * e;
  if (dst == nullptr) l.reduced_gradient_moved = xfer.record_completion();
  return static_cast<const std::byte*>(l.norm_grads.data());
}

// The moves to the optimizer's input were queued: they complete the
// reduced gradient's move, and a per-step buffer goes back after its users.
void GradientReduction::gradient_moved(LayerGradients& l, size_t li, const Completion& reduced) {
  l.reduced_gradient_moved = ctx_.xfer->record_completion();
  if (ctx_.where(li).gradients == GradientBuffer::kPerStep) {
    // Its users: the model's backward, the reduction in place, the copy out.
    const Completion users[] = {l.last_backward_released, reduced, l.reduced_gradient_moved};
    live_->give_back(std::move(l.full_grads), when_all(users), ctx_.part.layer(li).padded_elements);
  }
}

// Block sums of the owned pieces at `src` (padding blocks sum to zero): on
// the optimizer thread, or here when the gradient is in place already and
// the layer is so small that the handoff would cost more than the sums.
void GradientReduction::queue_block_sums(LayerGradients& l, size_t li, const std::byte* src, bool in_padded_layout) {
  if (l.reduced_gradient_moved.done() && l.reduced_gradient_moved.status().ok() &&
      ctx_.owned_elements(ctx_.part.layer(li)) <= kInlineBlockSumElements) {
    sum_blocks(li, src, in_padded_layout);
    l.norm_partials_ready = Completion();
  } else {
    l.norm_partials_ready = updates_.queue_on_optimizer_thread(
        [this, li, src, in_padded_layout] {
          sum_blocks(li, src, in_padded_layout);
          return Status::Ok();
        },
        l.reduced_gradient_moved, fmt::format("gradient block sums of layer {}", li), /*sticky=*/true);
  }
}

Status GradientReduction::reduction_issued(size_t li) {
  if (!ctx_.placement.early_updates) return Status::Ok();
  return updates_.early().queue(li, update_input(li));
}

void GradientReduction::sum_piece_blocks(size_t li, size_t block_offset, const std::byte* piece, size_t elements) {
  block_sums_of_squares(piece, ctx_.opt.grad_dtype, elements, kShardAlign,
                        std::span<double>(layers_[li].block_sums.data() + block_offset, elements / kShardAlign));
}

void GradientReduction::sum_blocks(size_t li, const std::byte* src, bool in_padded_layout) {
  const LayerPartition& p = ctx_.part.layer(li);
  size_t out = 0;
  for (const SubGroup& g : p.groups)
    for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
      const size_t at = in_padded_layout ? p.piece_begin(g, r) : g.shard_offset;
      sum_piece_blocks(li, out, src + at * ctx_.grad_bytes(), g.piece);
      out += g.piece / kShardAlign;
    }
}

Result<double> GradientReduction::global_norm_squared() {
  // Every layer's block sums, this rank's owned order, layer by layer.
  std::vector<double> mine;
  // Blocks: the norm (and with it the clip coefficient of every update)
  // needs the block sums of every layer.
  for (size_t li = 0; li < layers_.size(); ++li) {
    STRATA_RETURN_IF_ERROR(ctx_.wait_status(layers_[li].norm_partials_ready,
                                            fmt::format("reducing the gradients of layer {} on rank {}", li, ctx_.rank)));
    mine.insert(mine.end(), layers_[li].block_sums.begin(), layers_[li].block_sums.end());
  }
  double total = 0;
  if (ctx_.stage0()) {
    for (double v : mine) total += v;  // already in (layer, group, rank, block) order
    return total;
  }
  comm::Communicator& comm = ctx_.comm;
  const int world = ctx_.world;
  std::vector<double> all(mine.size() * world);
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, mine.data(), mine.size() * sizeof(double), all.data(), all.size() * sizeof(double),
      [&](const void* s, void* r) { return comm.all_gather(s, r, mine.size(), DType::kF64, comm::CommQueue::kReduce); },
      "gathering the gradient norm's block sums"));
  // all[r] holds rank r's blocks in (layer, group, block) order; add in
  // (layer, group, rank, block) order, as stage 0 does.
  size_t layer_base = 0;
  for (size_t li = 0; li < layers_.size(); ++li) {
    if (ctx_.where(li).frozen) continue;  // no gradient, no blocks
    const LayerPartition& layer_part = ctx_.part.layer(li);
    for (const SubGroup& g : layer_part.groups) {
      const size_t nb = g.piece / kShardAlign, gb = layer_base + g.shard_offset / kShardAlign;
      for (int r = 0; r < world; ++r)
        for (size_t j = 0; j < nb; ++j) total += all[static_cast<size_t>(r) * mine.size() + gb + j];
    }
    layer_base += layer_part.shard_elements / kShardAlign;
  }
  return total;
}

Status GradientReduction::wait_for_issued_reductions() {
  for (size_t li = 0; li < layers_.size(); ++li)
    if (layers_[li].reduce_launched)  // ok or failed: either way nothing reads the buffers any more
      STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(layers_[li].norm_partials_ready,
                                               fmt::format("abandon_step(): the reduction of layer {}", li)));
  return Status::Ok();
}

GradientReduction::UpdateInput GradientReduction::update_input(size_t li) const {
  const LayerGradients& l = layers_[li];
  UpdateInput in;
  in.on_nvme = ctx_.where(li).gradient_shard_on_nvme;
  in.grads = in.on_nvme              ? nullptr
             : ctx_.opt_on_host()    ? l.opt_grads_host.data()
             : ctx_.grads_in_place() ? l.full_grads.as<std::byte>()
                                     : l.opt_grads_dev.as<std::byte>();
  in.padded_layout = ctx_.grads_in_place() || ctx_.stage0();
  in.device_part_grads = l.opt_grads_dev.as<std::byte>();
  in.reduced = l.norm_partials_ready;
  return in;
}

}  // namespace strata::offload::engine_detail
