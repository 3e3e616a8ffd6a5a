// UpdateScheduler (Note [Update scheduling] in update_scheduler.h).
#include "update_scheduler.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "early_updates.h"
#include "strata/offload/device_adam.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/testing/nvme_state_tier_seam.h"

namespace strata::offload::engine_detail {

UpdateScheduler::UpdateScheduler(EngineContext& ctx, ParameterGathering& params)
    : ctx_(ctx), params_(params), early_(std::make_unique<EarlyUpdates>(ctx, params, *this)) {}

UpdateScheduler::~UpdateScheduler() = default;

void UpdateScheduler::start_timing() {
  update_ns_ = std::make_shared<std::atomic<int64_t>>(early_->take_spent_ns());
}

Status UpdateScheduler::init(const std::string& job_name) {
  const EngineOptions& opt = ctx_.opt;
  Device& device = ctx_.device;
  STRATA_ASSIGN_OR_RETURN(update_stream_, device.create_stream());
  std::unique_ptr<OptimizerStateTier> main, device_part;  // Note [Split optimizer state]
  if (ctx_.opt_on_nvme()) {
    STRATA_ASSIGN_OR_RETURN(main, make_nvme_tier(job_name));
  } else {
    if (ctx_.device_opt()) {
      if (!device_adam_compiled())
        return Unsupported(fmt::format("{}: offload_optimizer none on the {} device needs the device optimizer kernel, "
                                       "which this build does not have; set offload_optimizer.device to \"cpu\"",
                                       opt.source, device.caps().backend));
      if (opt.optimizer != cpu_adam::OptimizerKind::kAdam && opt.optimizer != cpu_adam::OptimizerKind::kAdamW)
        return Unsupported(fmt::format("{}: the device optimizer kernel steps Adam and AdamW only; set "
                                       "offload_optimizer.device to \"cpu\" for {}",
                                       opt.source, cpu_adam::optimizer_kind_name(opt.optimizer)));
      STRATA_ASSIGN_OR_RETURN(opt_stream_, device.create_stream());
    }
    STRATA_ASSIGN_OR_RETURN(main, make_memory_state_tier(device, ctx_.opt_on_host() ? Tier::kPinnedHost : Tier::kDevice,
                                                         opt.moments, ctx_.stats, ctx_.device_opt()));
  }
  // Before any stream is gated (Note [Kernels loaded before any gate]).
  if (ctx_.device_opt() || ctx_.split()) STRATA_RETURN_IF_ERROR(load_device_adam_kernels(*update_stream_));
  if (ctx_.split()) {
    if (opt.moments.blocked())
      return Unsupported(fmt::format("{}: strata.optimizer_state_dtype int8 with offload_optimizer.ratio {} < 1: the "
                                     "device part of the state has no 8-bit kernel; set the ratio to 1 or use bf16 "
                                     "states",
                                     opt.source, opt.ratio));
    STRATA_ASSIGN_OR_RETURN(device_part, make_memory_state_tier(device, Tier::kDevice, opt.moments, ctx_.stats));
  }
  state_.emplace(std::move(main), std::move(device_part));
  stepper_.emplace(ctx_, *update_stream_, opt_stream_.get());
  cpu_adam::OptimizerOptions oo;
  oo.kind = opt.optimizer;
  oo.threads = opt.optimizer_threads;
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer o, cpu_adam::CpuOptimizer::create(oo));
  optimizer_.emplace(std::move(o));
  if (ctx_.split()) {
    STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer d, cpu_adam::CpuOptimizer::create(oo));
    dev_optimizer_.emplace(std::move(d));
  }
  layers_.resize(ctx_.part.layer_count());
  worker_ = std::make_unique<SerialWorker>(fmt::format("optimizer of rank {}", ctx_.rank));
  if (ctx_.split()) dev_worker_ = std::make_unique<SerialWorker>(fmt::format("device optimizer of rank {}", ctx_.rank));
  return Status::Ok();
}

void UpdateScheduler::stop_workers() {
  for (std::unique_ptr<SerialWorker>* w : {&worker_, &dev_worker_})
    if (*w) {
      ctx_.wait_at_teardown((*w)->submit([] { return Status::Ok(); }, {}, "the end of the optimizer thread's queue",
                                         /*sticky=*/false),
                            "the optimizer thread's queued work");
      w->reset();
    }
}

