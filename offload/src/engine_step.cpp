// The ZeRO engine's step, as the caller drives it (Note [Driving the engine]
// in engine.h): the bracket calls, the global norm and loss scale, the
// per-layer updates queued in forward order (Note [Exact overlap]) and
// published, the step's metrics; evaluation.
#include "engine_impl.h"
#include "early_updates.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::offload {

// ---------------------------------------------------------------- driving (Note [Driving the engine])

const char* Engine::Impl::phase_name(Phase p) {
  switch (p) {
    case Phase::kIdle: return "outside a step";
    case Phase::kStep: return "inside a step, between micro-batches";
    case Phase::kMicroBatch: return "inside a micro-batch";
    case Phase::kEvaluation: return "inside an evaluation";
  }
  return "?";
}

Status Engine::Impl::expect_phase(Phase want, const char* call) const {
  if (phase == want) return Status::Ok();
  return FailedPrecondition(fmt::format(
      "{} was called {} on rank {}; it belongs {} (one step is begin_step(), then begin_micro_batch(last) .. "
      "end_micro_batch() for each of the {} micro-batches, then finish_step(); an evaluation is begin_evaluation() "
      ".. finish_evaluation())",
      call, phase_name(phase), rank, phase_name(want), opt.grad_accum));
}

Status Engine::Impl::begin_step() {
  progress = StepInProgress{};
  progress.started = Clock::now();
  transfers = TransferCounters{};
  probes.clear();
  // Blocks until an evaluation's dropped copies are freed, so this step's
  // gathers do not stack on them (the memory plan counts one set).
  STRATA_RETURN_IF_ERROR(params.drain());
  io_before = updates.state_io_stats();
  nvme_bytes.step_begins(commit.pending());
  step_start = mark();
  failures.take(FailureOf::kCall).ignore();  // a late read of the previous call's dropped copies
  ++steps_begun;
  grads.begin_step();
  progress.scale = scaler->scale();
  phase = Phase::kStep;
  return Status::Ok();
}

Status Engine::Impl::begin_micro_batch(bool last) {
  ++progress.micro;
  progress.last_micro = last;
  progress.in_backward = false;
  // The last backward reduces every gradient: updates may start under it,
  // assuming the step's likely arguments (Note [Early, exact updates]).
  if (last && placement.early_updates && speculate_next_step && !updates.early().is_open()) {
    // Note [A step's NVMe bytes]: the previous step's updates, when still
    // pending, end where this step's early ones begin.
    updates.early().open(optimizer_steps + 1, progress.scale, hyper_of_step(optimizer_steps + 1),
                               commit.pending() && opt_on_nvme() ? &nvme_bytes : nullptr);
  }
  grads.begin_micro_batch();
  params.trace().begin_micro_batch();
  progress.micro_started = Clock::now();
  phase = Phase::kMicroBatch;
  return Status::Ok();
}

Status Engine::Impl::end_micro_batch(double mean_loss, int64_t tokens) {
  phase = Phase::kStep;
  // A failed prefetch of a layer this micro-batch did not acquire after all.
  STRATA_RETURN_IF_ERROR(params.take_unclaimed_prefetch_failure());
  if (progress.in_backward) progress.backward_ms += ms_since(progress.backward_started);
  else progress.forward_ms += ms_since(progress.micro_started);  // no backward acquire: all forward
  progress.loss_sum += mean_loss;
  progress.tokens += static_cast<uint64_t>(tokens);
  params.trace().end_micro_batch();
  if (!progress.last_micro) return Status::Ok();
  // Stage 3 drops gathered copies at the end of a step's last backward (the
  // update will change them); kept ones wait for their last reader.
  STRATA_RETURN_IF_ERROR(params.drop_unheld());
  // Every gradient is complete now, the unused layers' (zero) too.
  return grads.launch_every_reduction();
}

