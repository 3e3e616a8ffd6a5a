// EarlyUpdates (early_updates.h; Note [Early, exact updates] in update_scheduler.h).
#include "early_updates.h"

#include <algorithm>

#include <fmt/format.h>

#include "step_nvme_bytes.h"
#include "update_scheduler.h"

namespace strata::offload::engine_detail {

OptimizerStateTier& EarlyUpdates::main_tier() { return updates_.state_->main(); }

void EarlyUpdates::open(int64_t step, double scale, const cpu_adam::HyperParams& hyper,
                                         StepNvmeBytes* previous_step_bytes) {
  previous_step_bytes_ = previous_step_bytes;
  args_ = cpu_adam::StepArgs{};
  args_.step = step;
  args_.hyper = hyper;
  args_.clip_coefficient = 1.0;  // clip_coefficient()'s value when the norm does not clip
  args_.loss_scale = scale;
  args_.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
  per_layer_.assign(updates_.layer_count(), EarlyUpdate{});
  spent_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  open_ = true;
  walk_set_this_step_ = false;
}

Status EarlyUpdates::queue(size_t li, const GradientReduction::UpdateInput& input) {
  if (!open_ || ctx_.where(li).frozen) return Status::Ok();
  if (!walk_set_this_step_ && main_tier().versioned()) {
    // Read ahead for the backward's walk from here, on the optimizer thread
    // (behind the updates queued before; a read-ahead dropped for the new
    // order is waited for there, not on this thread). Usually the tier
    // reads in this walk already (read_ahead_for_next_step): then only the
    // mark of the previous step's NVMe bytes is queued, when there is one.
    std::function<void()> mark_previous_step;
    if (previous_step_bytes_ != nullptr)
      mark_previous_step = [bytes = previous_step_bytes_, pending_step = args_.step - 1] {
        bytes->previous_updates_done(pending_step);
      };
    set_walk(early_walk(), Walk::kEarly, "read-ahead in the early updates' order", std::move(mark_previous_step));
    walk_set_this_step_ = true;
  }
  previous_step_bytes_ = nullptr;
  EarlyUpdate& e = per_layer_[li];
  e.claimed = std::make_shared<std::atomic<bool>>(false);
  e.jobs = updates_.jobs_of(li, input, args_.hyper, nullptr, /*early=*/true);
  e.queued = true;
  const Completion gate = params_.writable_after(li, input.reduced);
  // A stage-3 shard on NVMe (Note [Update staging]) is stepped into a slot
  // and written back at once, a shadow write the step's end waits for
  // (written()) and a skip rewrites (undo_every()).
  const bool in_slot = ctx_.where(li).staging == UpdateStaging::kParameterSlot;
  e.write_back = std::make_shared<Completion>();
  e.done = updates_.worker_->submit(
      [this, li, in_slot, jobs = e.jobs, args = args_, param_dtype = ctx_.where(li).param_dtype,
       claimed = e.claimed, spent = spent_ns_, write_back = e.write_back]() mutable {
        if (claimed->exchange(true)) return Status::Ok();  // the step's end claimed it back
        ctx_.faults.early_update_started(li);  // a test's observer
        // Out of place: a failure part-way changed no state (the step's end redoes the layer).
        return updates_.step_layer(li, jobs, args, param_dtype, in_slot, /*out_of_place=*/true, *spent, *write_back);
      },
      gate, fmt::format("early optimizer step of layer {}", li), /*sticky=*/false);
  return Status::Ok();
}

Status EarlyUpdates::close() {
  if (!open_) {
    // A step without early updates steps every layer in forward order.
    if (main_tier().versioned()) set_walk(forward_walk_, Walk::kForward, "read-ahead in the forward order");
    return Status::Ok();
  }
  open_ = false;
  for (size_t li = 0; li < per_layer_.size(); ++li) {
    EarlyUpdate& e = per_layer_[li];
    if (!e.queued) continue;
    if (ctx_.faults.run_every_early_update())
      STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(e.done, fmt::format("the early update of {}", ctx_.layer_label(li))));
    e.ran = e.claimed->exchange(true);  // false: claimed back before it started (a no-op when it runs)
    if (!e.ran) continue;
    STRATA_RETURN_IF_ERROR(ctx_.wait_bounded(e.done, fmt::format("the early update of {}", ctx_.layer_label(li))));
    // A stage-3 shard on NVMe: its write ends before anything else touches
    // the shard (a redo's write, a skip's rewrite, the next forward's read).
    if (e.write_back)
      STRATA_RETURN_IF_ERROR(
          ctx_.wait_bounded(*e.write_back, "the early update's write of the parameter shard of " + ctx_.layer_label(li)));
  }
  if (walk_set_this_step_) {
    // Note [Read-ahead at the step's end]: the layers whose early update
    // did not run are stepped next, in forward order; the kept ones are
    // opened next by the next step's early updates, in its walk (their
    // pieces are read ahead once kept, in the version kept).
    std::vector<StateId> walk;
    walk.reserve(forward_walk_.size());
    for (const StateId& id : forward_walk_)
      if (!per_layer_[id.layer].ran) walk.push_back(id);
    for (const StateId& id : early_walk())
      if (per_layer_[id.layer].ran) walk.push_back(id);
    set_walk(walk, Walk::kStepEnd, "read-ahead for the step's own updates");
  }
  return Status::Ok();
}

