// The ZeRO engine (engine.h): set-up (the memory plan, the partition, every
// layer's state) and the public methods. The provider hooks are in
// engine_passes.cpp, the step in engine_step.cpp, the shared state in
// engine_impl.h.
#include "engine_impl.h"
#include "early_updates.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"

namespace strata::offload {
namespace {

// The engine's streams that carry its own copies and memsets, with what each
// carries (for the waits that drain them: teardown and synchronize()).
struct OwnStream {
  Stream* stream;  // null before init() made it
  const char* what;
};
std::array<OwnStream, 3> own_streams(const EngineContext& m) {
  return {{{m.xfer.get(), "the engine's copies"},
           {m.zeroing.get(), "the zeroing of gradient buffers"},
           {m.shard_h2d.get(), "the copies of parameter shards to the device"}}};
}

// EngineOptions::job_name: a folder name of its own once the swap stores add their suffixes.
Status check_swap_job_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 48 && name != "." && name != "..";
  for (const char c : name)
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  if (ok) return Status::Ok();
  return InvalidArgument(fmt::format("the swap folders' job name '{}' is not 1-48 characters of A-Z a-z 0-9 . _ -",
                                     printable(name, 64)));
}

// The options init() checks before anything is made (the placement's own
// checks first).
Status check_training_options(const EngineOptions& opt) {
  STRATA_RETURN_IF_ERROR(check_placement(opt));
  if (opt.grad_accum < 1)
    return InvalidArgument(fmt::format("{}: gradient_accumulation_steps {} must be >= 1", opt.source, opt.grad_accum));
  if (!(opt.grad_clip >= 0.0) || !std::isfinite(opt.grad_clip))
    return InvalidArgument(fmt::format("{}: gradient_clipping {} must be finite and >= 0", opt.source, opt.grad_clip));
  if (!is_state_float(opt.grad_dtype))
    return InvalidArgument(fmt::format("{}: gradient dtype {} is not fp32, bf16 or fp16", opt.source,
                                       dtype_name(opt.grad_dtype)));
  if (opt.prefetch_bucket_size < 0 || opt.max_live_parameters < 0 || opt.max_reuse_distance < 0 ||
      opt.persistence_threshold < 0 || opt.reduce_bucket_size < 1)
    return InvalidArgument(fmt::format("{}: stage-3 sizes and reduce_bucket_size must not be negative", opt.source));
  return cpu_adam::validate_hyper_params(opt.optimizer, opt.hyper);
}

// A plan above the device's free memory: the first move down this ladder
// that the placement has not taken yet, each freeing more device memory.
const char* device_memory_advice(const StatePlacement& placement) {
  const std::pair<bool, const char*> ladder[] = {
      {placement.optimizer_on_host(), "set zero_optimization.offload_optimizer.device to \"cpu\""},
      {placement.params_sharded(), "use zero_optimization.stage 3"},
      {placement.param_shards_off_device(), "set zero_optimization.offload_param.device to \"cpu\""}};
  for (const auto& [taken, advice] : ladder)
    if (!taken) return advice;
  return "lower stage3_max_live_parameters / reduce_bucket_size";
}

// What shrinks the gradient shards' pinned memory, by where they wait.
const char* gradient_shards_advice(const StatePlacement& placement) {
  if (placement.gradient_slot_count == 0) {
    // In host memory; NVMe is at hand when the state or the parameter shards use it.
    if (placement.optimizer_on_nvme() || (placement.param_shards_use_nvme() && !placement.split))
      return "gradient shards: set strata.gradient_shards nvme (they wait on NVMe in the optimizer state's "
             "or the parameter shards' folder), use a larger world size or data_types.grad_accum_dtype bf16";
    return "gradient shards: use a larger world size or data_types.grad_accum_dtype bf16";
  }
  if (placement.gradient_folder == StatePlacement::GradientFolder::kOptimizerState)
    return "gradient shards' NVMe slots: lower zero_optimization.sub_group_size (a slot holds one piece's "
           "gradient) or offload_optimizer.buffer_count";
  return "gradient shards' NVMe slots: lower zero_optimization.sub_group_size (a slot holds one piece's "
         "gradient) or offload_param.buffer_count";
}

// A plan above the host budget: what shrinks or moves the largest pinned
// part (the first of equals), for this placement.
const char* pinned_memory_advice(const StatePlacement& placement, const EngineMemory& predicted) {
  const std::pair<uint64_t, const char*> parts[] = {
      {predicted.pinned_optimizer,
       placement.optimizer_on_nvme()
           ? "optimizer state's NVMe slots: lower zero_optimization.offload_optimizer.buffer_count or "
             "sub_group_size (a slot holds one sub-group's piece)"
           : "optimizer state (master weights and moments): set offload_optimizer.device to nvme, or use "
             "offload_optimizer.ratio < 1 at stage 3, or strata.optimizer_state_dtype int8 or bf16"},
      {predicted.pinned_grads, gradient_shards_advice(placement)},
      {predicted.pinned_staging,
       placement.early_updates ? "update staging (one buffer per layer for the early updates): set "
                                 "strata.speculative_optimizer off or auto"
                               : "update staging (one piece at a time): lower zero_optimization.sub_group_size"},
      {predicted.pinned_params,
       placement.param_shards_use_nvme()
           ? "parameter shards in host memory and NVMe slots: lower offload_param.max_in_cpu or buffer_count"
           : "parameter shards (offload_param cpu): set offload_param.device to nvme or none"},
      {predicted.pinned_speculation,
       "pending versions of the state for the early updates: set strata.speculative_optimizer to auto (off when it "
       "does not fit) or off"}};
  const auto* largest = &parts[0];
  for (const auto& p : parts)
    if (p.first > largest->first) largest = &p;
  return largest->second;
}

}  // namespace

