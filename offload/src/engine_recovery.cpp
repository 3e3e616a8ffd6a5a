// Step atomicity (Note [Atomic steps] in engine.h) on the engine's side: the
// counters a rollback restores (the vote and the rollback itself are
// CommitPoint's), the bounded waits that stop the engine, and the
// preconditions the public calls check.
#include "engine_impl.h"

#include <cstdio>

#include <fmt/format.h>

namespace strata::offload {

Status Engine::Impl::expect_frozen_layers_initialized(const char* call) const {
  for (size_t li = 0; li < part.layer_count(); ++li)
    if (where(li).frozen && !initialized[li])
      return FailedPrecondition(fmt::format(
          "{}: {} is frozen and has no values yet: a checkpoint does not store frozen layers (Note [Frozen layers in "
          "checkpoints]), so put_initial_layer() its values before loading",
          call, layer_label(li)));
  return Status::Ok();
}

Status Engine::Impl::expect_initialized() const {
  for (size_t li = 0; li < initialized.size(); ++li)
    if (!initialized[li])
      return FailedPrecondition(fmt::format(
          "{} has no initial values: this model does not provide its own, so every rank calls put_initial_layer() for "
          "every layer before the first step",
          layer_label(li)));
  return Status::Ok();
}

StepMark Engine::Impl::mark() const {
  StepMark m;
  m.optimizer_steps = optimizer_steps;
  m.steps_begun = steps_begun;
  m.scaler = scaler->state();
  if (runner != nullptr) m.data = runner->data_position();
  return m;
}

Status Engine::Impl::restore_counters(const StepMark& m) {
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
  return Status::Ok();
}

Status engine_detail::EngineContext::wait_bounded(const Completion& c, std::string_view what) {
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
                                               "every rank from the last checkpoint ({})",
                                               error.message(), opt.resume_hint));
  return error;
}

void engine_detail::EngineContext::wait_at_teardown(const Completion& c, std::string_view what) const {
  if (c.done()) return;
  if (c.wait_for(wait_bound())) return;
  std::fprintf(stderr,
               "strata: destroying the engine on rank %d: %s ('%s') did not complete in %.3f s "
               "(strata.wait_timeout_s); still waiting, since buffers it may write cannot be freed before it ends; "
               "kill the process if it never does\n",
               rank, std::string(what).c_str(), c.label().c_str(), opt.wait_timeout_s);
  c.wait().ignore();
}

Status engine_detail::EngineContext::stop_unless_recovered(Status error) {
  if (recovered) {
    recovered = false;
    return error;
  }
  stopped = Status(error.code(),
                   fmt::format("this engine stopped after an error it could not roll back: {}; its state may be "
                               "part-way through a step: resume every rank from the last checkpoint "
                               "({})",
                               error.message(), opt.resume_hint));
  return error;
}

}  // namespace strata::offload