Result<StepOutcome> Engine::Impl::finish_step() {
  phase = Phase::kIdle;
  Result<StepMetrics> m = finish_applied_step();
  StepOutcome out;
  if (m.ok()) {
    out.metrics = *m;
    out.state_step = optimizer_steps;
    return out;
  }
  if (!recovered) return m.status();  // the engine stops (Engine::finish_step)
  recovered = false;
  out.kind = recovery;
  out.state_step = optimizer_steps;
  out.reason = m.status();
  return out;
}

// The step in progress is dropped: the caller's passes are over (the
// model's stream is waited for), held layers are released, the partial
// gradients are discarded (zeroed again by the repeated step), the counters
// go back to the step's start. Reductions already issued are waited for
// (their block sums read the optimizer's input buffers, which the repeated
// step's reductions write again); gathers complete on their own; the
// previous step's updates stay pending until the next commit point.
Status Engine::Impl::abandon_step() {
  const bool in_micro_batch = phase == Phase::kMicroBatch;
  phase = Phase::kIdle;
  Completion model_done;
  if (model_stream != nullptr) {
    model_done = model_stream->record_completion();
    STRATA_RETURN_IF_ERROR(wait_bounded(model_done, "abandon_step(): the model's queued work"));
  }
  STRATA_RETURN_IF_ERROR(params.release_every_held(model_done));
  STRATA_RETURN_IF_ERROR(grads.wait_for_issued_reductions());
  // Updates started under the abandoned backward are undone.
  STRATA_RETURN_IF_ERROR(updates.early().close());
  STRATA_RETURN_IF_ERROR(updates.early().undo_every().status());
  if (in_micro_batch) params.trace().abandon_micro_batch();
  params.take_unclaimed_prefetch_failure().ignore();  // the step it was for is gone
  STRATA_RETURN_IF_ERROR(params.drop_unheld());
  failures.take(FailureOf::kCall).ignore();  // a read of the abandoned step's passes
  STRATA_RETURN_IF_ERROR(restore_counters(step_start));
  // Gradients are zeroed once per step, by step number: the repeated step zeroes them again.
  grads.forget_zeroing();
  return Status::Ok();
}

Result<StepMetrics> Engine::Impl::step() {
  STRATA_RETURN_IF_ERROR(begin_step());
  for (int micro = 0; micro < opt.grad_accum; ++micro) {
    STRATA_RETURN_IF_ERROR(begin_micro_batch(micro == opt.grad_accum - 1));
    Result<float> loss = runner->train_micro_batch(static_cast<float>(gradient_scale()), *self);
    if (!loss.ok()) return loss.status().with_context(fmt::format("micro-batch {} on rank {}", micro + 1, rank));
    STRATA_RETURN_IF_ERROR(end_micro_batch(*loss, static_cast<int64_t>(runner->tokens_per_micro_batch())));
  }
  phase = Phase::kIdle;
  return finish_applied_step();
}

Result<StepMetrics> Engine::Impl::finish_applied_step() {
  const auto t0 = progress.started;
  const StepMark& call = step_start;
  const double scale = progress.scale;
  const double loss_sum = progress.loss_sum;
  STRATA_ASSIGN_OR_RETURN(const double bwd_ms, wait_for_backwards());
  const auto tr = Clock::now();
  STRATA_ASSIGN_OR_RETURN(const double sum_squares, step_norm_squared());
  // The commit point of the previous step's updates (every rank got here,
  // so all of them ran): committed, or every rank rolls back and this step
  // is dropped with it. Its vote also carries each rank's loss: the loss of
  // the global batch is every rank's micro-batch losses added in rank order
  // (blocks: the step returns this number).
  double loss_all = loss_sum;
  STRATA_RETURN_IF_ERROR(commit.settle(&call, &loss_all));
  const double wait_reduce_ms = ms_since(tr);
  // The previous step's updates are all done here (the commit point waited
  // for them): their time is this step's optimizer_ms with overlap on.
  const double previous_update_ms = updates.take_timed_ms();  // reported once
  StepMetrics m;
  m.loss = loss_all / (static_cast<double>(opt.grad_accum) * world);
  m.loss_scale = scale;
  m.grad_norm = std::sqrt(sum_squares) / scale;
  const bool finite = std::isfinite(sum_squares);
  STRATA_RETURN_IF_ERROR(check_step_finite(m.loss, finite, m.grad_norm));
  m.skipped = !finite;
  STRATA_RETURN_IF_ERROR(apply_or_skip_step(call, finite, scale, m));
  // Behind the step's updates: read ahead for the next step's first opens.
  updates.early().read_ahead_for_next_step(placement.early_updates && speculate_next_step);
  m.step = optimizer_steps;
  report_step_times(m, t0, bwd_ms, wait_reduce_ms, finite, previous_update_ms);
  report_exposed_waits(m);
  report_step_traffic(m);
  return m;
}