EngineMemory Engine::Impl::plan() const { return plan_engine_memory(opt, part, placement); }

// ---------------------------------------------------------------- set-up

Status Engine::Impl::init() {
  STRATA_RETURN_IF_ERROR(check_training_options(opt));
  STRATA_ASSIGN_OR_RETURN(LrSchedule s, LrSchedule::create(opt.scheduler, opt.hyper.lr, opt.source));
  schedule.emplace(std::move(s));
  STRATA_ASSIGN_OR_RETURN(LossScaler ls, LossScaler::create(opt.fp16, opt.source));
  scaler.emplace(std::move(ls));
  STRATA_RETURN_IF_ERROR(place_state());
  if (opt_on_nvme() || placement.param_shards_use_nvme()) {
    STRATA_ASSIGN_OR_RETURN(job_name, agree_swap_job_name());
  }
  STRATA_RETURN_IF_ERROR(init_components());
  // The plan first: a config whose state cannot fit the device fails here,
  // before anything is allocated, with the plan's row and the fix.
  predicted = plan();
  STRATA_RETURN_IF_ERROR(check_plan_fits_device());
  STRATA_RETURN_IF_ERROR(check_plan_fits_host_budget());
  return init_layers();
}

// The partition, where every kind of state lives, and the engine's streams.
Status Engine::Impl::place_state() {
  STRATA_ASSIGN_OR_RETURN(part, Partition::create(model.layers(), world, opt.sub_group_size));
  STRATA_ASSIGN_OR_RETURN(placement, StatePlacement::compute(opt, model.layers(), part, rank,
                                                             PlannedDevice::of(device.caps())));
  STRATA_ASSIGN_OR_RETURN(xfer, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(frees, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(zeroing, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(shard_h2d, device.create_stream());
  return Status::Ok();
}

// The swap folders' run name: the caller's, else rank 0's process id (the same on every rank).
Result<std::string> Engine::Impl::agree_swap_job_name() {
  if (!opt.job_name.empty()) STRATA_RETURN_IF_ERROR(check_swap_job_name(opt.job_name));
  int64_t job = static_cast<int64_t>(::getpid()), job0 = 0;
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, &job, sizeof(job), &job0, sizeof(job0),
      [&](const void* s, void* r) { return comm.broadcast(s, r, 1, DType::kI64, 0, comm::CommQueue::kReduce); },
      "agreeing on the swap folders' name"));
  return opt.job_name.empty() ? fmt::format("train-{}", job0) : opt.job_name;
}

// The components, each built on the ones before it.
Status Engine::Impl::init_components() {
  STRATA_RETURN_IF_ERROR(params.init(job_name));
  STRATA_RETURN_IF_ERROR(updates.init(job_name));
  if (placement.gradient_slot_count != 0) {
    STRATA_ASSIGN_OR_RETURN(gradient_spill_owner, GradientSpill::create(*this, job_name));
    gradient_spill = gradient_spill_owner.get();
  }
  grads.init();  // the block sums run on the optimizer thread
  if (runner != nullptr) model_stream = runner->model_stream();
  return Status::Ok();
}

// The plan's device memory against what the device has free after the model's own buffers.
Status Engine::Impl::check_plan_fits_device() const {
  const uint64_t cap = device.caps().memory_bytes;
  const uint64_t used = device.memory_stats().get(Tier::kDevice).current_bytes;
  const uint64_t free_bytes = cap > used ? cap - used : 0;
  if (cap == 0 || predicted.device <= free_bytes) return Status::Ok();
  return OutOfMemory(fmt::format(
      "stage {}, optimizer {}, params {} on {} rank(s) needs {} of device memory per rank for its training state "
      "(parameters {}, gradients {}, optimizer state {}, gathered layers {}) but {} of the device's {} is free after "
      "the model's own buffers; {} or raise --device-memory (strata.device_memory)",
      opt.stage, offload_device_name(opt.offload_optimizer), offload_device_name(opt.offload_param), world,
      format_bytes(predicted.device, true), format_bytes(predicted.device_params, true),
      format_bytes(predicted.device_grads, true), format_bytes(predicted.device_optimizer, true),
      format_bytes(predicted.device_gathered, true), format_bytes(free_bytes, true), format_bytes(cap, true),
      device_memory_advice(placement)));
}

// The plan's pinned memory against this rank's share of strata.host_memory_budget,
// naming the largest host buffer: that is the one to shrink or move.
Status Engine::Impl::check_plan_fits_host_budget() const {
  if (opt.host_memory_budget == 0 || predicted.pinned <= opt.host_memory_budget) return Status::Ok();
  return ResourceExhausted(fmt::format(
      "{}: this rank's host tier needs {} of pinned memory (optimizer state {}, gradient shards {}, staging {}, "
      "parameter shards {}{}) but its share of strata.host_memory_budget is {}; the largest is the {}",
      opt.source, format_bytes(predicted.pinned, true), format_bytes(predicted.pinned_optimizer, true),
      format_bytes(predicted.pinned_grads, true), format_bytes(predicted.pinned_staging, true),
      format_bytes(predicted.pinned_params, true),
      predicted.pinned_speculation != 0
          ? ", early updates' pending state " + format_bytes(predicted.pinned_speculation, true)
          : std::string(),
      format_bytes(opt.host_memory_budget, true), pinned_memory_advice(placement, predicted)));
}

// Every layer's state, then the initial optimizer state written (NVMe tier)
// before the first step reads it.
Status Engine::Impl::init_layers() {
  const size_t n = model.layers().size();
  initialized.assign(n, model.provides_initial_values());
  for (size_t i = 0; i < n; ++i) STRATA_RETURN_IF_ERROR(init_layer(i));
  updates.early().read_ahead_for_first_step(placement.early_updates && speculate_next_step);
  return updates.flush_state().with_context("writing the initial optimizer state");
}

// Layer li's state, from the model's initial values (rounded to the
// declared dtype, and fp32 for masters), where the placement puts it.
Status Engine::Impl::init_layer(size_t li) {
  const LayerSpec& spec = model.layers()[li];
  const LayerPartition& layer_part = part.layer(li);
  const LayerPlacement& layer_where = where(li);
  if (!model.provides_initial_values()) {
    // Zeros until put_initial_layer hands the values in: made a piece (or a
    // shard) at a time, not as layer-sized host copies (measured: two fp32
    // copies of the largest layer were most of engine creation's peak).
    STRATA_RETURN_IF_ERROR(params.init_layer(li, nullptr));
    STRATA_RETURN_IF_ERROR(grads.init_layer(li));
    return updates.init_layer(li, UpdateScheduler::InitialMaster{.layer = {}, .zeros = layer_where.master});
  }
  std::vector<std::byte> init(layer_part.padded_elements * layer_where.param_element_bytes, std::byte{0});
  STRATA_RETURN_IF_ERROR(model.init_layer(li, std::span<std::byte>(init.data(), spec.param_bytes)));
  std::vector<float> init32;
  if (layer_where.master) {
    init32.assign(layer_part.padded_elements, 0.0f);
    STRATA_RETURN_IF_ERROR(model.init_layer_fp32(li, std::span<float>(init32.data(), spec.param_count)));
  }
  STRATA_RETURN_IF_ERROR(params.init_layer(li, init.data()));
  STRATA_RETURN_IF_ERROR(grads.init_layer(li));
  return updates.init_layer(li, UpdateScheduler::InitialMaster{.layer = init32});
}

// A SpecModel's initial values, handed in layer by layer (engine.h): this
// rank's pieces only, written where the placement keeps them; the moments
// start at zero, as for a model that provides its own values.
Status Engine::Impl::put_initial_layer(size_t li, std::span<const std::byte> values, std::span<const float> fp32) {
  const LayerSpec& spec = model.layers()[li];
  const LayerPartition& layer_part = part.layer(li);
  const LayerPlacement& layer_where = where(li);
  const std::string lname = layer_label(li);
  if (layer_where.persistent()) {
    std::vector<std::byte> padded(layer_part.padded_elements * layer_where.param_element_bytes, std::byte{0});
    std::memcpy(padded.data(), values.data(), spec.param_bytes);
    STRATA_RETURN_IF_ERROR(params.write_whole(li, padded).with_context("writing the initial parameters of " + lname));
  } else {
    // This rank's shard straight from the values (no padded copy of the whole layer first).
    STRATA_RETURN_IF_ERROR(params.replace_shard_from_layer(li, values.first(spec.param_bytes))
                               .with_context("writing the initial parameter shard of " + lname));
  }
  if (!layer_where.frozen) {
    // The master weights, a piece at a time (a whole layer's fp32 copy would
    // be one more transient the size of the largest layer): the fp32 values
    // given, else the parameters widened. A piece's real elements lie within
    // the layer's (piece_real), and Engine::put_initial_layer checked the sizes.
    std::vector<float> master;
    std::vector<float> zeros;
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const SubGroup& g = layer_part.groups[gi];
      for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
        const size_t n = layer_part.piece_real(g, r);
        if (n == 0) continue;
        const size_t begin = layer_part.piece_begin(g, r);
        master.resize(n);
        if (!fp32.empty())
          std::copy_n(fp32.begin() + static_cast<std::ptrdiff_t>(begin), n, master.begin());
        else
          params_to_fp32(layer_where.param_dtype, values.data() + begin * layer_where.param_element_bytes,
                         master.data(), n);
        zeros.assign(n, 0.0f);
        STRATA_RETURN_IF_ERROR(updates.write_piece_state(li, gi, r, master.data(), zeros.data(), zeros.data())
                                   .with_context("writing the initial optimizer state of " + lname));
      }
    }
    // The written state is the committed one (Note [Piece versions]).
    STRATA_RETURN_IF_ERROR(updates.commit_state().with_context("writing the initial optimizer state of " + lname));
  }
  initialized[li] = true;
  return Status::Ok();
}