void EarlyUpdates::read_ahead_for_next_step(bool next_step_early) {
  if (!main_tier().versioned()) return;
  if (next_step_early) set_walk(early_walk(), Walk::kEarly, "read-ahead for the next step's early updates");
  else set_walk(forward_walk_, Walk::kForward, "read-ahead in the forward order");
}

void EarlyUpdates::read_ahead_for_first_step(bool first_step_early) {
  if (!main_tier().versioned() || !first_step_early) return;  // the tier reads in add() order: forward
  main_tier().set_order(early_walk());
  walk_ = Walk::kEarly;
}

const std::vector<StateId>& EarlyUpdates::early_walk() {
  if (early_walk_.empty()) {
    early_walk_ = forward_walk_;
    std::stable_sort(early_walk_.begin(), early_walk_.end(),
                     [](const StateId& a, const StateId& b) { return a.layer > b.layer; });
  }
  return early_walk_;
}

void EarlyUpdates::set_walk(const std::vector<StateId>& walk, Walk which, const char* label,
                               std::function<void()> then) {
  // The tasks run in the order queued, so walk_ is what the tier will read
  // in when this one runs: the same forward or early walk is not set again
  // (the step-end walk differs from step to step).
  const bool unchanged = which == walk_ && which != Walk::kStepEnd;
  walk_ = which;
  if (unchanged && !then) return;
  std::vector<StateId> order;
  if (!unchanged) order = walk;
  updates_.worker_->submit(
      [this, unchanged, order = std::move(order), then = std::move(then)] {
        if (!unchanged) main_tier().set_order(order);
        if (then) then();
        return Status::Ok();
      },
      {}, label, /*sticky=*/false);
}

bool EarlyUpdates::written(size_t li) {
  const EarlyUpdate& e = per_layer_[li];
  for (const PieceJob& j : e.jobs)
    if (j.count != 0 && !main_tier().pending_written(j.id).ok()) return false;
  // A parameter shard on NVMe: its shadow write ended (a failed one leaves
  // the previous shard; the redo writes it again).
  if (e.write_back && !ctx_.wait_status(*e.write_back, "the early update's write of " + ctx_.layer_label(li)).ok())
    return false;
  return true;
}

bool EarlyUpdates::matches(size_t li, int64_t step, double clip, double scale,
                                    const cpu_adam::HyperParams& hyper) const {
  const EarlyUpdate& e = per_layer_[li];
  const cpu_adam::StepArgs& a = args_;
  return e.ran && e.done.status().ok() && a.step == step && a.clip_coefficient == clip && a.loss_scale == scale &&
         a.hyper == hyper;
}

