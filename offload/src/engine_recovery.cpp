// Step atomicity (Note [Atomic steps] in engine.h): the commit point's vote,
// the rollback of a failed step and the parameters re-derived from the
// committed master weights.
#include "engine_impl.h"

#include <cstdio>

#include <fmt/format.h>

namespace strata::offload {

Engine::Impl::Mark Engine::Impl::mark() const {
  Mark m;
  m.optimizer_steps = optimizer_steps;
  m.steps_begun = steps_begun;
  m.scaler = scaler->state();
  if (runner != nullptr) m.data = runner->data_position();
  return m;
}

Status Engine::Impl::restore(const Mark& m) {
  STRATA_RETURN_IF_ERROR(scaler->restore(m.scaler));
  // A caller that drives the engine feeds the batches again itself (the
  // outcome says from which step); a runner is moved back.
  if (runner != nullptr) {
    if (!m.data.has_value())
      return Unsupported("the model runner cannot tell where its training data stands (ModelRunner::data_position), "
                         "so the step cannot be repeated on the same batches; implement data_position and seek_data "
                         "or drive the engine with begin_step/finish_step");
    STRATA_RETURN_IF_ERROR(runner->seek_data(*m.data).with_context("moving the training data back to the step's start"));
  }
  optimizer_steps = m.optimizer_steps;
  steps_begun = m.steps_begun;
  // Gradients are zeroed once per step() call, by call number: the calls
  // being repeated must zero them again.
  for (Layer& l : layers) l.zeroed_step = -1;
  return Status::Ok();
}

void Engine::Impl::record_failure(FailureOf of, const Status& s) {
  std::lock_guard<std::mutex> lock(failure_mu);
  Status& slot = of == FailureOf::kUpdate ? update_failure : of == FailureOf::kCall ? call_failure : torn_failure;
  if (slot.ok()) slot = s;
}

Status Engine::Impl::take_failure(FailureOf of) {
  std::lock_guard<std::mutex> lock(failure_mu);
  Status& slot = of == FailureOf::kUpdate ? update_failure : of == FailureOf::kCall ? call_failure : torn_failure;
  Status s = std::move(slot);
  slot = Status::Ok();
  return s;
}

Completion Engine::Impl::absorb(const Completion& c, const std::string& label, FailureOf of) {
  auto out = std::make_shared<CompletionSource>(label);
  Completion result = out->completion();
  c.then([this, out, of, label](const Status& st) {
    // A read's error names the file and offset; the label names the layer.
    if (!st.ok()) record_failure(of, of == FailureOf::kCall ? st.with_context(label) : st);
    out->complete(Status::Ok());
  });
  return result;
}

Status Engine::Impl::settle(const Mark* call, double* loss) {
  // In step() every rank votes at the same point; outside it, only when a
  // step is pending (the same on every rank: an fp16 skip is agreed).
  if (!pending && call == nullptr) return Status::Ok();
  Status update, read, torn;
  if (pending) {
    // Every update of the pending step has run (the forward waited for each
    // layer; outside step() this waits), and its write-backs are durable.
    for (size_t li = 0; li < layers.size(); ++li) {
      Layer& l = layers[li];
      const std::string what = fmt::format("the commit point of step {}: the update of layer {} '{}'",
                                           pending_mark.optimizer_steps + 1, li, printable(part.layer(li).name, 64));
      // Its failure is in update_failure.
      STRATA_RETURN_IF_ERROR(wait_bounded(l.update_written, what));
      STRATA_RETURN_IF_ERROR(wait_bounded(l.persistent ? l.params_ready : l.shard_ready, what));
    }
    update = take_failure(FailureOf::kUpdate);
    torn = take_failure(FailureOf::kTorn);
    if (update.ok() && !pending_complete)
      update = Internal(fmt::format("step {}: not every layer's update was queued", pending_mark.optimizer_steps + 1));
    if (update.ok()) update = tier->flush();
    // A write-back whose failure went to a checkpoint snapshot's read.
    if (update.ok()) update = tier->committable();
    if (update.ok() && dev_tier) update = dev_tier->flush();
  }
  if (call != nullptr) read = take_failure(FailureOf::kCall);

  // The vote: which ranks' updates, and which ranks' parameter reads, failed.
  // An update torn part-way (2 in the vote) is a failed update no rank can undo.
  std::vector<int> failed_update, failed_read, torn_update;
  if (world == 1) {
    if (!update.ok() || !torn.ok()) failed_update.push_back(0);
    if (!torn.ok()) torn_update.push_back(0);
    if (!read.ok()) failed_read.push_back(0);
  } else {
    // One row per rank: {its loss (step() only), update failed (2: torn), read failed}.
    const double row[3] = {loss != nullptr ? *loss : 0.0, !torn.ok() ? 2.0 : update.ok() ? 0.0 : 1.0,
                           read.ok() ? 0.0 : 1.0};
    std::vector<double> all(3 * static_cast<size_t>(world));
    STRATA_RETURN_IF_ERROR(comm::host_collective(
        comm, row, sizeof(row), all.data(), all.size() * sizeof(double),
        [&](const void* s, void* r) { return comm.all_gather(s, r, 3, DType::kF64, comm::CommQueue::kReduce); },
        "summing the loss over ranks and agreeing on the step's updates"));
    double total = 0;
    for (int r = 0; r < world; ++r) {
      const double* theirs = all.data() + 3 * static_cast<size_t>(r);
      total += theirs[0];
      if (theirs[1] != 0.0) failed_update.push_back(r);
      if (theirs[1] == 2.0) torn_update.push_back(r);
      if (theirs[2] != 0.0) failed_read.push_back(r);
    }
    if (loss != nullptr) *loss = total;
  }
  auto rank_list = [](const std::vector<int>& ranks) {
    std::string text;
    for (int r : ranks) text += fmt::format("{}{}", text.empty() ? "" : ", ", r);
    return text;
  };
  const int64_t t = pending_mark.optimizer_steps + 1;
  const bool was_pending = pending;
  pending = false;

  if (failed_update.empty()) {
    if (was_pending) {
      STRATA_RETURN_IF_ERROR(tier->commit().with_context(fmt::format("committing step {}", t)));
      if (dev_tier) STRATA_RETURN_IF_ERROR(dev_tier->commit().with_context(fmt::format("committing step {}", t)));
    }
    if (failed_read.empty()) return Status::Ok();
    // A parameter read of this call failed: nothing was updated from it; the
    // call is dropped on every rank.
    const std::string cause = read.ok() ? fmt::format("failed on rank {}", rank_list(failed_read))
                                        : fmt::format("failed on rank {} (here: {})", rank_list(failed_read),
                                                      read.message());
    STRATA_RETURN_IF_ERROR(restore(*call));
    recovered = true;
    recovery = StepOutcomeKind::kDropped;
    return Status(read.ok() ? StatusCode::kUnavailable : read.code(),
                  fmt::format("step {}: reading the parameters {}; the step was dropped on every rank (the state is "
                              "the one after step {}); the next step() repeats it",
                              optimizer_steps + 1, cause, optimizer_steps));
  }

  // An update of state kept in place (pinned host or device memory) that
  // failed part-way left pieces of step t beside pieces of step t-1, and no
  // copy of t-1 exists: neither committing nor rolling back is exact. Every
  // rank stops (not `recovered`: stop_unless_recovered), committing nothing.
  if (!torn_update.empty())
    return Status(torn.ok() ? StatusCode::kDataLoss : torn.code(),
                  fmt::format("step {}: the update failed part-way on rank {}{}; that optimizer state is updated in "
                              "place (offload_optimizer {}) with no copy of step {}, so the step can neither be "
                              "committed nor rolled back",
                              t, rank_list(torn_update), torn.ok() ? "" : " (here: " + torn.message() + ")",
                              offload_device_name(opt.offload_optimizer), t - 1));
  // Every rank gets here with the same lists: roll back together (the
  // re-derivation's gathers are collectives every rank issues).
  const std::string cause = update.ok() ? fmt::format("failed on rank {}", rank_list(failed_update))
                                        : fmt::format("failed on rank {} (here: {})", rank_list(failed_update),
                                                      update.message());
  const bool versioned = tier->versioned();
  Status undone = versioned ? tier->rollback() : tier->commit();
  if (undone.ok() && dev_tier) undone = dev_tier->commit();
  if (undone.ok()) undone = rederive_params();
  // A versioned tier is back at step t-1: the counters go back there. The
  // memory tiers hold step t (their update runs in place and only a
  // parameter copy failed): the step() call in progress is dropped.
  if (undone.ok()) {
    if (versioned) undone = restore(pending_mark);
    else if (call != nullptr) undone = restore(*call);
  }
  const StatusCode code = update.ok() ? StatusCode::kUnavailable : update.code();
  if (!undone.ok())
    return Status(code, fmt::format("step {}: the update {}; rolling back failed too: {}", t, cause, undone.message()));
  recovered = true;
  recovery = versioned ? StepOutcomeKind::kRolledBack : StepOutcomeKind::kDropped;
  if (versioned)
    return Status(code, fmt::format("step {}: the update {}; every rank rolled back to the state after step {} "
                                    "(optimizer state, parameters, loss scale and data position); the next step() "
                                    "repeats step {}",
                                    t, cause, t - 1, t));
  return Status(code, fmt::format("step {}: the update {}; the optimizer state holds step {} and every rank "
                                  "re-derived its parameters from it{}",
                                  t, cause, t,
                                  call != nullptr ? "; the step in progress was dropped and the next step() repeats it"
                                                  : ""));
}

Status Engine::Impl::rederive_params() {
  std::vector<float> master;
  std::vector<std::byte> values;
  for (size_t li = 0; li < layers.size(); ++li) {
    Layer& l = layers[li];
    const LayerPartition& layer_part = part.layer(li);
    const std::string lname = fmt::format("layer {} '{}'", li, printable(layer_part.name, 64));
    if (l.frozen) continue;  // never stepped: its parameters are as they were
    if (l.persistent) {
      // The owned pieces into the full parameters, then (stages 1-3) every
      // rank's pieces gathered, as the update does.
      for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
        const SubGroup& g = layer_part.groups[gi];
        for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
          const size_t n = layer_part.piece_real(g, r);
          if (n == 0) continue;
          master.resize(n);
          values.resize(n * l.element_bytes);
          STRATA_RETURN_IF_ERROR(read_piece_state(li, gi, r, master.data(), nullptr, nullptr)
                                     .with_context("re-deriving the parameters of " + lname));
          master_to_params(l.param_dtype, master.data(), values.data(), n);
          STRATA_RETURN_IF_ERROR(device.copy(l.full_params.as<std::byte>() + layer_part.piece_begin(g, r) * l.element_bytes,
                                             values.data(), n * l.element_bytes, CopyKind::kHostToDevice));
        }
      }
      if (!stage0() && world > 1) {
        STRATA_ASSIGN_OR_RETURN(Completion last, gather_persistent(li));
        // A rollback (the error path): the next forward reads these parameters.
        STRATA_RETURN_IF_ERROR(wait_status(last, "gathering the re-derived parameters of " + lname));
      }
      l.params_ready = Completion();
      continue;
    }
    // Stage 3: a gathered copy holds the rolled-back values: dropped (none
    // outlives a step's backward; this is for a failure elsewhere).
    if (l.gathered_valid && l.held == 0) STRATA_RETURN_IF_ERROR(drop_gathered(li, l.last_use));
    // This rank's shard (padding zero, as at the start).
    values.assign(layer_part.shard_elements * l.element_bytes, std::byte{0});
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const SubGroup& g = layer_part.groups[gi];
      const size_t n = layer_part.piece_real(g, rank);
      if (n == 0) continue;
      master.resize(n);
      STRATA_RETURN_IF_ERROR(read_piece_state(li, gi, rank, master.data(), nullptr, nullptr)
                                 .with_context("re-deriving the parameters of " + lname));
      master_to_params(l.param_dtype, master.data(), values.data() + g.shard_offset * l.element_bytes, n);
    }
    STRATA_RETURN_IF_ERROR(put_shard(li, values));
    l.shard_ready = Completion();
  }
  return Status::Ok();
}

