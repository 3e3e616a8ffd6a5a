// The ZeRO engine's step: micro-batches, the global norm from block sums,
// the overflow vote and loss scale, the per-layer update queued in forward
// order (Note [Exact overlap] in engine.h), evaluation.
#include "engine_impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::offload {

// ---------------------------------------------------------------- the step

Result<double> Engine::Impl::global_norm_squared() {
  // Every layer's block sums, this rank's owned order, layer by layer.
  std::vector<double> mine;
  // Blocks: the norm (and with it the clip coefficient of every update)
  // needs the block sums of every layer.
  for (size_t li = 0; li < layers.size(); ++li) {
    STRATA_RETURN_IF_ERROR(wait_status(layers[li].norm_partials_ready,
                                       fmt::format("reducing the gradients of layer {} on rank {}", li, rank)));
    mine.insert(mine.end(), layers[li].block_sums.begin(), layers[li].block_sums.end());
  }
  double total = 0;
  if (stage0()) {
    for (double v : mine) total += v;  // already in (layer, group, rank, block) order
    return total;
  }
  std::vector<double> all(mine.size() * world);
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, mine.data(), mine.size() * sizeof(double), all.data(), all.size() * sizeof(double),
      [&](const void* s, void* r) { return comm.all_gather(s, r, mine.size(), DType::kF64, comm::CommQueue::kReduce); },
      "gathering the gradient norm's block sums"));
  // all[r] holds rank r's blocks in (layer, group, block) order; add in
  // (layer, group, rank, block) order, as stage 0 does.
  size_t layer_base = 0;
  for (size_t li = 0; li < layers.size(); ++li) {
    if (layers[li].frozen) continue;  // no gradient, no blocks
    const LayerPartition& layer_part = part.layer(li);
    for (const SubGroup& g : layer_part.groups) {
      const size_t nb = g.piece / kShardAlign, gb = layer_base + g.shard_offset / kShardAlign;
      for (int r = 0; r < world; ++r)
        for (size_t j = 0; j < nb; ++j) total += all[static_cast<size_t>(r) * mine.size() + gb + j];
    }
    layer_base += layer_part.shard_elements / kShardAlign;
  }
  return total;
}

std::vector<Engine::Impl::PieceJob::Run> Engine::Impl::runs_of(size_t li, size_t begin, size_t count,
                                                               const cpu_adam::HyperParams& hyper) const {
  std::vector<PieceJob::Run> out;
  const size_t end = begin + count;
  for (const HyperRun& r : layers[li].hyper_runs) {
    const size_t b = std::max(begin, r.begin), e = std::min(end, r.end);
    if (b >= e) continue;
    PieceJob::Run run;
    run.offset = b - begin;
    run.count = e - b;
    run.hyper = hyper;
    run.hyper.lr = hyper.lr * r.lr_scale;
    run.hyper.weight_decay = r.weight_decay;
    out.push_back(run);
  }
  return out;
}