// ---------------------------------------------------------------- Engine

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_) {
    // Everything that may still use the engine's buffers finishes before
    // they are freed, in this order (each waits only on work that runs by
    // itself on other threads, so none can wait for a later one; each is
    // bounded, Note [Bounded waits]: past the bound it says on stderr what it
    // waits for, then waits on):
    Impl& m = *impl_;
    // the model's stream (a step that failed half-way may still run),
    if (m.model_stream) {
      m.wait_at_teardown(m.model_stream->record_completion(), "the model's stream");
      m.model_stream->synchronize().ignore();
    }
    // the gradient shards' writes to NVMe (each waits only for its reduction and its I/O),
    if (m.gradient_spill_owner) m.gradient_spill_owner->stop();
    // the optimizer threads (they run what is queued; the state they step is still alive),
    m.updates.stop_workers();
    // the updates' parameter write-backs to NVMe (stage 3, offload_param
    // nvme): the optimizer thread started them; each one's continuation runs
    // on an I/O thread when it completes, and a failed one records its error
    // in this engine's StepFailures (in the context, destroyed after
    // the components). A layer's shard_ready completes after that continuation,
    // so none is left once every layer's has (the layers set up: an init
    // that failed part-way leaves fewer, or none),
    for (size_t li = 0; li < m.updates.layer_count(); ++li)
      m.wait_at_teardown(m.updates.layer(li).update_written, "a layer's update");
    for (size_t li = 0; li < m.params.layer_count(); ++li)
      m.wait_at_teardown(m.params.layer(li).shard_ready, "a layer's parameter shard write-back");
    // the shard reader (its reads are gated on those write-backs and record
    // a failed read in this engine),
    m.params.stop_reader();
    // the checkpoint save in flight (its snapshot was taken: it only writes
    // files; rank 0 does not wait for peers that may have failed),
    m.checkpoints.abandon_save();
    m.checkpoints.wait_save().status().ignore();
    // then the copies, memsets and collectives lent those buffers.
    for (const OwnStream& s : own_streams(m))
      if (s.stream != nullptr) {
        m.wait_at_teardown(s.stream->record_completion(), s.what);
        s.stream->synchronize().ignore();
      }
    m.comm.synchronize().ignore();
  }
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, ModelRunner& runner, Device& device,
                                               comm::Communicator& comm) {
  return create_with_faults(options, &runner, runner.model(), device, comm, nullptr, nullptr);
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, const LayeredModel& model,
                                               Device& device, comm::Communicator& comm, Stream* model_stream) {
  return create_with_faults(options, nullptr, model, device, comm, model_stream, nullptr);
}