Status Engine::Impl::put_shard(size_t li, std::span<const std::byte> values) {
  Layer& l = layers[li];
  if (l.on_nvme) {
    const std::string name =
        fmt::format("parameter shard of layer {} '{}'", li, printable(part.layer(li).name, 64));
    STRATA_ASSIGN_OR_RETURN(Completion w,
                            param_swap->write(static_cast<uint32_t>(li), values.data(), values.size(), name));
    // Durable before the next gather reads it; callers are off the step path
    // (a load into a fresh engine, a rollback).
    return wait_status(w, "writing the " + name);
  }
  if (param_on_host()) {
    std::memcpy(l.host_shard.data(), values.data(), values.size());
    return Status::Ok();
  }
  return device.copy(l.dev_shard.data(), values.data(), values.size(), CopyKind::kHostToDevice);
}

Status Engine::Impl::wait_bounded(const Completion& c, std::string_view what) {
  if (c.done()) return Status::Ok();
  const auto t0 = Clock::now();
  if (c.wait_for(wait_bound())) return Status::Ok();
  const std::string label = c.label();
  Status error = DeadlineExceeded(fmt::format(
      "{} on rank {}: '{}' did not complete in {:.3f} s (strata.wait_timeout_s = {} s); a hung NVMe I/O, device "
      "kernel or peer rank? It may still be running, so this engine's state is unknown; if the work is only slow, "
      "raise strata.wait_timeout_s (EngineOptions::wait_timeout_s)",
      what, rank, label.empty() ? std::string("(unnamed)") : label, ms_since(t0) / 1e3, opt.wait_timeout_s));
  // Not `recovered`: whichever call returns it, the engine stops.
  recovered = false;
  if (stopped.ok())
    stopped = Status(error.code(), fmt::format("this engine stopped after an error it could not roll back: {}; resume "
                                               "every rank from the last checkpoint (strata train --resume DIR)",
                                               error.message()));
  return error;
}

void Engine::Impl::wait_at_teardown(const Completion& c, std::string_view what) const {
  if (c.done()) return;
  if (c.wait_for(wait_bound())) return;
  std::fprintf(stderr,
               "strata: destroying the engine on rank %d: %s ('%s') did not complete in %.3f s "
               "(strata.wait_timeout_s); still waiting, since buffers it may write cannot be freed before it ends; "
               "kill the process if it never does\n",
               rank, std::string(what).c_str(), c.label().c_str(), opt.wait_timeout_s);
  c.wait().ignore();
}

Status Engine::Impl::stop_unless_recovered(Status error) {
  if (recovered) {
    recovered = false;
    return error;
  }
  stopped = Status(error.code(),
                   fmt::format("this engine stopped after an error it could not roll back: {}; its state may be "
                               "part-way through a step: resume every rank from the last checkpoint "
                               "(strata train --resume DIR)",
                               error.message()));
  return error;
}

}  // namespace strata::offload