// offload_optimizer nvme: the NVMe tier, its slots sized for the largest
// piece, its capacity for every piece this rank owns, its folder named for
// this run (rank 0's process id, the same on every rank) and rank.
Result<std::unique_ptr<OptimizerStateTier>> UpdateScheduler::make_nvme_tier(const std::string& job_name) {
  const EngineOptions& opt = ctx_.opt;
  uint64_t largest = 0, total = 0;
  for (size_t li = 0; li < ctx_.part.layer_count(); ++li) {
    if (ctx_.where(li).frozen) continue;  // no optimizer state
    const LayerPartition& layer_part = ctx_.part.layer(li);
    const bool master = true;  // the host optimizer keeps fp32 master weights for every dtype
    for (const SubGroup& g : layer_part.groups)
      for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
        const uint64_t b = nvme_piece_bytes(layer_part.piece_real(g, r), master, opt.moments);
        largest = std::max(largest, b);
        total += b;
      }
  }
  NvmeStateTierOptions o;
  o.nvme_paths = {opt.nvme.path};
  o.job = job_name;
  o.rank = ctx_.rank;
  // The state; the tier sizes its swap file for two versions of it, room
  // for uneven pieces and its slots (Note [Piece versions]).
  o.capacity_bytes = total;
  o.aio = opt.nvme.aio;
  o.buffer_count = static_cast<size_t>(opt.nvme.buffer_count);
  o.slot_bytes = std::max<uint64_t>(largest, kNvmeStateAlign);
  o.moments = opt.moments;
  o.pipeline_read = opt.nvme.pipeline_read;
  o.pipeline_write = opt.nvme.pipeline_write;
  o.verify_checksums = opt.nvme.verify_checksums;
  o.wait_timeout_s = opt.wait_timeout_s;
  o.pending_versions = ctx_.placement.early_updates;  // Note [Early, exact updates]
  nvme::IoEngine* given = ctx_.faults.optimizer_io();  // null unless a test's (Note [Testing seam])
  return given != nullptr ? testing::make_nvme_state_tier_on(o, *given, ctx_.device, ctx_.stats)
                          : make_nvme_state_tier(o, ctx_.device, ctx_.stats);
}

Status UpdateScheduler::init_layer(size_t li, const InitialMaster& master) {
  const LayerSpec& spec = ctx_.model.layers()[li];
  const LayerPlacement& where = ctx_.where(li);
  LayerUpdate& l = layers_[li];
  for (const ParamTensorSpec& t : spec.params) {
    const size_t begin = t.offset_elements, end = begin + static_cast<size_t>(t.numel());
    const double decay = t.weight_decay.value_or(ctx_.opt.hyper.weight_decay);
    if (!l.hyper_runs.empty() && l.hyper_runs.back().end == begin && l.hyper_runs.back().weight_decay == decay &&
        l.hyper_runs.back().lr_scale == t.lr_scale)
      l.hyper_runs.back().end = end;
    else
      l.hyper_runs.push_back(HyperRun{begin, end, decay, t.lr_scale});
  }
  if (where.frozen) return Status::Ok();  // parameters only
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const std::string lname = ctx_.layer_label(li);
  if (where.staging == UpdateStaging::kSharedPiece && !shared_staging_ && ctx_.placement.shared_staging_bytes != 0) {
    STRATA_ASSIGN_OR_RETURN(shared_staging_,
                            HostBuffer::create(ctx_.device, ctx_.stats, ctx_.placement.shared_staging_bytes,
                                               "update staging (one piece at a time, shared by the layers)"));
  }
  if (where.staging == UpdateStaging::kLayer) {
    STRATA_ASSIGN_OR_RETURN(l.staging, HostBuffer::create(ctx_.device, ctx_.stats,
                                                          ctx_.owned_elements(layer_part) * where.param_element_bytes,
                                                          "parameter staging of " + lname));
  }
  // A piece's initial master weights: its part of the layer's values, or zeros.
  std::vector<float> zeros;
  auto master_of = [&](size_t begin, size_t count) -> std::span<const float> {
    if (!master.zeros) return master.layer.subspan(begin, count);
    if (zeros.size() < count) zeros.assign(count, 0.0f);
    return std::span<const float>(zeros).first(count);
  };
  // Optimizer state of every owned piece.
  for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    const SubGroup& g = layer_part.groups[gi];
    for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
      const size_t count = layer_part.piece_real(g, r), host = ctx_.host_n(count);
      const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      std::span<const float> host_master;
      if (where.master) host_master = master_of(layer_part.piece_begin(g, r), host);
      STRATA_RETURN_IF_ERROR(state_->main().add(id, ctx_.state_name(li, gi, r), host, host_master));
      early_->add_to_forward_walk(id);
      // Note [Early, exact updates]: where the early update writes.
      if (ctx_.placement.early_updates)
        STRATA_RETURN_IF_ERROR(state_->main().add_pending(id).with_context(ctx_.state_name(li, gi, r)));
      if (ctx_.split()) {
        // The device part: fp32 parameters are their own master there.
        std::span<const float> dev_master;
        if (where.param_dtype != DType::kF32) dev_master = master_of(layer_part.piece_begin(g, r) + host, count - host);
        STRATA_RETURN_IF_ERROR(
            state_->device_part()->add(id, ctx_.state_name(li, gi, r) + " (device part)", count - host, dev_master));
      }
    }
  }
  return Status::Ok();
}