// Blocks, but no longer than the norm would (it needs every gradient):
// waiting here first separates backward time from reduction time in the
// metrics and names the layer whose backward failed. Returns the wait's ms.
Result<double> Engine::Impl::wait_for_backwards() {
  const auto tb = Clock::now();
  for (size_t li = 0; li < part.layer_count(); ++li)
    STRATA_RETURN_IF_ERROR(wait_status(grads.backward_released(li), fmt::format("backward of layer {}", li)));
  return ms_since(tb);
}

// The step's squared global gradient norm. Early updates not started yet
// are claimed back first (they are queued later in forward order), so the
// norm's block sums wait for one update at most.
Result<double> Engine::Impl::step_norm_squared() {
  STRATA_RETURN_IF_ERROR(updates.early().close());
  STRATA_ASSIGN_OR_RETURN(double sum_squares, grads.global_norm_squared());
  nvme_bytes.backward_done();
  return sum_squares;
}

// A loss or gradient norm that is not finite stops training, except that
// fp16 skips a step whose norm overflowed.
Status Engine::Impl::check_step_finite(double loss, bool finite_norm, double grad_norm) const {
  if (!std::isfinite(loss) && opt.fp16.enabled == false)
    return DataLoss(fmt::format("step {}: the loss is {} (not finite); training stopped", optimizer_steps + 1, loss));
  if (!finite_norm && !opt.fp16.enabled)
    return DataLoss(fmt::format("step {}: the gradient norm is not finite ({}); training stopped (only fp16 skips "
                                "steps on overflow)",
                                optimizer_steps + 1, grad_norm));
  return Status::Ok();
}

// The loss scaler learns whether the step overflowed; a finite step's
// updates are queued (committed here with overlap off), a skipped step's
// early updates go back to the previous step's state. Counts into `m`.
Status Engine::Impl::apply_or_skip_step(const StepMark& call, bool finite, double scale, StepMetrics& m) {
  STRATA_RETURN_IF_ERROR(scaler->update(!finite).with_context(fmt::format("step {}", optimizer_steps + 1)));
  const cpu_adam::HyperParams hyper = hyper_of_step(optimizer_steps + 1);
  m.lr = hyper.lr;
  if (!finite) {
    STRATA_ASSIGN_OR_RETURN(int64_t restored, updates.early().undo_every());
    m.speculated_layers = m.redone_layers = restored;
    return Status::Ok();
  }
  ++optimizer_steps;
  const double clip = cpu_adam::clip_coefficient(m.grad_norm, opt.grad_clip);
  speculate_next_step = clip == 1.0;
  m.beta1 = hyper.beta1;
  STRATA_RETURN_IF_ERROR(queue_step_updates(call, clip, scale, hyper, m));
  if (opt.overlap_optimizer) return Status::Ok();
  // strata.overlap_optimizer false: the comparison mode, the step returns
  // only when every update is in place (the blocking is the point), and
  // commits them here: a failed update fails this step.
  for (size_t li = 0; li < part.layer_count(); ++li)
    STRATA_RETURN_IF_ERROR(wait_status(params.ready(li),
                                       fmt::format("the update of layer {} (strata.overlap_optimizer false)", li)));
  return commit.settle(nullptr);
}

