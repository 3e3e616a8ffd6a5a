// The ZeRO engine's provider hooks (Note [Acquire and release] in
// strata/core/layered_model.h): acquire and release of a layer, stage-3
// gathers, prefetch and drops, and the gradient reduction each layer's last
// backward release starts.
#include "engine_impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::offload {

// ---------------------------------------------------------------- provider hooks

Result<LayerMemory> Engine::Impl::acquire(size_t li, Pass pass) {
  if (li >= layers.size())
    return InvalidArgument(fmt::format("acquire of layer {}: the model has {} layers", li, layers.size()));
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  const bool training = phase == Phase::kMicroBatch;
  if (pass != Pass::kEval && !training)
    return FailedPrecondition(fmt::format(
        "acquire of layer {} '{}' for {} {} on rank {}: training passes run inside a micro-batch (begin_step(), "
        "begin_micro_batch(); Note [Driving the engine]); a pass outside one is an evaluation (Pass::kEval)",
        li, printable(layer_part.name, 64), pass_name(pass), phase_name(phase), rank));
  if (training) trace->on_acquire(li, pass);
  if (training && pass == Pass::kBackward && !progress.in_backward) {
    // StepMetrics: the micro-batch's forward ends here, its backward begins.
    progress.backward_started = Clock::now();
    progress.forward_ms += std::chrono::duration<double, std::milli>(progress.backward_started - progress.micro_started).count();
    progress.in_backward = true;
  }
  if (pass == Pass::kBackward && l.reduce_launched)
    return FailedPrecondition(fmt::format(
        "layer {} '{}' was acquired for backward after its gradient was complete by the recorded acquire sequence "
        "and its reduction had started: this micro-batch followed the recording up to the layer's last recorded "
        "backward, then acquired it again (Note [Acquire order]); a model that revisits a layer in backward must "
        "do it in every step, or acquire it in forward as often",
        li, printable(layer_part.name, 64)));
  LayerMemory mem;
  std::vector<Completion> waits;
  Completion update_ready;
  if (l.persistent) {
    mem.params = l.full_params.as<std::byte>();
    update_ready = l.params_ready;
    waits.push_back(l.params_ready);
  } else if (aliased(l)) {
    mem.params = l.dev_shard.as<std::byte>();
    update_ready = l.shard_ready;
    waits.push_back(l.shard_ready);
  } else {
    if (!l.prefetch_failure.ok()) {
      Status failed = std::move(l.prefetch_failure);
      l.prefetch_failure = Status::Ok();
      return failed.with_context(fmt::format("acquire of layer {} '{}' for {} on rank {}", li,
                                             printable(layer_part.name, 64), pass_name(pass), rank));
    }
    if (!l.gathered_valid) {
      // On demand: wait for frees in flight when the live cap would be passed.
      STRATA_RETURN_IF_ERROR(make_room_for_gather(li).with_context("freeing gathered parameters"));
      STRATA_RETURN_IF_ERROR(issue_gather(li));
    }
    update_ready = l.shard_ready;
    mem.params = l.gathered.as<std::byte>();
    waits.push_back(l.gathered_ready);
    if (training && trace->following()) prefetch_after(trace->position());
  }
  ++l.held;
  mem.params_tier = Tier::kDevice;
  if (pass == Pass::kBackward && !l.frozen) {
    if (!l.full_grads) {
      // Gradients waiting for their reduction are capped by reduce_bucket_size
      // (stages 2, 3): wait for earlier layers' reductions to free theirs.
      STRATA_RETURN_IF_ERROR(live_grads->make_room(layer_part.padded_elements, static_cast<uint64_t>(opt.reduce_bucket_size))
                                 .with_context("freeing reduced gradients"));
      live_grads->hold(layer_part.padded_elements);
      STRATA_ASSIGN_OR_RETURN(l.full_grads, alloc_device(layer_part.padded_elements * grad_bytes(),
                                                         fmt::format("gradients of layer {} '{}'", li,
                                                                     printable(layer_part.name, 64))));
      // Zeroed in the copy stream's order; the model waits for it (below).
      STRATA_RETURN_IF_ERROR(xfer->memset_async(l.full_grads.data(), 0, layer_part.padded_elements * grad_bytes()));
      l.grads_zeroed = xfer->record_completion();
      l.zeroed_step = steps_begun;
    } else if (l.zeroed_step != steps_begun) {
      // Persistent gradients: zero once per step, after the last step's readers.
      STRATA_RETURN_IF_ERROR(xfer->wait(l.full_gradient_read));
      STRATA_RETURN_IF_ERROR(xfer->memset_async(l.full_grads.data(), 0, layer_part.padded_elements * grad_bytes()));
      l.grads_zeroed = xfer->record_completion();
      l.zeroed_step = steps_begun;
    }
    waits.push_back(l.grads_zeroed);
    mem.grads = l.full_grads.data();
    mem.grad_dtype = opt.grad_dtype;
    mem.grads_tier = Tier::kDevice;
  }
  const Completion params_ready = waits.front();
  mem.ready = waits.size() == 1 ? waits.front() : when_all(waits, fmt::format("layer {} ready", li));
  // Exposed-wait probe of a training pass: when the model's stream reaches
  // this layer, and when its parameters are ready (their update, then their
  // gather; a backward's zeroed gradient buffer is not a parameter wait).
  if (training && !params_ready.done() && model_stream != nullptr) {
    auto probe = std::make_shared<WaitProbe>();
    probe->backward = progress.in_backward;
    STRATA_RETURN_IF_ERROR(model_stream->launch_host([probe] { probe->reached_ns.store(now_ns()); }));
    update_ready.then([probe](const Status&) { probe->update_ns.store(now_ns()); });
    params_ready.then([probe](const Status&) { probe->ready_ns.store(now_ns()); });
    probes.push_back(std::move(probe));
  }
  return mem;
}