Result<std::unique_ptr<Engine>> Engine::create_with_faults(const EngineOptions& options, ModelRunner* runner,
                                                           const LayeredModel& model, Device& device,
                                                           comm::Communicator& comm, Stream* model_stream,
                                                           const testing::EngineFaults* faults) {
  auto impl = std::make_unique<Impl>(options, runner, model, device, comm);
  impl->model_stream = model_stream;
  if (faults != nullptr) impl->faults = FaultHooks(*faults);  // before init(): the NVMe tiers open through its I/O engines
  std::unique_ptr<Engine> e(new Engine(std::move(impl)));
  e->impl_->self = e.get();
  STRATA_RETURN_IF_ERROR(e->impl_->init().with_context(fmt::format("engine on rank {}", comm.rank())));
  return e;
}

const char* step_outcome_name(StepOutcomeKind kind) {
  switch (kind) {
    case StepOutcomeKind::kApplied: return "applied";
    case StepOutcomeKind::kRolledBack: return "rolled back";
    case StepOutcomeKind::kDropped: return "dropped";
  }
  return "?";
}

Result<StepMetrics> Engine::step() {
  if (!impl_->stopped.ok()) return impl_->stopped;
  if (!impl_->load_failed.ok()) return impl_->load_failed;  // Note [A failed load]
  if (impl_->runner == nullptr)
    return FailedPrecondition("Engine::step() drives a ModelRunner and this engine was created without one; drive it "
                              "with begin_step(), begin_micro_batch(), end_micro_batch() and finish_step()");
  STRATA_RETURN_IF_ERROR(impl_->expect_phase(Impl::Phase::kIdle, "step()"));
  STRATA_RETURN_IF_ERROR(impl_->expect_initialized());
  Result<StepMetrics> r = impl_->step();
  if (!r.ok()) return impl_->stop_unless_recovered(r.status());
  return r;
}