Status Engine::Impl::queue_update(size_t li, int64_t step, double clip, double scale,
                                  const cpu_adam::HyperParams& hyper) {
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  if (l.frozen) return Status::Ok();  // nothing to step: its parameters stay as they are
  // Pointers are computed here (driving thread); the workers only step.
  std::vector<PieceJob> host_jobs, dev_jobs;
  const std::byte* gsrc = opt_on_host() ? l.opt_grads_host.data()
                          : grads_in_place() ? l.full_grads.as<std::byte>()
                                             : l.opt_grads_dev.as<std::byte>();
  const bool gpadded = grads_in_place() || stage0();
  for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    const SubGroup& g = layer_part.groups[gi];
    for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
      const size_t count = layer_part.piece_real(g, r), host = host_n(count);
      PieceJob j;
      j.id = StateId{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      j.count = host;
      j.runs = runs_of(li, layer_part.piece_begin(g, r), host, hyper);
      j.grads = gsrc + (gpadded ? layer_part.piece_begin(g, r) : g.shard_offset) * grad_bytes();
      j.param_is_master = !has_master(li);
      j.param = l.staging ? l.staging.data() + owned_offset(layer_part, g, r) * l.element_bytes : param_location(li, g, r);
      if (l.staging && !l.on_nvme) {
        j.h2d = param_location(li, g, r);
        h2d_bytes += host * l.element_bytes;
      }
      host_jobs.push_back(j);
      if (split()) {
        // The device part: grads from the device copy, the update straight
        // into the device parameters (fp32: they are the master).
        PieceJob d;
        d.id = j.id;
        d.count = count - host;
        d.runs = runs_of(li, layer_part.piece_begin(g, r) + host, count - host, hyper);
        d.grads = l.opt_grads_dev.as<std::byte>() + (g.shard_offset + host) * grad_bytes();
        d.param = param_location(li, g, r) + host * l.element_bytes;
        d.param_is_master = l.param_dtype == DType::kF32;
        dev_jobs.push_back(d);
      }
    }
  }
  cpu_adam::StepArgs args;
  args.step = step;
  args.hyper = hyper;  // each run's own lr and weight decay: PieceJob::runs
  args.clip_coefficient = clip;
  args.loss_scale = scale;
  args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
  const DType param_dtype = l.param_dtype;
  // An aliased layer's update writes the memory the model reads: after the
  // layer's last release, too (its backward's is in norm_partials_ready already,
  // a forward-only use is not).
  Completion gate = l.norm_partials_ready;
  if (aliased(l)) {
    // Released (ok or not: then nobody reads it any more) and reduced.
    auto released = std::make_shared<CompletionSource>(fmt::format("layer {} released", li));
    l.last_use.then([released](const Status&) { released->complete(Status::Ok()); });
    const Completion both[] = {l.norm_partials_ready, released->completion()};
    gate = when_all(both, fmt::format("layer {} released and its gradient reduced", li));
  }
  // `raw` fails when the update fails; what later work waits on (the
  // gradients' reuse, the gathers, the next forward) is `absorb`ed: it
  // completes ok either way and the failure goes to the commit point's
  // vote, so every rank runs the same collectives up to it (Note [Atomic
  // steps] in engine.h).
  Completion raw = worker->submit(
      [this, jobs = std::move(host_jobs), args, param_dtype, spent = update_ns] {
        const auto t0 = Clock::now();
        Status st = step_pieces(*tier, *optimizer, jobs, args, param_dtype);
        spent->fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
        return st;
      },
      gate, fmt::format("optimizer step of layer {}", li), /*sticky=*/false);
  if (split()) {
    const Completion dev_done =
        dev_worker->submit([this, jobs = std::move(dev_jobs), args, param_dtype] { return step_pieces(*dev_tier, *dev_optimizer, jobs, args, param_dtype); },
                           gate, fmt::format("device optimizer step of layer {}", li), /*sticky=*/false);
    const Completion both[] = {raw, dev_done};
    raw = when_all(both, fmt::format("optimizer step of layer {}", li));
  }
  l.update_ran = absorb(raw, fmt::format("optimizer step of layer {}", li));
  l.full_gradient_read = l.update_ran;
  Completion updated = raw;
  if (l.on_nvme) {
    // The updated shard (in staging, shard layout) goes back to NVMe once
    // the step has written it; the next gather waits for the write.
    auto written = std::make_shared<CompletionSource>(fmt::format("parameter shard of layer {} written", li));
    updated = written->completion();
    const uint64_t bytes = layer_part.shard_elements * l.element_bytes;
    std::byte* data = l.staging.data();
    const std::string name = fmt::format("parameter shard of layer {} '{}'", li, printable(layer_part.name, 64));
    raw.then([this, li, written, bytes, data, name](const Status& st) {
      if (!st.ok()) return written->complete(st);
      Result<Completion> w = param_swap->write(static_cast<uint32_t>(li), data, bytes, name);
      if (!w.ok()) return written->complete(w.status());
      w->then([written, name](const Status& s) { written->complete(s.ok() ? s : s.with_context("writing the " + name)); });
    });
  }
  // Otherwise the updated values went H2D tile by tile from the optimizer's
  // tile callback (step_pieces), so they are in place when update_ran completes.
  l.update_written = updated;
  updated = absorb(updated, fmt::format("update of layer {}", li));
  if (l.persistent) {
    if (!stage0()) {
      STRATA_RETURN_IF_ERROR(comm.wait(updated, comm::CommQueue::kUpdate));
      STRATA_ASSIGN_OR_RETURN(updated, gather_persistent(li));
    }
    l.params_ready = updated;
  } else {
    l.shard_ready = updated;
  }
  return Status::Ok();
}