std::vector<PieceJob::Run> UpdateScheduler::runs_of(size_t li, size_t begin, size_t count,
                                                                     const cpu_adam::HyperParams& hyper) const {
  std::vector<PieceJob::Run> out;
  const size_t end = begin + count;
  for (const HyperRun& r : layers_[li].hyper_runs) {
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

std::vector<PieceJob> UpdateScheduler::jobs_of(size_t li, const GradientReduction::UpdateInput& input,
                                                                const cpu_adam::HyperParams& hyper,
                                                                std::vector<PieceJob>* device_jobs, bool early) {
  LayerUpdate& l = layers_[li];
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const LayerPlacement& where = ctx_.where(li);
  const size_t eb = where.param_element_bytes, gb = ctx_.grad_bytes();
  std::vector<PieceJob> host_jobs;
  for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    const SubGroup& g = layer_part.groups[gi];
    for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end(); ++r) {
      const size_t count = layer_part.piece_real(g, r), host = ctx_.host_n(count);
      PieceJob j;
      j.id = StateId{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      j.count = host;
      j.runs = runs_of(li, layer_part.piece_begin(g, r), host, hyper);
      if (!input.on_nvme)
        j.grads = input.grads + (input.padded_layout ? layer_part.piece_begin(g, r) : g.shard_offset) * gb;
      j.param_is_master = !where.master;
      const size_t owned_at = ctx_.owned_offset(layer_part, g, r) * eb;
      switch (where.staging) {
        case UpdateStaging::kNone: j.param = params_.param_location(li, g, r); break;
        case UpdateStaging::kSharedPiece: j.param = shared_staging_.data(); break;
        case UpdateStaging::kLayer: j.param = l.staging.data() + owned_at; break;
        case UpdateStaging::kParameterSlot: j.slot_offset = owned_at; break;  // placed when the update runs
      }
      if (where.staging == UpdateStaging::kSharedPiece || where.staging == UpdateStaging::kLayer) {
        STRATA_CHECK(!early || where.staging == UpdateStaging::kLayer, "an early update keeps its staged values");
        if (early) {
          j.h2d_once_kept = params_.param_location(li, g, r);
        } else {
          j.h2d = params_.param_location(li, g, r);
          ctx_.transfers.h2d_bytes += host * eb;
        }
      }
      host_jobs.push_back(j);
      if (ctx_.split()) {
        // The device part: grads from the device copy, the update straight
        // into the device parameters (fp32: they are the master).
        PieceJob d;
        d.id = j.id;
        d.count = count - host;
        d.runs = runs_of(li, layer_part.piece_begin(g, r) + host, count - host, hyper);
        d.grads = input.device_part_grads + (g.shard_offset + host) * gb;
        d.param = params_.param_location(li, g, r) + host * eb;
        d.param_is_master = where.param_dtype == DType::kF32;
        if (device_jobs != nullptr) device_jobs->push_back(d);
      }
    }
  }
  return host_jobs;
}

Result<UpdateScheduler::Queued> UpdateScheduler::queue_update(size_t li, const GradientReduction::UpdateInput& input,
                                                              int64_t step, double clip, double scale,
                                                              const cpu_adam::HyperParams& hyper) {
  LayerUpdate& l = layers_[li];
  const LayerPlacement& where = ctx_.where(li);
  // Pointers are computed here (driving thread); the workers only step.
  std::vector<PieceJob> dev_jobs;
  std::vector<PieceJob> host_jobs = jobs_of(li, input, hyper, &dev_jobs);
  cpu_adam::StepArgs args;
  args.step = step;
  args.hyper = hyper;  // each run's own lr and weight decay: PieceJob::runs
  args.clip_coefficient = clip;
  args.loss_scale = scale;
  args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
  const DType param_dtype = where.param_dtype;
  const Completion gate = params_.writable_after(li, input.reduced);
  // `raw` fails when the update fails; what later work waits on (the
  // gradients' reuse, the gathers, the next forward) is absorbed: it
  // completes ok either way and the failure goes to the commit point's
  // vote, so every rank runs the same collectives up to it (Note [Atomic
  // steps] in engine.h).
  // Note [Update staging]: a stage-3 shard on NVMe is stepped into a
  // parameter slot the update borrows, and written back from it (the slot
  // returns when the write ends); the write the update started lands here.
  const bool in_slot = where.staging == UpdateStaging::kParameterSlot;
  auto write_back = std::make_shared<Completion>();
  Completion raw = worker_->submit(
      [this, li, in_slot, write_back, jobs = std::move(host_jobs), args, param_dtype, spent = update_ns_]() mutable {
        return step_layer(li, jobs, args, param_dtype, in_slot, /*out_of_place=*/false, *spent, *write_back);
      },
      gate, fmt::format("optimizer step of layer {}", li), /*sticky=*/false);
  if (ctx_.split()) {
    const Completion both[] = {raw, queue_device_part(li, std::move(dev_jobs), args, param_dtype, gate)};
    raw = when_all(both, fmt::format("optimizer step of layer {}", li));
  }
  l.update_ran = ctx_.failures.absorb(raw, fmt::format("optimizer step of layer {}", li));
  // An NVMe shard's updated values are in place once their write-back
  // ends; otherwise they went H2D tile by tile from the optimizer's tile
  // callback (PieceStepper), so they are in place when the update ran.
  l.update_written = raw;
  if (in_slot) {
    auto written = std::make_shared<CompletionSource>(fmt::format("parameter shard of layer {} written", li));
    raw.then([written, write_back](const Status& st) {
      if (!st.ok()) return written->complete(st);
      write_back->then([written](const Status& w) { written->complete(w); });
    });
    l.update_written = written->completion();
  }
  return Queued{l.update_ran, ctx_.failures.absorb(l.update_written, fmt::format("update of layer {}", li))};
}

Status UpdateScheduler::step_layer(size_t li, std::vector<PieceJob>& jobs, const cpu_adam::StepArgs& args,
                                   DType param_dtype, bool in_slot, bool out_of_place, std::atomic<int64_t>& spent,
                                   Completion& write_back) {
  Slot slot;
  if (in_slot) {
    Result<Slot> borrowed = params_.update_slot(li);
    if (!borrowed.ok()) return borrowed.status();
    slot = std::move(borrowed).value();
    for (PieceJob& j : jobs) j.param = slot.as<std::byte>() + j.slot_offset;
  }
  const auto t0 = Clock::now();
  Status st = stepper_->step(state_->main(), *optimizer_, jobs, args, param_dtype, StatePart::kMain, out_of_place);
  spent.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
  if (!out_of_place) ctx_.faults.update_values_queued(li, /*kept=*/false);
  if (st.ok() && in_slot) {
    Result<Completion> written = params_.write_back(li, std::move(slot));
    if (written.ok())
      write_back = std::move(written).value();
    else
      st = written.status();
  }
  return st;  // (a slot not handed to a write returns here: nothing reads it any more)
}

Completion UpdateScheduler::queue_device_part(size_t li, std::vector<PieceJob> jobs, const cpu_adam::StepArgs& args,
                                              DType param_dtype, const Completion& gate) {
  return dev_worker_->submit(
      [this, jobs = std::move(jobs), args, param_dtype] {
        return stepper_->step(*state_->device_part(), *dev_optimizer_, jobs, args, param_dtype, StatePart::kDevicePart,
                              /*out_of_place=*/false);
      },
      gate, fmt::format("device optimizer step of layer {}", li), /*sticky=*/false);
}

Status UpdateScheduler::read_piece_state(size_t li, size_t gi, int r, float* master, float* ea, float* eas) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const SubGroup& g = layer_part.groups[gi];
  const size_t count = layer_part.piece_real(g, r), host = ctx_.host_n(count);
  const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
  auto from = [&](OptimizerStateTier& t, size_t first, size_t n) -> Status {
    if (n == 0) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(PieceState s, t.open(id));
    // Device-tier state is read through the Device (a cuda pointer is not host memory).
    auto fetch = [&](void* dst, const void* src, size_t bytes) -> Status {
      if (t.tier() == Tier::kDevice) return ctx_.device.copy(dst, src, bytes, CopyKind::kDeviceToHost);
      std::memcpy(dst, src, bytes);
      return Status::Ok();
    };
    // The whole moment is read (to host memory first when it is device
    // memory) and converted to fp32.
    auto moment = [&](float* out, const void* src, cpu_adam::Int8Moment which) -> Status {
      if (out == nullptr) return Status::Ok();
      if (t.tier() != Tier::kDevice) return s.moments.read_fp32(which, src, n, 0, n, out + first);
      std::vector<std::byte> host_copy(s.moments.moment_bytes(n));
      STRATA_RETURN_IF_ERROR(fetch(host_copy.data(), src, host_copy.size()));
      return s.moments.read_fp32(which, host_copy.data(), n, 0, n, out + first);
    };
    Status st = Status::Ok();
    if (master != nullptr) {
      if (s.master != nullptr)
        st = fetch(master + first, s.master, n * sizeof(float));
      else  // fp32 parameters are their own master, in device memory
        st = ctx_.device.copy(master + first, params_.param_location(li, g, r) + first * ctx_.where(li).param_element_bytes, n * ctx_.where(li).param_element_bytes, CopyKind::kDeviceToHost);
    }
    if (st.ok()) st = moment(ea, s.exp_avg, cpu_adam::Int8Moment::kExpAvg);
    if (st.ok()) st = moment(eas, s.exp_avg_sq, cpu_adam::Int8Moment::kExpAvgSq);
    const Status closed = t.close(id, false);
    return st.ok() ? closed : st;
  };
  STRATA_RETURN_IF_ERROR(from(state_->main(), 0, host));
  if (ctx_.split()) STRATA_RETURN_IF_ERROR(from(*state_->device_part(), host, count - host));
  return Status::Ok();
}