// The step's times: since `t0` (its begin_step), its passes, the wait for
// the reductions and the optimizer's.
void Engine::Impl::report_step_times(StepMetrics& m, Clock::time_point t0, double bwd_ms, double wait_reduce_ms,
                                     bool finite, double previous_update_ms) {
  m.step_ms = ms_since(t0);
  m.forward_ms = progress.forward_ms;
  m.backward_ms = progress.backward_ms + bwd_ms;
  m.wait_reduce_ms = wait_reduce_ms;
  // Overlap off: this step's updates, done by now. On: they run on while the
  // next step does, so the step's report carries the previous step's.
  m.optimizer_ms = !opt.overlap_optimizer && finite ? updates.timed_ms() : previous_update_ms;
}

// The model's waits for the step's layers (its probes): on an update, on a gather.
void Engine::Impl::report_exposed_waits(StepMetrics& m) const {
  for (const auto& p : probes) {
    const int64_t reached = p->reached_ns.load(), upd = p->update_ns.load(), ready = p->ready_ns.load();
    if (reached < 0 || ready < 0) continue;
    const double total = std::max<int64_t>(0, ready - reached) / 1e6;
    const double on_update = upd < 0 ? 0 : std::max<int64_t>(0, std::min(upd, ready) - reached) / 1e6;
    m.wait_optimizer_ms += on_update;
    if (on_update > 0) m.optimizer_waits.push_back({p->layer, on_update});
    (p->backward ? m.wait_gather_backward_ms : m.wait_gather_ms) += total - on_update;
  }
}

// The step's throughput, bytes moved, memory peaks and NVMe traffic.
void Engine::Impl::report_step_traffic(StepMetrics& m) {
  // This rank's tokens times the world size (ranks train equal batches).
  m.tokens_per_s = static_cast<double>(progress.tokens) * world / (m.step_ms / 1e3);
  m.h2d_bytes = transfers.h2d_bytes;
  m.d2h_bytes = transfers.d2h_bytes;
  m.gather_bytes = transfers.gather_bytes;
  m.reduce_bytes = transfers.reduce_bytes;
  m.peak_device_bytes = device.memory_stats().get(Tier::kDevice).peak_bytes;
  m.peak_pinned_bytes = stats.get(Tier::kPinnedHost).peak_bytes;
  m.peak_host_bytes = stats.get(Tier::kPageableHost).peak_bytes;
  m.peak_nvme_bytes = stats.get(Tier::kNvme).peak_bytes;
  const StepNvmeBytes::Bytes nvme = nvme_bytes.take();  // Note [A step's NVMe bytes]
  m.nvme_read_bytes = nvme.read;
  m.nvme_write_bytes = nvme.written;
  if (opt_on_nvme()) {
    // Between two moments of this thread, like the step's other times.
    const StateTierIoStats now = updates.state_io_stats();
    m.wait_nvme_ms = static_cast<double>((now.read_wait_ns - io_before.read_wait_ns) +
                                         (now.write_wait_ns - io_before.write_wait_ns)) / 1e6;
  }
}

cpu_adam::HyperParams Engine::Impl::hyper_of_step(int64_t step) const {
  cpu_adam::HyperParams hyper = opt.hyper;
  hyper.lr = caller_lr ? *caller_lr : schedule->lr(step);
  // OneCycle with cycle_momentum: beta1 cycles against the lr, beta2 is
  // DeepSpeed's 0.99 (LrSchedule::betas); other schedules keep the config's.
  if (const std::optional<std::array<double, 2>> betas = schedule->betas(step)) {
    hyper.beta1 = (*betas)[0];
    hyper.beta2 = (*betas)[1];
  }
  return hyper;
}