// The caller-driven calls (Note [Driving the engine]): a call out of order
// is the caller's mistake and leaves the engine as it was; an error of the
// work itself stops the engine unless it came with a rollback.
Status Engine::put_initial_layer(size_t layer_index, std::span<const std::byte> params, std::span<const float> fp32) {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kIdle, "put_initial_layer()"));
  if (layer_index >= m.part.layer_count())
    return InvalidArgument(fmt::format("put_initial_layer(): layer {} is out of range (the model has {} layers)",
                                       layer_index, m.part.layer_count()));
  const LayerSpec& spec = m.model.layers()[layer_index];
  const std::string lname = fmt::format("layer {} '{}'", layer_index, printable(spec.name, 64));
  if (m.steps_begun != 0 || m.optimizer_steps != 0)
    return FailedPrecondition(fmt::format("put_initial_layer() of {}: training has begun ({} step(s)); initial "
                                          "values go in before the first step",
                                          lname, m.steps_begun));
  if (params.size() != spec.param_bytes)
    return InvalidArgument(fmt::format("put_initial_layer() of {}: {} bytes given, the layer has {} ({} elements of {})",
                                       lname, params.size(), spec.param_bytes, spec.param_count,
                                       dtype_name(m.where(layer_index).param_dtype)));
  if (!fp32.empty() && fp32.size() != spec.param_count)
    return InvalidArgument(fmt::format("put_initial_layer() of {}: {} fp32 values given, the layer has {} elements",
                                       lname, fp32.size(), spec.param_count));
  Status st = m.put_initial_layer(layer_index, params, fp32);
  return st.ok() ? st : m.stop_unless_recovered(std::move(st));
}

Status Engine::begin_step() {
  if (!impl_->stopped.ok()) return impl_->stopped;
  if (!impl_->load_failed.ok()) return impl_->load_failed;  // Note [A failed load]
  STRATA_RETURN_IF_ERROR(impl_->expect_phase(Impl::Phase::kIdle, "begin_step()"));
  STRATA_RETURN_IF_ERROR(impl_->expect_initialized());
  Status st = impl_->begin_step();
  return st.ok() ? st : impl_->stop_unless_recovered(std::move(st));
}

double Engine::gradient_scale() const { return impl_->gradient_scale(); }