Status Engine::Impl::issue_gather(size_t li, bool* allocated) {
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  if (allocated != nullptr) *allocated = false;
  STRATA_ASSIGN_OR_RETURN(l.gathered, alloc_device(layer_part.padded_elements * l.element_bytes,
                                                   fmt::format("gathered parameters of layer {} '{}'", li,
                                                               printable(layer_part.name, 64))));
  live_params->hold(layer_part.padded_elements);
  if (allocated != nullptr) *allocated = true;
  // What was queued against the buffer: on failure it is handed back (and
  // uncounted) once all of it completed, never while a copy may still write it.
  std::vector<Completion> queued;
  Status st = queue_gather(li, queued);
  if (st.ok()) return st;
  live_params->give_back(std::move(l.gathered), when_all(queued, fmt::format("failed gather of layer {}", li)),
             layer_part.padded_elements);
  return st.with_context(fmt::format("gathering the parameters of layer {} '{}'", li, printable(layer_part.name, 64)));
}

Status Engine::Impl::queue_gather(size_t li, std::vector<Completion>& queued) {
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  std::byte* full = l.gathered.as<std::byte>();
  if (l.on_nvme) {
    // NVMe: the shard's last write-back must be durable before it is read
    // (a shadow write flips the index only then). The shard reader waits for
    // it, reads the shard into a slot and copies its pieces into place; this
    // (driving) thread only queues the gather behind that, so neither a
    // prefetch nor an acquire blocks here on a later layer's update.
    const std::string name = fmt::format("parameter shard of layer {} '{}'", li, printable(layer_part.name, 64));
    const uint64_t bytes = layer_part.shard_elements * l.element_bytes;
    const Completion copied = shard_reader->submit(
        [this, li, full, name, bytes]() -> Status {
          const LayerPartition& p = part.layer(li);
          const size_t element_bytes = layers[li].element_bytes;
          STRATA_ASSIGN_OR_RETURN(ParamSwap::Read rd, param_swap->read(static_cast<uint32_t>(li), bytes, name));
          // A failed read does not fail the gather: the layer is gathered
          // from whatever the slot holds and the failure drops the step at
          // the commit point's vote on every rank (Note [Atomic steps]).
          // The shard reader's own thread waits for the read it issued (the
          // driving thread only waits for the gather queued behind it).
          // Bounded (Note [Bounded waits]): a read that does not end drops the
          // step like a failed one; its slot goes back only once it ended.
          const bool ended = rd.done.wait_for(wait_bound());
          const Status read = ended ? rd.done.status()
                                    : DeadlineExceeded(fmt::format("'{}' did not complete in {} s (strata.wait_timeout_s; "
                                                                   "raise it if the drive is only slow)",
                                                                   rd.done.label(), opt.wait_timeout_s));
          if (!read.ok()) record_failure(FailureOf::kCall, read.with_context("reading the " + name));
          Status copy;
          const std::byte* shard = rd.slot.as<std::byte>();
          for (const SubGroup& g : p.groups)
            if (copy.ok() && ended)
              copy = device.copy(full + p.piece_begin(g, rank) * element_bytes, shard + g.shard_offset * element_bytes, g.piece * element_bytes,
                                 CopyKind::kHostToDevice);
          rd.slot.release_after(ended ? Completion() : rd.done);  // the copies above are done
          return copy.with_context("copying the " + name + " to the device");
        },
        l.shard_ready, fmt::format("reading the {}", name), /*sticky=*/false);
    queued.push_back(copied);
    h2d_bytes += bytes;
    STRATA_RETURN_IF_ERROR(comm.wait(copied, comm::CommQueue::kGather));
  } else if (param_on_host()) {
    // H2D of this rank's pieces into their place, then gather in place.
    STRATA_RETURN_IF_ERROR(xfer->wait(l.shard_ready));
    Status copies;
    for (const SubGroup& g : layer_part.groups)
      if (copies.ok())
        copies = xfer->copy_async(full + layer_part.piece_begin(g, rank) * l.element_bytes, l.host_shard.data() + g.shard_offset * l.element_bytes,
                                  g.piece * l.element_bytes, CopyKind::kHostToDevice);
    const Completion h2d = xfer->record_completion();  // after the copies queued
    queued.push_back(h2d);
    STRATA_RETURN_IF_ERROR(copies);
    h2d_bytes += layer_part.shard_elements * l.element_bytes;
    STRATA_RETURN_IF_ERROR(comm.wait(h2d, comm::CommQueue::kGather));
  } else {
    STRATA_RETURN_IF_ERROR(comm.wait(l.shard_ready, comm::CommQueue::kGather));
  }
  if (faults.gather && faults.gather->step == steps_begun && faults.gather->rank == rank &&
      faults.gather->layer == li && !fault_gather_fired) {
    fault_gather_fired = true;
    return Internal("injected gather failure (testing::GatherFault)");
  }
  Completion last;
  for (const SubGroup& g : layer_part.groups) {
    const std::byte* send = param_on_host() ? full + layer_part.piece_begin(g, rank) * l.element_bytes
                                            : l.dev_shard.as<std::byte>() + g.shard_offset * l.element_bytes;
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(send, full + g.padded_begin * l.element_bytes, g.piece, l.param_dtype,
                                                              comm::CommQueue::kGather));
    last = w.completion();
    queued.push_back(last);
  }
  gather_bytes += layer_part.padded_elements * l.element_bytes;
  l.gathered_ready = last;
  l.gathered_valid = true;
  return Status::Ok();
}