Status Engine::Impl::queue_step_updates(const StepMark& call, double clip, double scale,
                                        const cpu_adam::HyperParams& hyper, StepMetrics& m) {
  commit.begin_pending(call);
  updates.start_timing();
  for (size_t li = 0; li < part.layer_count(); ++li) {
    if (where(li).frozen) continue;  // nothing to step: its parameters stay as they are
    UpdateScheduler::Queued queued;
    if (updates.early().ran(li)) {
      // Note [Early, exact updates]: kept when it ran with this step's
      // arguments (the same bits as queuing it now), else redone from the
      // state it left untouched.
      ++m.speculated_layers;
      if (updates.early().matches(li, optimizer_steps, clip, scale, hyper) && updates.early().written(li)) {
        STRATA_ASSIGN_OR_RETURN(queued, updates.early().keep(li, grads.update_input(li)));
      } else {
        ++m.redone_layers;
        STRATA_ASSIGN_OR_RETURN(queued,
                                updates.queue_update(li, grads.update_input(li), optimizer_steps, clip, scale, hyper));
      }
    } else {
      STRATA_ASSIGN_OR_RETURN(queued,
                              updates.queue_update(li, grads.update_input(li), optimizer_steps, clip, scale, hyper));
    }
    grads.read_until(li, queued.update_ran);
    STRATA_RETURN_IF_ERROR(params.publish_update(li, queued.updated));
  }
  updates.early().forget();
  commit.pending_queued();
  return Status::Ok();
}

Status Engine::Impl::begin_evaluation() {
  // The parameters evaluated are a committed step's.
  STRATA_RETURN_IF_ERROR(commit.settle(nullptr));
  failures.take(FailureOf::kCall).ignore();
  // Blocks until the step's dropped copies are freed, so the evaluation's
  // gathers do not stack on them (the memory plan counts one set).
  STRATA_RETURN_IF_ERROR(params.drain());
  phase = Phase::kEvaluation;
  return Status::Ok();
}

Result<double> Engine::Impl::finish_evaluation(double loss_sum, int64_t batches) {
  phase = Phase::kIdle;
  // Stage 3: nothing stays gathered between evaluations.
  STRATA_RETURN_IF_ERROR(params.drop_unheld());
  // The sum, the batches and, beside them, how many ranks' parameter reads
  // failed (a layer gathered from a failed read: the loss is not reported).
  const Status read = failures.take(FailureOf::kCall);
  const double mine[3] = {loss_sum, static_cast<double>(batches), read.ok() ? 0.0 : 1.0};
  double all[3] = {0, 0, 0};
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, mine, sizeof(mine), all, sizeof(all),
      [&](const void* s, void* r) {
        return comm.all_reduce(s, r, 3, DType::kF64, comm::ReduceOp::kSum, comm::CommQueue::kReduce);
      },
      "summing the validation loss over ranks"));
  if (all[2] != 0.0) {
    recovered = true;  // nothing was changed: the engine goes on
    return Status(read.ok() ? StatusCode::kUnavailable : read.code(),
                  fmt::format("validation: reading the parameters failed on {} rank(s){}; no validation loss "
                              "(nothing changed: evaluate() may be called again)",
                              static_cast<int64_t>(all[2]), read.ok() ? "" : " (here: " + read.message() + ")"));
  }
  if (all[1] <= 0.0) {
    recovered = true;  // every rank says so: nothing changed, the engine goes on
    return InvalidArgument("finish_evaluation(): no rank evaluated a batch (batches 0 on every rank)");
  }
  return all[0] / all[1];
}

Result<double> Engine::Impl::evaluate() {
  STRATA_RETURN_IF_ERROR(begin_evaluation());
  double sum = 0;
  const size_t count = runner->eval_batch_count();
  for (size_t b = 0; b < count; ++b) {
    Result<float> loss = runner->eval_batch(b, *self);
    if (!loss.ok()) {
      phase = Phase::kIdle;
      return loss.status();
    }
    sum += *loss;
  }
  return finish_evaluation(sum, static_cast<int64_t>(count));
}

}  // namespace strata::offload