Status Engine::begin_micro_batch(bool last) {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kStep, "begin_micro_batch()"));
  if (m.progress.micro >= m.opt.grad_accum)
    return FailedPrecondition(fmt::format("begin_micro_batch(): this step already had its {} micro-batch(es) "
                                          "(gradient_accumulation_steps); call finish_step()",
                                          m.opt.grad_accum));
  const bool final_one = m.progress.micro + 1 == m.opt.grad_accum;
  if (last != final_one)
    return InvalidArgument(fmt::format("begin_micro_batch(last={}) for micro-batch {} of {} "
                                       "(gradient_accumulation_steps): last must be true on the final one only",
                                       last, m.progress.micro + 1, m.opt.grad_accum));
  return m.begin_micro_batch(last);
}

Status Engine::end_micro_batch(double mean_loss, int64_t tokens) {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kMicroBatch, "end_micro_batch()"));
  if (tokens < 0)
    return InvalidArgument(fmt::format("end_micro_batch(): tokens {} must not be negative", tokens));
  Status st = m.end_micro_batch(mean_loss, tokens);
  return st.ok() ? st : m.stop_unless_recovered(std::move(st));
}

Result<StepOutcome> Engine::finish_step() {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kStep, "finish_step()"));
  if (m.progress.micro != m.opt.grad_accum)
    return FailedPrecondition(fmt::format("finish_step() after {} of {} micro-batch(es) "
                                          "(gradient_accumulation_steps); the last one is begun with "
                                          "begin_micro_batch(true)",
                                          m.progress.micro, m.opt.grad_accum));
  Result<StepOutcome> r = m.finish_step();
  if (!r.ok()) return m.stop_unless_recovered(r.status());
  return r;
}

Status Engine::abandon_step() {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  if (m.phase != Impl::Phase::kStep && m.phase != Impl::Phase::kMicroBatch)
    return FailedPrecondition(fmt::format(
        "abandon_step() was called {} on rank {}; it drops a step begun with begin_step() and not finished",
        Impl::phase_name(m.phase), m.rank));
  Status st = m.abandon_step();
  return st.ok() ? st : m.stop_unless_recovered(std::move(st));
}

Status Engine::begin_evaluation() {
  if (!impl_->stopped.ok()) return impl_->stopped;
  STRATA_RETURN_IF_ERROR(impl_->expect_phase(Impl::Phase::kIdle, "begin_evaluation()"));
  Status st = impl_->begin_evaluation();
  return st.ok() ? st : impl_->stop_unless_recovered(std::move(st));
}

Result<double> Engine::finish_evaluation(double loss_sum, int64_t batches) {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kEvaluation, "finish_evaluation()"));
  if (batches < 0)
    return InvalidArgument(fmt::format("finish_evaluation(): batches {} must not be negative", batches));
  Result<double> r = m.finish_evaluation(loss_sum, batches);
  if (!r.ok()) return m.stop_unless_recovered(r.status());
  return r;
}

Status Engine::stopped() const { return impl_->stopped; }

Engine::Phase Engine::phase() const { return impl_->phase; }

Result<int> Engine::layer_holds(size_t layer_index) const {
  if (layer_index >= impl_->part.layer_count())
    return InvalidArgument(fmt::format("layer_holds({}): the model has {} layers", layer_index,
                                       impl_->part.layer_count()));
  return impl_->params.holds(layer_index);
}

Result<double> Engine::evaluate() {
  if (!impl_->stopped.ok()) return impl_->stopped;
  if (!impl_->load_failed.ok()) return impl_->load_failed;  // Note [A failed load]
  if (impl_->runner == nullptr)
    return FailedPrecondition("Engine::evaluate() runs a ModelRunner's evaluation batches and this engine was created "
                              "without one; use begin_evaluation() and finish_evaluation()");
  STRATA_RETURN_IF_ERROR(impl_->expect_phase(Impl::Phase::kIdle, "evaluate()"));
  Result<double> r = impl_->evaluate();
  if (!r.ok()) return impl_->stop_unless_recovered(r.status());
  return r;
}

// Blocks by design: the caller asked for every queued update to be in place
// (end of training, before reading state with gather_state, a checkpoint)
// and committed (a collective with several ranks: Note [Atomic steps]).
Status Engine::synchronize() {
  Impl& m = *impl_;
  if (!m.stopped.ok()) return m.stopped;
  STRATA_RETURN_IF_ERROR(m.expect_phase(Impl::Phase::kIdle, "synchronize()"));
  Status st = m.commit.settle(nullptr);
  if (!st.ok()) return m.stop_unless_recovered(std::move(st));
  for (size_t li = 0; li < m.part.layer_count(); ++li) {
    const std::string what = fmt::format("synchronize(): the parameters of layer {}", li);
    STRATA_RETURN_IF_ERROR(m.wait_status(m.params.layer(li).params_ready, what));
    STRATA_RETURN_IF_ERROR(m.wait_status(m.params.layer(li).shard_ready, what));
  }
  // The caller reads state next (its contract, above): every copy and memset done, errors reported.
  for (const OwnStream& s : own_streams(m)) {
    STRATA_RETURN_IF_ERROR(m.wait_status(s.stream->record_completion(), fmt::format("synchronize(): {}", s.what)));
    STRATA_RETURN_IF_ERROR(s.stream->synchronize());
  }
  STRATA_RETURN_IF_ERROR(m.updates.flush_state());  // NVMe: every write-back durable, errors reported
  return m.comm.synchronize();
}