// stage3_max_live_parameters for an on-demand gather of layer `li`: wait
// for frees in flight, then drop kept (gathered, not held) layers, oldest
// index first, until the gather fits or nothing else can go.
Status Engine::Impl::make_room_for_gather(size_t li) {
  const uint64_t more = part.layer(li).padded_elements, cap = static_cast<uint64_t>(opt.max_live_parameters);
  STRATA_RETURN_IF_ERROR(live_params->make_room(more, cap));
  for (size_t j = 0; j < layers.size() && live_params->live() + more > cap; ++j) {
    Layer& k = layers[j];
    if (j == li || k.persistent || !k.gathered_valid || k.held > 0) continue;
    STRATA_RETURN_IF_ERROR(drop_gathered(j, k.last_use));
    STRATA_RETURN_IF_ERROR(live_params->make_room(more, cap));
  }
  return Status::Ok();
}

void Engine::Impl::prefetch_after(size_t position) {
  uint64_t issued = 0;
  const std::vector<AcquireTrace::Entry>& sequence = trace->sequence();
  for (size_t p = position + 1; p < sequence.size(); ++p) {
    const size_t lj = sequence[p].first;
    Layer& l = layers[lj];
    if (l.persistent || aliased(l) || l.gathered_valid) continue;
    const uint64_t n = part.layer(lj).padded_elements;
    if (issued + n > static_cast<uint64_t>(opt.prefetch_bucket_size)) break;
    // Gathers are collectives: how far a prefetch goes must be the same on
    // every rank, so it is decided on what is held (the same everywhere),
    // never on which frees happen to have completed; the frees in flight
    // are then waited for, as an on-demand gather would.
    const uint64_t cap = static_cast<uint64_t>(opt.max_live_parameters);
    if (live_params->held() + n > cap) break;
    if (!live_params->make_room(n, cap).ok()) break;
    bool allocated = false;
    if (Status st = issue_gather(lj, &allocated); !st.ok()) {
      // Out of memory for the buffer (nothing queued or counted): it is
      // gathered on demand, and the error said then if it persists. A
      // failure after that (the buffer went back once its queued work
      // completed) is the layer's acquire's error.
      if (allocated) l.prefetch_failure = st.with_context("prefetching");
      break;
    }
    issued += n;
  }
}