Status UpdateScheduler::write_piece_state(size_t li, size_t gi, int r, const float* master, const float* ea,
                                       const float* eas) {
  const LayerPartition& layer_part = ctx_.part.layer(li);
  const SubGroup& g = layer_part.groups[gi];
  const size_t count = layer_part.piece_real(g, r), host = ctx_.host_n(count);
  const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
  auto into = [&](OptimizerStateTier& t, size_t first, size_t n) -> Status {
    if (n == 0) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(PieceState s, t.open(id));
    auto put = [&](void* dst, const void* src, size_t bytes) -> Status {
      if (t.tier() == Tier::kDevice) return ctx_.device.copy(dst, src, bytes, CopyKind::kHostToDevice);
      std::memcpy(dst, src, bytes);
      return Status::Ok();
    };
    // Encoded in host memory (in place unless the tier is device memory).
    auto moment = [&](void* dst, const float* in, cpu_adam::Int8Moment which) -> Status {
      if (t.tier() != Tier::kDevice) return s.moments.write_fp32(which, in + first, n, 0, n, dst);
      std::vector<std::byte> host_copy(s.moments.moment_bytes(n));
      STRATA_RETURN_IF_ERROR(s.moments.write_fp32(which, in + first, n, 0, n, host_copy.data()));
      return put(dst, host_copy.data(), host_copy.size());
    };
    // Without a master the parameters are the master: load_checkpoint wrote them.
    Status st = s.master != nullptr ? put(s.master, master + first, n * sizeof(float)) : Status::Ok();
    if (st.ok()) st = moment(s.exp_avg, ea, cpu_adam::Int8Moment::kExpAvg);
    if (st.ok()) st = moment(s.exp_avg_sq, eas, cpu_adam::Int8Moment::kExpAvgSq);
    const Status closed = t.close(id, true);
    return st.ok() ? closed : st;
  };
  STRATA_RETURN_IF_ERROR(into(state_->main(), 0, host));
  if (ctx_.split()) STRATA_RETURN_IF_ERROR(into(*state_->device_part(), host, count - host));
  return Status::Ok();
}

}  // namespace strata::offload::engine_detail