Result<UpdateScheduler::Queued> EarlyUpdates::keep(size_t li, const GradientReduction::UpdateInput& input) {
  UpdateScheduler::LayerUpdate& l = updates_.layers_[li];
  l.update_ran = per_layer_[li].done;  // ok: matches() checked it
  l.update_written = l.update_ran;
  // offload_optimizer.ratio < 1: the device part is not stepped early (its
  // parameters are the device's own); it is stepped now, with the arguments
  // the early update assumed (matches(): the step's own).
  Completion device_part_done;
  if (ctx_.split()) {
    std::vector<PieceJob> dev_jobs;
    updates_.jobs_of(li, input, args_.hyper, &dev_jobs, /*early=*/true);
    device_part_done = updates_.queue_device_part(li, std::move(dev_jobs), args_, ctx_.where(li).param_dtype,
                                         params_.writable_after(li, input.reduced));
    const Completion both[] = {l.update_ran, device_part_done};
    l.update_ran = when_all(both, fmt::format("optimizer step of layer {}", li));
    l.update_written = l.update_ran;
  }
  // Its pending buffers, every element written by the update, become the state.
  for (const PieceJob& j : per_layer_[li].jobs)
    if (j.count != 0) STRATA_RETURN_IF_ERROR(main_tier().keep_pending(j.id));
  // The staged values go to the device now that the step keeps them (the
  // device parameters were not touched under the backward), queued on the
  // optimizer thread behind the updates of the layers before this one
  // (Note [Kept values in forward order]).
  const size_t eb = ctx_.where(li).param_element_bytes;
  struct StagedCopy {
    std::byte* dst;
    const std::byte* src;
    size_t bytes;
  };
  std::vector<StagedCopy> copies;
  for (const PieceJob& j : per_layer_[li].jobs) {
    if (j.h2d_once_kept == nullptr || j.count == 0) continue;
    copies.push_back({j.h2d_once_kept, j.param, j.count * eb});
    ctx_.transfers.h2d_bytes += j.count * eb;
  }
  if (per_layer_[li].write_back) l.update_written = *per_layer_[li].write_back;  // ended ok: written()
  if (!copies.empty()) {
    l.update_written = updates_.worker_->submit(
        [this, li, copies = std::move(copies)] {
          Status queued;
          for (const StagedCopy& c : copies)
            if (queued.ok())
              queued = updates_.update_stream_->copy_async(c.dst, c.src, c.bytes, CopyKind::kHostToDevice);
          ctx_.faults.update_values_queued(li, /*kept=*/true);  // a test's observer
          // Blocks: this task's completion is the layer's update_written, so it
          // ends when the values are on the device (as PieceStepper waits for
          // its tiles); the engine's waits on it are bounded.
          const Status copied = updates_.update_stream_->synchronize();
          return queued.ok() ? copied : queued;
        },
        {}, fmt::format("copying the kept update of layer {} to the device", li), /*sticky=*/false);
    if (ctx_.split()) {
      const Completion both[] = {l.update_written, device_part_done};
      l.update_written = when_all(both, fmt::format("update of layer {}", li));
    }
  }
  return UpdateScheduler::Queued{l.update_ran,
                                 ctx_.failures.absorb(l.update_written, fmt::format("update of layer {}", li))};
}

Result<int64_t> EarlyUpdates::undo_every() {
  int64_t restored = 0;
  for (size_t li = 0; li < per_layer_.size(); ++li) {
    EarlyUpdate& e = per_layer_[li];
    if (!e.ran) continue;
    e.ran = false;
    for (const PieceJob& j : e.jobs)
      if (j.count != 0) STRATA_RETURN_IF_ERROR(main_tier().drop_pending(j.id));
    // The state is untouched (out of place); the 16-bit values the update
    // wrote (staging, or a stage-3 shard in host memory) are rewritten.
    const std::string what = "rewriting the parameters of " + ctx_.layer_label(li) + " from its state";
    STRATA_RETURN_IF_ERROR(rewrite_params(li, e.jobs).with_context(what));
    ++restored;
  }
  return restored;
}

Status EarlyUpdates::rewrite_params(size_t li, const std::vector<PieceJob>& jobs) {
  const DType param_dtype = ctx_.where(li).param_dtype;
  const size_t eb = dtype_size(param_dtype);
  // A stage-3 shard on NVMe: rewritten whole through a slot, as an update writes it.
  const bool in_slot = ctx_.where(li).staging == UpdateStaging::kParameterSlot;
  Slot slot;
  if (in_slot) {
    STRATA_ASSIGN_OR_RETURN(slot, params_.update_slot(li));
  }
  for (const PieceJob& j : jobs) {
    if (j.count == 0) continue;
    std::byte* const param = in_slot ? slot.as<std::byte>() + j.slot_offset : j.param;
    STRATA_ASSIGN_OR_RETURN(PieceState st, main_tier().open(j.id));
    // As PieceStepper writes them: 16-bit values into the staging, the host
    // shard or the slot, fp32 ones copied from the master; then to the device.
    if (!j.param_is_master && (param_dtype != DType::kF32 || j.h2d == nullptr))
      master_to_params(param_dtype, st.master, param, j.count);
    Status copied = Status::Ok();
    if (j.h2d != nullptr) {
      const std::byte* src = !j.param_is_master && param_dtype == DType::kF32
                                 ? reinterpret_cast<const std::byte*>(st.master)
                                 : j.param;
      copied = ctx_.device.copy(j.h2d, src, j.count * eb, CopyKind::kHostToDevice);
    }
    const Status closed = main_tier().close(j.id, false);
    STRATA_RETURN_IF_ERROR(copied);
    STRATA_RETURN_IF_ERROR(closed);
  }
  if (!in_slot) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(const Completion written, params_.write_back(li, std::move(slot)));
  return ctx_.wait_status(written, "rewriting the parameter shard of " + ctx_.layer_label(li));
}

}  // namespace strata::offload::engine_detail