Status Engine::Impl::step_pieces(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
                                 const cpu_adam::StepArgs& args, DType param_dtype) {
  if (device_opt() && &t == tier.get()) {
    // The fused device kernel: one launch for the layer's pieces, on its
    // stream; this (optimizer) thread waits for it, so the layer's update
    // completes as on the host path.
    DeviceAdamArgs da;
    da.kind = opt.optimizer;
    da.step = args.step;
    da.clip_coefficient = args.clip_coefficient;
    da.loss_scale = args.loss_scale;
    da.grad_dtype = opt.grad_dtype;
    da.moment_dtype = opt.moment_dtype;
    da.param_copy_dtype = param_dtype == DType::kF32 ? DType::kBF16 : param_dtype;
    // One launch per distinct set of hyper-parameters (usually one), over
    // the runs that have it.
    const size_t grad_bytes = dtype_size(opt.grad_dtype), me = dtype_size(opt.moment_dtype), element_bytes = dtype_size(param_dtype);
    std::vector<std::pair<cpu_adam::HyperParams, std::vector<DeviceAdamTensor>>> launches;
    for (const PieceJob& j : jobs) {
      if (j.count == 0) continue;
      STRATA_ASSIGN_OR_RETURN(PieceState st, t.open(j.id));
      for (const PieceJob::Run& run : j.runs) {
        DeviceAdamTensor d;
        d.count = run.count;
        d.grads = j.grads + run.offset * grad_bytes;
        d.exp_avg = static_cast<std::byte*>(st.exp_avg) + run.offset * me;
        d.exp_avg_sq = static_cast<std::byte*>(st.exp_avg_sq) + run.offset * me;
        d.params = (j.param_is_master ? reinterpret_cast<float*>(j.param) : st.master) + run.offset;
        if (!j.param_is_master && param_dtype != DType::kF32) d.param_copy = j.param + run.offset * element_bytes;
        auto same = [&](const auto& launch) {
          return launch.first.lr == run.hyper.lr && launch.first.weight_decay == run.hyper.weight_decay;
        };
        auto it = std::find_if(launches.begin(), launches.end(), same);
        if (it == launches.end()) it = launches.insert(launches.end(), {run.hyper, {}});
        it->second.push_back(d);
      }
    }
    Status launched;
    for (const auto& [hyper, tensors] : launches) {
      da.hyper = hyper;
      if (launched.ok()) launched = device_adam_step(*opt_stream, da, tensors);
    }
    if (launched.ok()) {
      // Bounded (Note [Bounded waits]): a hung kernel fails the update (torn, below).
      const Completion kernel = opt_stream->record_completion();
      launched = kernel.wait_for(wait_bound())
                     ? opt_stream->synchronize()
                     : DeadlineExceeded(fmt::format("the kernel did not complete in {} s (strata.wait_timeout_s; raise "
                                                    "it if the kernel is only slow)",
                                                    opt.wait_timeout_s));
    }
    if (!launched.ok()) {
      for (const PieceJob& j : jobs)
        if (j.count != 0) t.close(j.id, false).ignore();
      // The kernel updates the state in place: how far it got is unknown.
      if (!jobs.empty() && !t.versioned())
        record_failure(FailureOf::kTorn,
                       launched.with_context(fmt::format("the device optimizer step of layer {} (the state is in {}, "
                                                         "updated in place)",
                                                         jobs.front().id.layer, t.describe())));
      return launched;
    }
    for (const PieceJob& j : jobs) {
      if (j.count == 0) continue;
      // fp32 parameters with a separate master do not occur here (no master
      // on the device for fp32: the parameters are stepped in place).
      STRATA_RETURN_IF_ERROR(t.close(j.id, true));
    }
    return Status::Ok();
  }
  const size_t grad_bytes = dtype_size(opt.grad_dtype), element_bytes = dtype_size(param_dtype);
  // A tier that keeps the state in place (pinned host or device memory) has
  // no copy of the previous step: a failure that leaves some of the layer's
  // state stepped and some not is torn (kTorn: the commit point stops the
  // engine, Note [Atomic steps]). A failed copy of the update to the device
  // is not: the kernel goes on, so the state holds the whole step and only
  // the parameters are re-derived.
  const bool in_place = !t.versioned();
  Status copy_failed;
  const PieceJob* last_stepped = nullptr;  // testing::UpdateFault fails after it
  for (const PieceJob& j : jobs)
    if (j.count != 0) last_stepped = &j;
  auto torn = [&](Status error) {
    if (in_place)
      record_failure(FailureOf::kTorn, Status(error.code(), fmt::format("{} (the state is in {}, updated in place)",
                                                                        error.message(), t.describe())));
    return error;
  };
  for (const PieceJob& j : jobs) {
    if (j.count == 0) continue;
    Result<PieceState> opened = t.open(j.id);
    if (!opened.ok()) return torn(opened.status().with_context("opening the optimizer state of " + part.describe(j.id)));
    PieceState st = *opened;
    const size_t me = dtype_size(st.moment_dtype);
    // An error below hands the piece back unmodified (the tier lends it to
    // one thread at a time: Note [Piece leases]); the step's failure goes to
    // the commit point.
    auto fail = [&](Status error) {
      t.close(j.id, false).ignore();
      return error;
    };
    // The piece as its runs of equal hyper-parameters (one run unless the
    // model gives tensors their own weight decay or lr scale).
    for (const PieceJob::Run& run : j.runs) {
      cpu_adam::StateSpans sp;
      sp.count = run.count;
      sp.grads = j.grads + run.offset * grad_bytes;
      sp.grad_dtype = opt.grad_dtype;
      sp.exp_avg = static_cast<std::byte*>(st.exp_avg) + run.offset * me;
      sp.exp_avg_sq = static_cast<std::byte*>(st.exp_avg_sq) + run.offset * me;
      sp.moment_dtype = st.moment_dtype;
      if (j.param_is_master) {
        sp.params = reinterpret_cast<float*>(j.param) + run.offset;
      } else {
        sp.params = st.master + run.offset;
        if (param_dtype != DType::kF32) {
          sp.param_copy = j.param + run.offset * element_bytes;
          sp.param_copy_dtype = param_dtype;
        }
      }
      // H2D of each finished tile while later tiles compute (Note [Exact
      // overlap] in engine.h): queued on update_stream from the tile
      // callback (pinned source: an asynchronous copy), all of them waited
      // for below, before the piece (the copies' source) is handed back; a
      // failed copy is reported after the step.
      std::mutex copy_mutex;
      Status copy_status;
      cpu_adam::TileCallback on_tile;
      if (j.h2d != nullptr) {
        const std::byte* src = param_dtype == DType::kF32 ? reinterpret_cast<const std::byte*>(st.master) : j.param;
        const size_t first = run.offset;
        on_tile = [&, src, first](const cpu_adam::TileRange& tile) {
          const size_t at = (first + tile.begin) * element_bytes;
          std::lock_guard<std::mutex> lock(copy_mutex);  // tiles finish on several threads
          Status c = update_stream->copy_async(j.h2d + at, src + at, tile.count * element_bytes, CopyKind::kHostToDevice);
          if (!c.ok() && copy_status.ok()) copy_status = c;
        };
      }
      cpu_adam::StepArgs run_args = args;
      run_args.hyper = run.hyper;
      Result<cpu_adam::StepReport> rep = o.step(run_args, sp, on_tile);
      if (j.h2d != nullptr) {
        Status copied = update_stream->synchronize();
        if (!copied.ok() && copy_status.ok()) copy_status = copied;
      }
      if (rep.ok() && faults.update && faults.update->step == args.step && faults.update->rank == rank &&
          faults.update->layer == j.id.layer && &t == tier.get() && &j == last_stepped && &run == &j.runs.back())
        rep = Internal("injected kernel failure (testing::UpdateFault)");
      if (!rep.ok())
        return torn(fail(rep.status().with_context(fmt::format("optimizer step of {}", part.describe(j.id)))));
      if (!copy_status.ok()) {
        const Status c =
            copy_status.with_context(fmt::format("copying the update of {} to the device", part.describe(j.id)));
        if (!in_place) return fail(c);
        if (copy_failed.ok()) copy_failed = c;
      }
    }
    if (!j.param_is_master && param_dtype == DType::kF32 && j.h2d == nullptr)
      std::memcpy(j.param, st.master, j.count * sizeof(float));
    if (Status closed = t.close(j.id, true); !closed.ok()) return torn(closed);
  }
  return copy_failed;
}

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
  h2d_bytes = d2h_bytes = gather_bytes = reduce_bytes = 0;
  probes.clear();
  // Blocks until an evaluation's dropped copies are freed, so this step's
  // gathers do not stack on them (the memory plan counts one set).
  STRATA_RETURN_IF_ERROR(live_params->drain());
  io_before = tier->io_stats();
  step_start = mark();
  take_failure(FailureOf::kCall).ignore();  // a late read of the previous call's dropped copies
  ++steps_begun;
  for (Layer& l : layers) l.reduce_launched = false;
  gradient_complete.assign(layers.size(), false);
  for (size_t li = 0; li < layers.size(); ++li) gradient_complete[li] = layers[li].frozen;
  next_reduction = static_cast<int64_t>(layers.size()) - 1;
  progress.scale = scaler->scale();
  phase = Phase::kStep;
  return Status::Ok();
}