Result<LayerMemory> Engine::acquire(size_t layer_index, Pass pass) { return impl_->acquire(layer_index, pass); }
Status Engine::release(size_t layer_index, Pass pass, const Completion& done) {
  return impl_->release(layer_index, pass, done);
}
Status Engine::release(size_t layer_index, Pass pass, const Completion& done, const Completion& memory_returned) {
  return impl_->release(layer_index, pass, done, memory_returned);
}

const EngineOptions& Engine::options() const { return impl_->opt; }
const Partition& Engine::partition() const { return impl_->part; }
const StatePlacement& Engine::placement() const { return impl_->placement; }

Status Engine::set_step_lr(double lr) {
  if (!std::isfinite(lr) || lr < 0 || lr > 1000)
    return InvalidArgument(fmt::format("set_step_lr({}): the lr must be finite and in [0, 1000]", lr));
  impl_->caller_lr = lr;
  return Status::Ok();
}
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
int64_t Engine::optimizer_steps() const { return impl_->optimizer_steps; }

double Engine::loss_scale() const { return impl_->scaler->scale(); }
EngineMemory Engine::predicted_memory() const { return impl_->predicted; }
uint64_t Engine::model_state_bytes() const {
  const Impl& m = *impl_;
  uint64_t total = 0;
  for (size_t li = 0; li < m.part.layer_count(); ++li) {
    const uint64_t n = m.part.layer(li).elements;
    const LayerPlacement& where = m.where(li);
    const double trained = static_cast<double>(m.grad_bytes()) + m.opt.moments.bytes_per_element() +
                           (where.param_dtype == DType::kF32 ? 0 : 4);
    total += n * where.param_element_bytes + (where.frozen ? 0 : static_cast<uint64_t>(static_cast<double>(n) * trained));  // a frozen layer holds its parameters only
  }
  return total;
}
EngineMemory Engine::measured_memory() const {
  EngineMemory m;
  m.device = impl_->stats.get(Tier::kDevice).peak_bytes;
  m.pinned = impl_->stats.get(Tier::kPinnedHost).peak_bytes;
  m.nvme = impl_->stats.get(Tier::kNvme).peak_bytes;
  return m;
}

Result<std::vector<float>> Engine::gather_state(size_t li, StateKind kind) {
  Impl& m = *impl_;
  if (li >= m.part.layer_count()) return InvalidArgument(fmt::format("layer {} out of range", li));
  if (m.where(li).frozen && kind != StateKind::kMaster)
    return FailedPrecondition(fmt::format("layer {} '{}' is frozen: it has no optimizer state (only kMaster, its "
                                          "parameters, can be gathered)",
                                          li, printable(m.part.layer(li).name, 64)));
  if (!m.load_failed.ok() && !m.where(li).frozen) return m.load_failed;  // Note [A failed load]
  STRATA_RETURN_IF_ERROR(synchronize());
  const LayerPartition& layer_part = m.part.layer(li);
  // This rank's own pieces in shard layout, as fp32.
  std::vector<float> mine(layer_part.shard_elements, 0.0f);
  if (m.where(li).frozen) {
    STRATA_ASSIGN_OR_RETURN(mine, m.params.shard_fp32(li));
  } else for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    float* out = mine.data() + layer_part.groups[gi].shard_offset;
    STRATA_RETURN_IF_ERROR(m.updates.read_piece_state(li, gi, m.rank, kind == StateKind::kMaster ? out : nullptr,
                                              kind == StateKind::kExpAvg ? out : nullptr,
                                              kind == StateKind::kExpAvgSq ? out : nullptr));
  }
  std::vector<float> all(layer_part.shard_elements * m.world);
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      m.comm, mine.data(), mine.size() * sizeof(float), all.data(), all.size() * sizeof(float),
      [&](const void* s, void* r) {
        return m.comm.all_gather(s, r, layer_part.shard_elements, DType::kF32, comm::CommQueue::kReduce);
      },
      fmt::format("gathering the state of layer {}", li)));
  std::vector<float> out(layer_part.elements);
  for (const SubGroup& g : layer_part.groups)
    for (int r = 0; r < m.world; ++r) {
      const size_t n = layer_part.piece_real(g, r);
      std::memcpy(out.data() + layer_part.piece_begin(g, r),
                  all.data() + static_cast<size_t>(r) * layer_part.shard_elements + g.shard_offset, n * sizeof(float));
    }
  return out;
}

