// PieceStepper (piece_stepper.h).
#include "piece_stepper.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "blocked_runs.h"
#include "gradient_spill.h"
#include "strata/offload/device_adam.h"

namespace strata::offload::engine_detail {

// One layer's CPU step: what every piece of it shares.
struct PieceStepper::HostStep {
  OptimizerStateTier& t;
  cpu_adam::CpuOptimizer& o;
  const cpu_adam::StepArgs& args;
  DType param_dtype;
  StatePart part;
  bool out_of_place;
  size_t grad_bytes, element_bytes;
  // A tier that keeps the state in place (pinned host or device memory) has
  // no copy of the previous step: a failure that leaves some of the layer's
  // state stepped and some not is torn (kTorn: the commit point stops the
  // engine, Note [Atomic steps]). A failed copy of the update to the device
  // is not: the kernel goes on, so the state holds the whole step and only
  // the parameters are re-derived.
  bool in_place;
  // An early update of a memory tier writes into the piece's pending buffer
  // (the kernel out of place); a versioned tier's piece is a slot read from
  // NVMe: stepped in place there and written as its pending version
  // (Note [Piece versions] in nvme_state_tier.h).
  bool write_elsewhere;
  const PieceJob* last_stepped = nullptr;  // testing::UpdateFault fails after it
  Status copy_failed;                      // the first failed copy to the device (state in place)
  EngineContext& ctx;

  Status torn(Status error) const {
    if (in_place)
      ctx.failures.record(FailureOf::kTorn,
                          Status(error.code(), fmt::format("{} (the state is in {}, updated in place)", error.message(),
                                                           t.describe())));
    return error;
  }
};

// One piece open in a HostStep: where its state is read (`st`) and where
// the new state goes (`out`: the piece itself, or its pending buffer for an
// early update, Note [Pending versions in memory]).
struct PieceStepper::OpenPiece {
  const PieceJob& j;
  const std::byte* grads;
  PieceState st, out;
  // An error hands the piece back unmodified (the tier lends it to one
  // thread at a time: Note [Piece leases]); the step's failure goes to the
  // commit point.
  Status fail(OptimizerStateTier& t, Status error) const {
    t.close(j.id, false).ignore();
    return error;
  }
};

namespace {

// Note [Gradient shards on NVMe]: a piece's gradient is read back just
// before its step, the next piece's read started meanwhile (when a slot is
// free); a read still in flight when the step ends keeps its slot until it ends.
class SpilledGradients {
 public:
  SpilledGradients(GradientSpill* spill, const std::vector<PieceJob>& jobs) : spill_(spill), jobs_(jobs) {}
  ~SpilledGradients() {
    if (next_) next_->slot.release_after(next_->done);
  }
  SpilledGradients(const SpilledGradients&) = delete;
  SpilledGradients& operator=(const SpilledGradients&) = delete;

  // Job k's gradient (spilled: its grads are null) read back into `read`,
  // waited for; the next spilled job's read started when a slot is free.
  Status read(size_t k, GradientSpill::Read& read) {
    const PieceJob& j = jobs_[k];
    if (next_of_ == &j) {
      read = std::move(*next_);
      next_.reset();
    } else {
      Result<GradientSpill::Read> r = spill_->read(j.id, /*wait=*/true);
      if (!r.ok()) return r.status();
      read = std::move(r).value();
    }
    const auto next = std::find_if(jobs_.begin() + static_cast<std::ptrdiff_t>(k) + 1, jobs_.end(),
                                   [](const PieceJob& n) { return n.count != 0; });
    if (!next_ && next != jobs_.end() && next->grads == nullptr) {
      Result<GradientSpill::Read> r = spill_->read(next->id, /*wait=*/false);
      if (r.ok() && r->slot) {
        next_ = std::move(r).value();
        next_of_ = &*next;
      }
    }
    return spill_->arrived(read, j.id);
  }