Status Engine::Impl::begin_micro_batch(bool last) {
  ++progress.micro;
  progress.last_micro = last;
  progress.in_backward = false;
  for (Layer& l : layers) l.bwd_releases = 0;
  trace->begin_micro_batch();
  progress.micro_started = Clock::now();
  phase = Phase::kMicroBatch;
  return Status::Ok();
}

Status Engine::Impl::end_micro_batch(double mean_loss, int64_t tokens) {
  phase = Phase::kStep;
  // A failed prefetch of a layer this micro-batch did not acquire after all.
  for (size_t li = 0; li < layers.size(); ++li)
    if (Layer& l = layers[li]; !l.prefetch_failure.ok()) {
      Status failed = std::move(l.prefetch_failure);
      l.prefetch_failure = Status::Ok();
      return failed.with_context(fmt::format("layer {} '{}' (not acquired after its prefetch failed) on rank {}", li,
                                             printable(part.layer(li).name, 64), rank));
    }
  if (progress.in_backward) progress.backward_ms += ms_since(progress.backward_started);
  else progress.forward_ms += ms_since(progress.micro_started);  // no backward acquire: all forward
  progress.loss_sum += mean_loss;
  progress.tokens += static_cast<uint64_t>(tokens);
  trace->end_micro_batch();
  if (!progress.last_micro) return Status::Ok();
  // Stage 3 drops gathered copies at the end of a step's last backward (the
  // update will change them); kept ones wait for their last reader.
  for (size_t li = 0; li < layers.size(); ++li) {
    Layer& l = layers[li];
    if (!l.persistent && l.held == 0) STRATA_RETURN_IF_ERROR(drop_gathered(li, l.last_use));
  }
  // Every gradient is complete now, the unused layers' (zero) too.
  return launch_every_reduction();
}