std::string Engine::describe() const {
  const EngineOptions& o = impl_->opt;
  return fmt::format("stage {}, optimizer {} ({}), params {}, grads {}, {} rank{}", o.stage,
                     offload_device_name(o.offload_optimizer), impl_->updates.describe_state(),
                     offload_device_name(o.offload_param), dtype_name(o.grad_dtype), impl_->world,
                     impl_->world == 1 ? "" : "s");
}

// ---------------------------------------------------------------- checkpoints (CheckpointIO)

Result<CheckpointSaveInfo> Engine::save_checkpoint(const CheckpointSaveOptions& options) {
  Impl& m = *impl_;
  // A stopped engine's state may be part-way through a step: never saved.
  if (!m.stopped.ok()) return m.stopped;
  if (!m.load_failed.ok()) return m.load_failed;  // part-way through a load (Note [A failed load])
  STRATA_RETURN_IF_ERROR(check_path_text(options.dir, "save_checkpoint: the folder"));
  CheckpointScalarsNow now;
  now.optimizer_steps = m.optimizer_steps;
  now.steps_begun = m.steps_begun;
  if (m.runner != nullptr) now.data_position = m.runner->data_position();
  now.scaler = m.scaler->state();
  return m.checkpoints.save(options, now, m.predicted);
}

Result<std::optional<CheckpointSaveDone>> Engine::wait_checkpoint() { return impl_->checkpoints.wait_save(); }

Result<CheckpointManifest> Engine::load_checkpoint(const std::string& given) {
  STRATA_RETURN_IF_ERROR(check_path_text(given, "load_checkpoint: the path"));
  Impl& m = *impl_;
  STRATA_RETURN_IF_ERROR(m.expect_frozen_layers_initialized("load_checkpoint()"));
  if (m.steps_begun != 0 || m.optimizer_steps != 0)
    return FailedPrecondition(fmt::format("load_checkpoint('{}') needs a fresh engine; this one has run {} steps",
                                          printable(given, 256), m.steps_begun));
  STRATA_ASSIGN_OR_RETURN(CheckpointReader reader, m.checkpoints.open_for_load(given));
  const CheckpointManifest manifest = reader.manifest();
  const std::string src = printable(reader.folder().string(), 256);
  LossScalerState ls;
  ls.scale = manifest.scalars.loss_scale;
  ls.iteration = manifest.scalars.scaler_iteration;
  ls.last_overflow_iteration = manifest.scalars.scaler_last_overflow;
  ls.hysteresis_left = manifest.scalars.scaler_hysteresis_left;
  ls.overflow_count = manifest.scalars.scaler_overflow_count;
  // A scaler state it refuses changes nothing; from here on the state is
  // written layer by layer (Note [A failed load] in engine.h).
  STRATA_RETURN_IF_ERROR(m.scaler->restore(ls).with_context(fmt::format("checkpoint '{}' loss_scaler", src)));
  Status loaded = m.checkpoints.load_state(reader);
  // The runner goes where the save left its data; a checkpoint without a
  // position (saved by a caller that drives the engine and owns its data)
  // leaves it where it is.
  if (loaded.ok() && m.runner != nullptr && manifest.scalars.data_position.has_value())
    loaded = m.runner->seek_data(*manifest.scalars.data_position)
                 .with_context(fmt::format("moving the training data to checkpoint '{}'", src));
  if (!loaded.ok()) {
    m.load_failed = FailedPrecondition(fmt::format(
        "load_checkpoint('{}') failed after it had begun to write this engine's state ({}): its trained layers may "
        "hold the checkpoint's values and their own side by side, so steps, saves and uses of a trained layer are "
        "refused until a load_checkpoint() succeeds (another tag, or this one repaired) or a new engine is made",
        src, loaded.to_string()));
    return loaded;
  }
  m.load_failed = Status::Ok();
  m.optimizer_steps = manifest.scalars.optimizer_steps;
  m.steps_begun = manifest.scalars.steps_begun;
  return manifest;
}

int64_t Engine::steps_begun() const { return impl_->steps_begun; }

}  // namespace strata::offload