Status Engine::Impl::drop_gathered(size_t li, const Completion& done) {
  Layer& l = layers[li];
  if (!l.gathered_valid) return Status::Ok();
  // Its users: the gather that filled it (and the H2D before), the model's last pass over it.
  const Completion users[] = {l.gathered_ready, done};
  live_params->give_back(std::move(l.gathered), when_all(users), part.layer(li).padded_elements);
  l.gathered_valid = false;
  return Status::Ok();
}

Status Engine::Impl::release(size_t li, Pass pass, const Completion& done) {
  if (li >= layers.size() || layers[li].held <= 0)
    return FailedPrecondition(fmt::format("release of layer {} that is not held", li));
  Layer& l = layers[li];
  --l.held;
  if (!l.persistent) {
    l.last_use = done;
    if (l.held == 0) {
      // Keep it when its next use in this micro-batch's sequence is near.
      // While the first micro-batch is recorded the next use is unknown: keep
      // the layer when the window spans a whole micro-batch anyway.
      // Evaluation passes reuse the same parameters: keep them until
      // evaluate() ends.
      const bool training = phase == Phase::kMicroBatch;
      bool keep = (training && trace->recording() && window_spans_micro_batch) || phase == Phase::kEvaluation;
      if (training && trace->following()) {
        // The next use in this micro-batch's sequence, or, when another
        // micro-batch of this step follows, in its sequence (cyclically).
        const std::vector<AcquireTrace::Entry>& trace_seq = trace->sequence();
        const size_t here = trace->position(), n = trace_seq.size();
        const size_t span = progress.last_micro ? n - here - 1 : n - 1;
        uint64_t distance = 0;
        for (size_t k = 1; k <= span; ++k) {
          const size_t p = (here + k) % n;
          if (trace_seq[p].first == li) {
            // Soon reused, or within the prefetch window (a prefetch would
            // gather it again at once): dropping it would only cost a gather.
            keep = distance <= static_cast<uint64_t>(std::max(opt.max_reuse_distance, opt.prefetch_bucket_size));
            break;
          }
          distance += part.layer(trace_seq[p].first).elements;
        }
      }
      if (!keep) STRATA_RETURN_IF_ERROR(drop_gathered(li, done));
    }
  }
  if (pass == Pass::kBackward) {
    l.last_backward_released = done;
    ++l.bwd_releases;
    // A layer's gradient is complete at its last backward release: as many
    // as the recorded sequence has, or, while a micro-batch is being
    // recorded, as many as its forward acquires (a backward mirrors its
    // forward); once a micro-batch departs from the recording, when it ends
    // (Note [Acquire order]). Reductions go out in canonical order.
    const std::optional<int> expected = trace->backward_releases_expected(li);
    if (!l.frozen && phase == Phase::kMicroBatch && progress.last_micro && expected && l.bwd_releases == *expected &&
        !l.reduce_launched)
      STRATA_RETURN_IF_ERROR(gradient_completed(li));
  }
  return Status::Ok();
}