Status Engine::Impl::gradient_completed(size_t li) {
  gradient_complete[li] = true;
  for (; next_reduction >= 0 && gradient_complete[static_cast<size_t>(next_reduction)]; --next_reduction)
    if (!layers[static_cast<size_t>(next_reduction)].reduce_launched)
      STRATA_RETURN_IF_ERROR(launch_reduction(static_cast<size_t>(next_reduction)));
  return Status::Ok();
}

Status Engine::Impl::launch_every_reduction() {
  for (; next_reduction >= 0; --next_reduction)
    if (!layers[static_cast<size_t>(next_reduction)].reduce_launched)
      STRATA_RETURN_IF_ERROR(launch_reduction(static_cast<size_t>(next_reduction)));
  return Status::Ok();
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
  const Mark& call = step_start;
  const double scale = progress.scale;
  const double loss_sum = progress.loss_sum;
  // Blocks, but no longer than the norm below would (it needs every
  // gradient): waiting here first separates backward time from reduction
  // time in the metrics and names the layer whose backward failed.
  const auto tb = Clock::now();
  for (size_t li = 0; li < layers.size(); ++li)
    STRATA_RETURN_IF_ERROR(wait_status(layers[li].last_backward_released, fmt::format("backward of layer {}", li)));
  const double bwd_ms = ms_since(tb);
  const auto tr = Clock::now();
  STRATA_ASSIGN_OR_RETURN(double sum_squares, global_norm_squared());
  // The commit point of the previous step's updates (every rank got here,
  // so all of them ran): committed, or every rank rolls back and this step
  // is dropped with it. Its vote also carries each rank's loss: the loss of
  // the global batch is every rank's micro-batch losses added in rank order
  // (blocks: the step returns this number).
  double loss_all = loss_sum;
  STRATA_RETURN_IF_ERROR(settle(&call, &loss_all));
  const double wait_reduce_ms = ms_since(tr);
  // The previous step's updates are all done here (the commit point waited
  // for them): their time is this step's optimizer_ms with overlap on.
  const double previous_update_ms = update_ns ? static_cast<double>(update_ns->load()) / 1e6 : 0.0;
  update_ns.reset();  // reported once
  StepMetrics m;
  m.loss = loss_all / (static_cast<double>(opt.grad_accum) * world);
  m.loss_scale = scale;
  m.grad_norm = std::sqrt(sum_squares) / scale;
  const bool finite = std::isfinite(sum_squares);
  if (!std::isfinite(m.loss) && opt.fp16.enabled == false)
    return DataLoss(fmt::format("step {}: the loss is {} (not finite); training stopped", optimizer_steps + 1, m.loss));
  if (!finite && !opt.fp16.enabled)
    return DataLoss(fmt::format("step {}: the gradient norm is not finite ({}); training stopped (only fp16 skips "
                                "steps on overflow)",
                                optimizer_steps + 1, m.grad_norm));
  m.skipped = !finite;
  STRATA_RETURN_IF_ERROR(scaler->update(!finite).with_context(fmt::format("step {}", optimizer_steps + 1)));
  m.lr = schedule->lr(optimizer_steps + 1);
  if (finite) {
    ++optimizer_steps;
    const double clip = cpu_adam::clip_coefficient(m.grad_norm, opt.grad_clip);
    cpu_adam::HyperParams hyper = opt.hyper;
    hyper.lr = m.lr;
    // OneCycle with cycle_momentum: beta1 cycles against the lr, beta2 is
    // DeepSpeed's 0.99 (LrSchedule::betas); other schedules keep the config's.
    if (const std::optional<std::array<double, 2>> betas = schedule->betas(optimizer_steps)) {
      hyper.beta1 = (*betas)[0];
      hyper.beta2 = (*betas)[1];
    }
    m.beta1 = hyper.beta1;
    pending = true;
    pending_complete = false;
    pending_mark = call;
    update_ns = std::make_shared<std::atomic<int64_t>>(0);
    for (size_t li = 0; li < layers.size(); ++li) STRATA_RETURN_IF_ERROR(queue_update(li, optimizer_steps, clip, scale, hyper));
    pending_complete = true;
    // strata.overlap_optimizer false: the comparison mode, the step returns
    // only when every update is in place (the blocking is the point), and
    // commits them here: a failed update fails this step.
    if (!opt.overlap_optimizer) {
      for (size_t li = 0; li < layers.size(); ++li) {
        Layer& l = layers[li];
        STRATA_RETURN_IF_ERROR(wait_status(l.persistent ? l.params_ready : l.shard_ready,
                                           fmt::format("the update of layer {} (strata.overlap_optimizer false)", li)));
      }
      STRATA_RETURN_IF_ERROR(settle(nullptr));
    }
  }
  m.step = optimizer_steps;
  m.step_ms = ms_since(t0);
  m.forward_ms = progress.forward_ms;
  m.backward_ms = progress.backward_ms + bwd_ms;
  m.wait_reduce_ms = wait_reduce_ms;
  // Overlap off: this step's updates, done by now. On: they run on while the
  // next step does, so the step's report carries the previous step's.
  m.optimizer_ms = !opt.overlap_optimizer && finite ? static_cast<double>(update_ns->load()) / 1e6 : previous_update_ms;
  for (const auto& p : probes) {
    const int64_t reached = p->reached_ns.load(), upd = p->update_ns.load(), ready = p->ready_ns.load();
    if (reached < 0 || ready < 0) continue;
    const double total = std::max<int64_t>(0, ready - reached) / 1e6;
    const double on_update = upd < 0 ? 0 : std::max<int64_t>(0, std::min(upd, ready) - reached) / 1e6;
    m.wait_optimizer_ms += on_update;
    (p->backward ? m.wait_gather_backward_ms : m.wait_gather_ms) += total - on_update;
  }
  // This rank's tokens times the world size (ranks train equal batches).
  m.tokens_per_s = static_cast<double>(progress.tokens) * world / (m.step_ms / 1e3);
  m.h2d_bytes = h2d_bytes;
  m.d2h_bytes = d2h_bytes;
  m.gather_bytes = gather_bytes;
  m.reduce_bytes = reduce_bytes;
  m.peak_device_bytes = device.memory_stats().get(Tier::kDevice).peak_bytes;
  m.peak_pinned_bytes = stats.get(Tier::kPinnedHost).peak_bytes;
  m.peak_host_bytes = stats.get(Tier::kPageableHost).peak_bytes;
  m.peak_nvme_bytes = stats.get(Tier::kNvme).peak_bytes;
  if (opt_on_nvme()) {
    // The state of this step's updates is read and written by the optimizer
    // thread; with overlap the last layers may still be in flight here, so
    // these count what completed since the previous step began.
    const StateTierIoStats now = tier->io_stats();
    m.nvme_read_bytes = now.bytes_read - io_before.bytes_read;
    m.nvme_write_bytes = now.bytes_written - io_before.bytes_written;
    m.wait_nvme_ms = static_cast<double>((now.read_wait_ns - io_before.read_wait_ns) +
                                         (now.write_wait_ns - io_before.write_wait_ns)) / 1e6;
  }
  return m;
}

Status Engine::Impl::begin_evaluation() {
  // The parameters evaluated are a committed step's.
  STRATA_RETURN_IF_ERROR(settle(nullptr));
  take_failure(FailureOf::kCall).ignore();
  // Blocks until the step's dropped copies are freed, so the evaluation's
  // gathers do not stack on them (the memory plan counts one set).
  STRATA_RETURN_IF_ERROR(live_params->drain());
  phase = Phase::kEvaluation;
  return Status::Ok();
}

Result<double> Engine::Impl::finish_evaluation(double loss_sum, int64_t batches) {
  phase = Phase::kIdle;
  // Stage 3: nothing stays gathered between evaluations.
  for (size_t li = 0; li < layers.size(); ++li)
    if (!layers[li].persistent && layers[li].held == 0)
      STRATA_RETURN_IF_ERROR(drop_gathered(li, layers[li].last_use));
  // The sum, the batches and, beside them, how many ranks' parameter reads
  // failed (a layer gathered from a failed read: the loss is not reported).
  const Status read = take_failure(FailureOf::kCall);
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
