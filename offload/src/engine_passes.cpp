// The ZeRO engine's provider hooks (Note [Acquire and release] in
// strata/core/layered_model.h): a pass's acquire and release of a layer,
// joining what ParameterGathering lends (the parameters) and what
// GradientReduction lends (a backward's gradient buffer), with the
// exposed-wait probes of StepMetrics.
#include "engine_impl.h"

#include <algorithm>

#include <fmt/format.h>

namespace strata::offload {

Result<LayerMemory> Engine::acquire(size_t layer_index, Pass pass, AcquireWaiter waiter) {
  return impl_->acquire(layer_index, pass, waiter);
}

Result<LayerMemory> Engine::Impl::acquire(size_t li, Pass pass, AcquireWaiter waiter) {
  if (li >= part.layer_count())
    return InvalidArgument(fmt::format("acquire of layer {}: the model has {} layers", li, part.layer_count()));
  // A frozen layer's values are never written by a load: readable after a failed one.
  if (!load_failed.ok() && !where(li).frozen) return load_failed;  // Note [A failed load] in engine.h
  const bool training = phase == Phase::kMicroBatch;
  if (pass != Pass::kEval && !training)
    return FailedPrecondition(fmt::format(
        "acquire of {} for {} {} on rank {}: training passes run inside a micro-batch (begin_step(), "
        "begin_micro_batch(); Note [Driving the engine]); a pass outside one is an evaluation (Pass::kEval)",
        layer_label(li), pass_name(pass), phase_name(phase), rank));
  if (training) params.trace().on_acquire(li, pass);
  if (training && pass == Pass::kBackward && !progress.in_backward) {
    // StepMetrics: the micro-batch's forward ends here, its backward begins.
    progress.backward_started = Clock::now();
    progress.forward_ms += std::chrono::duration<double, std::milli>(progress.backward_started - progress.micro_started).count();
    progress.in_backward = true;
  }
  if (pass == Pass::kBackward) STRATA_RETURN_IF_ERROR(grads.check_backward_acquire(li));
  STRATA_ASSIGN_OR_RETURN(ParameterGathering::Lease lease, params.acquire(li, pass, training));
  LayerMemory mem;
  mem.params = lease.params;
  mem.params_tier = Tier::kDevice;
  std::vector<Completion> waits{lease.ready};
  if (pass == Pass::kBackward && !where(li).frozen) {
    STRATA_ASSIGN_OR_RETURN(GradientReduction::Lease gradient, grads.acquire_for_backward(li));
    waits.push_back(gradient.zeroed);
    mem.grads = gradient.grads;
    mem.grad_dtype = opt.grad_dtype;
    mem.grads_tier = Tier::kDevice;
  }
  const Completion params_ready = waits.front();
  const bool all_done = std::all_of(waits.begin(), waits.end(), [](const Completion& c) { return c.done(); });
  mem.ready = waits.size() == 1 ? waits.front()
              : all_done       ? when_all(waits)  // complete already: a label would never be read
                               : when_all(waits, fmt::format("layer {} ready", li));
  // Exposed-wait probe of a training pass: when the waiter reaches this
  // layer (Note [Who waits for an acquired layer]), and when its parameters
  // are ready (their update, then their gather; a backward's zeroed
  // gradient buffer is not a parameter wait).
  Stream* waiting_stream = waiter.stream_or(model_stream);
  if (training && !params_ready.done() && (waiter.is_host() || waiting_stream != nullptr)) {
    auto probe = std::make_shared<WaitProbe>();
    probe->layer = li;
    probe->backward = progress.in_backward;
    bool probed = true;
    if (waiter.is_host()) {
      probe->reached_ns.store(now_ns());
    } else {
      // The probe only times the wait: a stream that cannot take it is not a failed acquire (the layer is
      // held by now); the wait on that stream reports the stream's failure where it matters.
      probed = waiting_stream->launch_host([probe] { probe->reached_ns.store(now_ns()); }).ok();
    }
    if (!probed) return mem;
    lease.update_ready.then([probe](const Status&) { probe->update_ns.store(now_ns()); });
    params_ready.then([probe](const Status&) { probe->ready_ns.store(now_ns()); });
    probes.push_back(std::move(probe));
  }
  return mem;
}

Status Engine::Impl::release(size_t li, Pass pass, const Completion& done, const Completion& memory_returned) {
  if (li >= part.layer_count() || !params.held(li))
    return FailedPrecondition(fmt::format("release of layer {} that is not held", li));
  ParameterGathering::PassPosition at;
  at.training = phase == Phase::kMicroBatch;
  at.evaluation = phase == Phase::kEvaluation;
  at.last_micro = progress.last_micro;
  STRATA_RETURN_IF_ERROR(params.release(li, done, at, memory_returned));
  if (pass == Pass::kBackward)
    STRATA_RETURN_IF_ERROR(grads.released_in_backward(li, done, params.trace().backward_releases_expected(li),
                                                      at.training && progress.last_micro));
  return Status::Ok();
}

}  // namespace strata::offload