// Sums the layer's gradient over ranks (reduce-scatter in rank order; stage
// 0 gathers the reduced pieces back), moves the owned pieces to where the
// optimizer reads them, and queues their block sums.
Status Engine::Impl::launch_reduction(size_t li) {
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  if (l.frozen) return Status::Ok();  // no gradient (a frozen layer is acquired for backward all the same)
  l.reduce_launched = true;
  if (l.zeroed_step != steps_begun) {
    // No backward touched the layer this step: its gradient is zero (a
    // persistent buffer still holds the last step's, once its readers are done).
    if (!l.full_grads) {
      live_grads->hold(layer_part.padded_elements);
      STRATA_ASSIGN_OR_RETURN(l.full_grads,
                              alloc_device(layer_part.padded_elements * grad_bytes(), fmt::format("gradients of layer {}", li)));
    } else {
      STRATA_RETURN_IF_ERROR(xfer->wait(l.full_gradient_read));
    }
    STRATA_RETURN_IF_ERROR(xfer->memset_async(l.full_grads.data(), 0, layer_part.padded_elements * grad_bytes()));
    l.grads_zeroed = xfer->record_completion();
    l.zeroed_step = steps_begun;
    l.last_backward_released = l.grads_zeroed;
  }
  std::byte* full = l.full_grads.as<std::byte>();
  const size_t e = grad_bytes();
  Completion local = l.last_backward_released;
  if (faults.gradient && faults.gradient->step == steps_begun && faults.gradient->rank == rank &&
      faults.gradient->layer == li) {
    const float v = faults.gradient->value;
    if (opt.grad_dtype == DType::kF32) std::memcpy(fault_bytes.data(), &v, 4);
    if (opt.grad_dtype == DType::kBF16) convert_fp32_to_bf16(&v, reinterpret_cast<bfloat16*>(fault_bytes.data()), 1);
    if (opt.grad_dtype == DType::kF16) convert_fp32_to_fp16(&v, reinterpret_cast<float16*>(fault_bytes.data()), 1);
    STRATA_RETURN_IF_ERROR(xfer->wait(l.last_backward_released));
    STRATA_RETURN_IF_ERROR(xfer->copy_async(full, fault_bytes.data(), e, CopyKind::kHostToDevice));
    local = xfer->record_completion();
  }
  STRATA_RETURN_IF_ERROR(comm.wait(local, comm::CommQueue::kReduce));
  Completion reduced;
  for (const SubGroup& g : layer_part.groups) {
    std::byte* send = full + g.padded_begin * e;
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.reduce_scatter(send, send + g.piece * rank * e, g.piece,
                                                                  opt.grad_dtype, comm::ReduceOp::kSum,
                                                                  comm::CommQueue::kReduce));
    reduced = w.completion();
  }
  reduce_bytes += layer_part.padded_elements * e;
  if (stage0()) {
    for (const SubGroup& g : layer_part.groups) {
      STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(full + layer_part.piece_begin(g, rank) * e,
                                                                full + g.padded_begin * e, g.piece, opt.grad_dtype,
                                                                comm::CommQueue::kReduce));
      reduced = w.completion();
    }
    reduce_bytes += layer_part.padded_elements * e;
  }
  // Where the optimizer reads the owned pieces.
  std::byte* dst = nullptr;
  CopyKind kind = CopyKind::kDeviceToDevice;
  if (opt_on_host()) {
    dst = l.opt_grads_host.data();
    kind = CopyKind::kDeviceToHost;
  } else if (!grads_in_place()) {
    dst = l.opt_grads_dev.as<std::byte>();
  }
  if (dst == nullptr) {
    l.reduced_gradient_moved = reduced;
  } else if (split()) {
    // ratio < 1: the whole piece stays on the device (the device part steps
    // from there, the block sums read it), only the host part goes D2H.
    STRATA_RETURN_IF_ERROR(xfer->wait(reduced));
    std::byte* dev = l.opt_grads_dev.as<std::byte>();
    for (const SubGroup& g : layer_part.groups) {
      const std::byte* piece = full + layer_part.piece_begin(g, rank) * e;
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dev + g.shard_offset * e, piece, g.piece * e, CopyKind::kDeviceToDevice));
      const size_t host = host_n(layer_part.piece_real(g, rank));
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dst + g.shard_offset * e, piece, host * e, CopyKind::kDeviceToHost));
      d2h_bytes += host * e;
    }
    dst = dev;  // where the block sums read
  } else {
    STRATA_RETURN_IF_ERROR(xfer->wait(reduced));
    if (stage0()) {
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dst, full, layer_part.padded_elements * e, kind));
    } else {
      for (const SubGroup& g : layer_part.groups)
        STRATA_RETURN_IF_ERROR(
            xfer->copy_async(dst + g.shard_offset * e, full + layer_part.piece_begin(g, rank) * e, g.piece * e, kind));
    }
    if (kind == CopyKind::kDeviceToHost) d2h_bytes += owned_elements(layer_part) * e;
  }
  // device_opt(): the block sums are computed on the host, from a copy.
  const std::byte* sums_src = dst;
  if (device_opt()) {
    const std::byte* from = dst != nullptr ? dst : full;
    const size_t n = dst != nullptr ? owned_elements(layer_part) : layer_part.padded_elements;
    if (dst == nullptr) STRATA_RETURN_IF_ERROR(xfer->wait(reduced));
    STRATA_RETURN_IF_ERROR(xfer->copy_async(l.norm_grads.data(), from, n * e, CopyKind::kDeviceToHost));
    d2h_bytes += n * e;
    sums_src = l.norm_grads.data();
    if (dst == nullptr) l.reduced_gradient_moved = xfer->record_completion();
  }
  if (dst != nullptr) {
    l.reduced_gradient_moved = xfer->record_completion();
    if (opt.stage >= 2) {
      // Its users: the model's backward, the reduction in place, the copy out.
      const Completion users[] = {l.last_backward_released, reduced, l.reduced_gradient_moved};
      live_grads->give_back(std::move(l.full_grads), when_all(users), layer_part.padded_elements);
    }
  }
  // Block sums of the owned pieces (padding blocks sum to zero).
  const std::byte* src = sums_src != nullptr ? sums_src : full;
  const bool in_padded_layout = dst == nullptr || stage0();
  l.norm_partials_ready = worker->submit(
      [this, li, src, in_padded_layout] {
        Layer& lay = layers[li];
        const LayerPartition& p = part.layer(li);
        size_t out = 0;
        for (const SubGroup& g : p.groups)
          for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
            const size_t at = in_padded_layout ? p.piece_begin(g, r) : g.shard_offset;
            block_sums_of_squares(src + at * grad_bytes(), opt.grad_dtype, g.piece, kShardAlign,
                                  std::span<double>(lay.block_sums.data() + out, g.piece / kShardAlign));
            out += g.piece / kShardAlign;
          }
        return Status::Ok();
      },
      l.reduced_gradient_moved, fmt::format("gradient block sums of layer {}", li));
  l.full_gradient_read = l.norm_partials_ready;
  return Status::Ok();
}

}  // namespace strata::offload