 private:
  GradientSpill* spill_;
  const std::vector<PieceJob>& jobs_;
  std::optional<GradientSpill::Read> next_;
  const PieceJob* next_of_ = nullptr;
};

}  // namespace

Status PieceStepper::step(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
                          const cpu_adam::StepArgs& args, DType param_dtype, StatePart part, bool out_of_place) {
  if (ctx_.device_opt() && part == StatePart::kMain) {
    STRATA_CHECK(!out_of_place, "early updates step offloaded state only");
    return step_on_device(t, jobs, args, param_dtype);
  }
  HostStep h{t,
             o,
             args,
             param_dtype,
             part,
             out_of_place,
             dtype_size(ctx_.opt.grad_dtype),
             dtype_size(param_dtype),
             /*in_place=*/!t.versioned() && !out_of_place,
             /*write_elsewhere=*/out_of_place && !t.versioned(),
             nullptr,
             Status::Ok(),
             ctx_};
  for (const PieceJob& j : jobs)
    if (j.count != 0) h.last_stepped = &j;
  SpilledGradients spilled(ctx_.gradient_spill, jobs);
  for (size_t k = 0; k < jobs.size(); ++k) {
    const PieceJob& j = jobs[k];
    if (j.count == 0) continue;
    GradientSpill::Read grads_read;
    const std::byte* piece_grads = j.grads;
    if (j.grads == nullptr) {
      STRATA_RETURN_IF_ERROR(spilled.read(k, grads_read));
      piece_grads = grads_read.slot.as<std::byte>();
    }
    STRATA_RETURN_IF_ERROR(step_piece(h, j, piece_grads));
  }
  return h.copy_failed;
}

Status PieceStepper::step_piece(HostStep& h, const PieceJob& j, const std::byte* grads) {
  OptimizerStateTier& t = h.t;
  Result<PieceState> opened = t.open(j.id);
  if (!opened.ok())
    return h.torn(opened.status().with_context("opening the optimizer state of " + ctx_.part.describe(j.id)));
  OpenPiece p{j, grads, *opened, *opened};
  if (h.write_elsewhere) {
    Result<PieceState> pending = t.open_pending(j.id);
    if (!pending.ok()) {
      t.close(j.id, false).ignore();
      return pending.status().with_context("the pending version of " + ctx_.part.describe(j.id));
    }
    p.out = *pending;
  }
  if (!p.st.moments.blocked()) {
    // The piece as its runs of equal hyper-parameters (one run unless the
    // model gives tensors their own weight decay or lr scale).
    for (const PieceJob::Run& run : j.runs)
      STRATA_RETURN_IF_ERROR(step_range(h, p, run.offset, run.count, run.hyper, &run == &j.runs.back(),
                                        moments_in_piece(h, p, run.offset)));
  } else {
    STRATA_RETURN_IF_ERROR(step_blocked(h, p));
  }
  if (!j.param_is_master && h.param_dtype == DType::kF32 && j.h2d == nullptr)
    std::memcpy(j.param, p.out.master, j.count * sizeof(float));
  if (Status closed = h.out_of_place ? t.close_pending(j.id) : t.close(j.id, true); !closed.ok()) return h.torn(closed);
  return Status::Ok();
}

PieceStepper::PointMoments PieceStepper::moments_in_piece(const HostStep& h, const OpenPiece& p, size_t first) {
  return [&h, &p, first](cpu_adam::StateSpans& sp) {
    p.st.moments.point(sp, p.out.exp_avg, p.out.exp_avg_sq, p.st.count, first);
    if (h.write_elsewhere) p.st.moments.point_source(sp, p.st.exp_avg, p.st.exp_avg_sq, p.st.count, first);
  };
}

Status PieceStepper::step_blocked(HostStep& h, OpenPiece& p) {
  // 8-bit moments: whole blocks of one run through the 8-bit kernel, the
  // blocks a run boundary cuts through fp32 (Note [Runs in 8-bit blocks]).
  const PieceJob& j = p.j;
  const cpu_adam::MomentStorage& moments = p.st.moments;
  const PieceState& st = p.st;
  std::vector<ElementRun> element_runs;
  for (const PieceJob::Run& run : j.runs) element_runs.push_back({run.offset, run.count});
  const BlockedSteps plan = plan_blocked_steps(element_runs, st.count, moments.block_elements());
  const size_t calls = plan.whole.size() + [&] {
    size_t n = 0;
    for (const auto& b : plan.shared) n += b.parts.size();
    return n;
  }();
  size_t call = 0;
  for (const BlockedSteps::Range& r : plan.whole)
    STRATA_RETURN_IF_ERROR(
        step_range(h, p, r.first, r.count, j.runs[r.run].hyper, ++call == calls, moments_in_piece(h, p, r.first)));
  std::vector<float> m, v;
  for (const BlockedSteps::SharedBlock& block : plan.shared) {
    m.resize(block.count);
    v.resize(block.count);
    Status decoded =
        moments.read_fp32(cpu_adam::Int8Moment::kExpAvg, st.exp_avg, st.count, block.first, block.count, m.data());
    if (decoded.ok())
      decoded = moments.read_fp32(cpu_adam::Int8Moment::kExpAvgSq, st.exp_avg_sq, st.count, block.first, block.count,
                                  v.data());
    if (!decoded.ok())
      return h.torn(p.fail(h.t, decoded.with_context(fmt::format("optimizer step of {}", ctx_.part.describe(j.id)))));
    for (const BlockedSteps::Range& part : block.parts) {
      const size_t at = part.first - block.first;
      STRATA_RETURN_IF_ERROR(step_range(h, p, part.first, part.count, j.runs[part.run].hyper, ++call == calls,
                                        [&, at](cpu_adam::StateSpans& sp) {
                                          sp.moment_format = cpu_adam::MomentFormat::kDType;
                                          sp.moment_dtype = DType::kF32;
                                          sp.exp_avg = m.data() + at;
                                          sp.exp_avg_sq = v.data() + at;
                                          if (h.write_elsewhere) {  // decoded already: stepped in place in m and v
                                            sp.exp_avg_source = sp.exp_avg;
                                            sp.exp_avg_sq_source = sp.exp_avg_sq;
                                          }
                                        }));
    }
    Status encoded =
        moments.write_fp32(cpu_adam::Int8Moment::kExpAvg, m.data(), st.count, block.first, block.count, p.out.exp_avg);
    if (encoded.ok())
      encoded = moments.write_fp32(cpu_adam::Int8Moment::kExpAvgSq, v.data(), st.count, block.first, block.count,
                                   p.out.exp_avg_sq);
    if (!encoded.ok())
      return h.torn(p.fail(h.t, encoded.with_context(fmt::format("optimizer step of {}", ctx_.part.describe(j.id)))));
  }
  return Status::Ok();
}

Status PieceStepper::step_range(HostStep& h, OpenPiece& p, size_t first, size_t count,
                                const cpu_adam::HyperParams& hyper, bool last_call, const PointMoments& point_moments) {
  const PieceJob& j = p.j;
  const size_t element_bytes = h.element_bytes;
  cpu_adam::StateSpans sp;
  sp.count = count;
  sp.grads = p.grads + first * h.grad_bytes;
  sp.grad_dtype = ctx_.opt.grad_dtype;
  point_moments(sp);
  if (j.param_is_master) {
    sp.params = reinterpret_cast<float*>(j.param) + first;
  } else {
    sp.params = p.out.master + first;
    if (h.write_elsewhere) sp.params_source = p.st.master + first;
    if (h.param_dtype != DType::kF32) {
      sp.param_copy = j.param + first * element_bytes;
      sp.param_copy_dtype = h.param_dtype;
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
    const std::byte* src = h.param_dtype == DType::kF32 ? reinterpret_cast<const std::byte*>(p.out.master) : j.param;
    on_tile = [&, src, first](const cpu_adam::TileRange& tile) {
      const size_t at = (first + tile.begin) * element_bytes;
      std::lock_guard<std::mutex> lock(copy_mutex);  // tiles finish on several threads
      Status c = update_stream_.copy_async(j.h2d + at, src + at, tile.count * element_bytes, CopyKind::kHostToDevice);
      if (!c.ok() && copy_status.ok()) copy_status = c;
    };
  }
  cpu_adam::StepArgs run_args = h.args;
  run_args.hyper = hyper;
  Result<cpu_adam::StepReport> rep = h.o.step(run_args, sp, on_tile);
  if (j.h2d != nullptr) {
    // Blocks (on the optimizer thread): the shared staging buffer is reused by the next piece, so this
    // piece's values must be on the device first (Note [Update staging]).
    Status copied = update_stream_.synchronize();
    if (!copied.ok() && copy_status.ok()) copy_status = copied;
  }
  if (rep.ok() && h.part == StatePart::kMain && &j == h.last_stepped && last_call)
    if (Status injected = ctx_.faults.update(h.args.step, ctx_.rank, j.id.layer, h.out_of_place); !injected.ok())
      rep = std::move(injected);
  if (!rep.ok())
    return h.torn(
        p.fail(h.t, rep.status().with_context(fmt::format("optimizer step of {}", ctx_.part.describe(j.id)))));
  if (!copy_status.ok()) {
    const Status c =
        copy_status.with_context(fmt::format("copying the update of {} to the device", ctx_.part.describe(j.id)));
    if (!h.in_place) return p.fail(h.t, c);
    if (h.copy_failed.ok()) h.copy_failed = c;
  }
  return Status::Ok();
}

Status PieceStepper::step_on_device(OptimizerStateTier& t, const std::vector<PieceJob>& jobs,
                                    const cpu_adam::StepArgs& args, DType param_dtype) {
  // The fused device kernel: one launch for the layer's pieces, on its
  // stream; this (optimizer) thread waits for it, so the layer's update
  // completes as on the host path.
  DeviceAdamArgs da;
  da.kind = ctx_.opt.optimizer;
  da.step = args.step;
  da.clip_coefficient = args.clip_coefficient;
  da.loss_scale = args.loss_scale;
  da.grad_dtype = ctx_.opt.grad_dtype;
  da.moments = ctx_.opt.moments;  // fp32 or bf16 (int8 was refused at make_memory_state_tier)
  da.param_copy_dtype = param_dtype == DType::kF32 ? DType::kBF16 : param_dtype;
  // One launch per distinct set of hyper-parameters (usually one), over
  // the runs that have it.
  const size_t grad_bytes = dtype_size(ctx_.opt.grad_dtype), me = dtype_size(da.moments.element_dtype()),
               element_bytes = dtype_size(param_dtype);
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
    if (launched.ok()) launched = device_adam_step(*kernel_stream_, da, tensors);
  }
  if (launched.ok()) {
    // Bounded (Note [Bounded waits]): a hung kernel fails the update (torn, below).
    const Completion kernel = kernel_stream_->record_completion();
    launched = kernel.wait_for(ctx_.wait_bound())
                   ? kernel_stream_->synchronize()
                   : DeadlineExceeded(fmt::format("the kernel did not complete in {} s (strata.wait_timeout_s; raise "
                                                  "it if the kernel is only slow)",
                                                  ctx_.opt.wait_timeout_s));
  }
  if (!launched.ok()) {
    for (const PieceJob& j : jobs)
      if (j.count != 0) t.close(j.id, false).ignore();
    // The kernel updates the state in place: how far it got is unknown.
    if (!jobs.empty() && !t.versioned())
      ctx_.failures.record(FailureOf::kTorn,
                           launched.with_context(fmt::format("the device optimizer step of layer {} (the state is in "
                                                             "{}, updated in place)",
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

}  // namespace strata::offload::engine_detail
