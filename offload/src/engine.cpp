// The ZeRO engine (engine.h): set-up (the memory plan, the partition, every
// layer's state) and the public methods. The provider hooks are in
// engine_passes.cpp, the step in engine_step.cpp, the shared state in
// engine_impl.h.
#include "engine_impl.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::offload {

EngineMemory Engine::Impl::plan() const {
  Result<EngineMemory> m = plan_engine_memory(opt, model.layers(), world, rank);
  STRATA_CHECK(m.ok(), "the engine's own partition was planned before");
  return *m;
}

// ---------------------------------------------------------------- set-up

Status Engine::Impl::init() {
  world = comm.world_size();
  rank = comm.rank();
  if (opt.stage < 0 || opt.stage > 3)
    return InvalidArgument(fmt::format("{}: zero_optimization.stage {} is not 0..3", opt.source, opt.stage));
  if (opt.grad_accum < 1)
    return InvalidArgument(fmt::format("{}: gradient_accumulation_steps {} must be >= 1", opt.source, opt.grad_accum));
  if (!(opt.grad_clip >= 0.0) || !std::isfinite(opt.grad_clip))
    return InvalidArgument(fmt::format("{}: gradient_clipping {} must be finite and >= 0", opt.source, opt.grad_clip));
  if (opt.offload_param == OffloadDevice::kNvme && opt.nvme_param.path.empty())
    return InvalidArgument(fmt::format("{}: offload_param nvme needs offload_param.nvme_path", opt.source));
  if (opt.offload_optimizer == OffloadDevice::kNvme && opt.nvme.path.empty())
    return InvalidArgument(fmt::format("{}: offload_optimizer nvme needs offload_optimizer.nvme_path", opt.source));
  if (opt.offload_param != OffloadDevice::kNone && opt.stage != 3)
    return InvalidArgument(fmt::format("{}: offload_param needs zero_optimization.stage 3", opt.source));
  if (param_on_host() && !opt_on_host())
    return Unsupported(fmt::format("{}: offload_param cpu needs offload_optimizer cpu", opt.source));
  if (!is_state_float(opt.grad_dtype))
    return InvalidArgument(fmt::format("{}: gradient dtype {} is not fp32, bf16 or fp16", opt.source,
                                       dtype_name(opt.grad_dtype)));
  if (opt.prefetch_bucket_size < 0 || opt.max_live_parameters < 0 || opt.max_reuse_distance < 0 ||
      opt.persistence_threshold < 0 || opt.reduce_bucket_size < 1)
    return InvalidArgument(fmt::format("{}: stage-3 sizes and reduce_bucket_size must not be negative", opt.source));
  STRATA_RETURN_IF_ERROR(cpu_adam::validate_hyper_params(opt.optimizer, opt.hyper));
  STRATA_ASSIGN_OR_RETURN(LrSchedule s, LrSchedule::create(opt.scheduler, opt.hyper.lr, opt.source));
  schedule.emplace(std::move(s));
  STRATA_ASSIGN_OR_RETURN(LossScaler ls, LossScaler::create(opt.fp16, opt.source));
  scaler.emplace(std::move(ls));

  STRATA_ASSIGN_OR_RETURN(part, Partition::create(model.layers(), world, opt.sub_group_size));
  STRATA_ASSIGN_OR_RETURN(xfer, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(frees, device.create_stream());
  if (opt_on_nvme() || opt.offload_param == OffloadDevice::kNvme) {
    // The swap folders' run name: rank 0's process id, the same on every rank.
    int64_t job = static_cast<int64_t>(::getpid()), job0 = 0;
    STRATA_RETURN_IF_ERROR(comm::host_collective(
        comm, &job, sizeof(job), &job0, sizeof(job0),
        [&](const void* s, void* r) { return comm.broadcast(s, r, 1, DType::kI64, 0, comm::CommQueue::kReduce); },
        "agreeing on the swap folders' name"));
    job_name = fmt::format("train-{}", job0);
  }
  if (opt.offload_param == OffloadDevice::kNvme) STRATA_RETURN_IF_ERROR(make_param_swap());
  if (opt_on_nvme()) {
    STRATA_RETURN_IF_ERROR(make_nvme_tier());
  } else {
    if (device_opt()) {
      if (!device_adam_compiled())
        return Unsupported(fmt::format("{}: offload_optimizer none on the {} device needs the device optimizer kernel, "
                                       "which this build does not have; set offload_optimizer.device to \"cpu\"",
                                       opt.source, device.caps().backend));
      if (opt.optimizer != cpu_adam::OptimizerKind::kAdam && opt.optimizer != cpu_adam::OptimizerKind::kAdamW)
        return Unsupported(fmt::format("{}: the device optimizer kernel steps Adam and AdamW only; set "
                                       "offload_optimizer.device to \"cpu\" for {}",
                                       opt.source, cpu_adam::optimizer_kind_name(opt.optimizer)));
      STRATA_ASSIGN_OR_RETURN(opt_stream, device.create_stream());
    }
    STRATA_ASSIGN_OR_RETURN(tier, make_memory_state_tier(device, opt_on_host() ? Tier::kPinnedHost : Tier::kDevice,
                                                         opt.moment_dtype, stats, device_opt()));
  }
  if (!(opt.ratio > 0.0 && opt.ratio <= 1.0))
    return InvalidArgument(fmt::format("{}: offload_optimizer.ratio {} must be in (0, 1]", opt.source, opt.ratio));
  if (split()) {
    if (opt.stage != 3 || !opt_on_host() || param_on_host())
      return Unsupported(fmt::format("{}: offload_optimizer.ratio {} needs stage 3, offload_optimizer cpu and "
                                     "offload_param none",
                                     opt.source, opt.ratio));
    STRATA_ASSIGN_OR_RETURN(dev_tier, make_memory_state_tier(device, Tier::kDevice, opt.moment_dtype, stats));
  }
  cpu_adam::OptimizerOptions oo;
  oo.kind = opt.optimizer;
  oo.threads = opt.optimizer_threads;
  STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer o, cpu_adam::CpuOptimizer::create(oo));
  optimizer.emplace(std::move(o));
  if (split()) {
    STRATA_ASSIGN_OR_RETURN(cpu_adam::CpuOptimizer d, cpu_adam::CpuOptimizer::create(oo));
    dev_optimizer.emplace(std::move(d));
  }
  model_stream = runner.model_stream();

  // The plan first: a config whose state cannot fit the device fails here,
  // before anything is allocated, with the plan's row and the fix.
  predicted = plan();
  {
    uint64_t real = 0;
    for (size_t li = 0; li < part.layer_count(); ++li) real += part.layer(li).elements;
    window_spans_micro_batch =
        static_cast<uint64_t>(std::max(opt.max_reuse_distance, opt.prefetch_bucket_size)) >= 2 * real;
  }
  {
    const uint64_t cap = device.caps().memory_bytes;
    const uint64_t used = device.memory_stats().get(Tier::kDevice).current_bytes;
    const uint64_t free_bytes = cap > used ? cap - used : 0;
    if (cap != 0 && predicted.device > free_bytes) {
      std::string fix;
      if (!opt_on_host())
        fix = "set zero_optimization.offload_optimizer.device to \"cpu\"";
      else if (opt.stage < 3)
        fix = "use zero_optimization.stage 3";
      else if (!param_on_host())
        fix = "set zero_optimization.offload_param.device to \"cpu\"";
      else
        fix = "lower stage3_max_live_parameters / reduce_bucket_size";
      return OutOfMemory(fmt::format(
          "stage {}, optimizer {}, params {} on {} rank(s) needs {} of device memory per rank for its training state "
          "(parameters {}, gradients {}, optimizer state {}, gathered layers {}) but {} of the device's {} is free after "
          "the model's own buffers; {} or raise --device-memory (strata.device_memory)",
          opt.stage, offload_device_name(opt.offload_optimizer), offload_device_name(opt.offload_param), world,
          format_bytes(predicted.device, true), format_bytes(predicted.device_params, true),
          format_bytes(predicted.device_grads, true), format_bytes(predicted.device_optimizer, true),
          format_bytes(predicted.device_gathered, true), format_bytes(free_bytes, true), format_bytes(cap, true), fix));
    }
  }
  if (opt.host_memory_budget != 0 && predicted.pinned > opt.host_memory_budget) {
    // Name the largest host buffer: that is the one to shrink or move.
    const std::pair<uint64_t, const char*> parts[] = {
        {predicted.pinned_optimizer,
         opt_on_nvme() ? "optimizer state's NVMe slots: lower zero_optimization.offload_optimizer.buffer_count or "
                         "sub_group_size (a slot holds one sub-group's piece)"
                       : "optimizer state (master weights and moments): set offload_optimizer.device to nvme, or use "
                         "offload_optimizer.ratio < 1 at stage 3, or strata.optimizer_state_dtype bf16"},
        {predicted.pinned_grads, "gradient shards: use a larger world size or data_types.grad_accum_dtype bf16"},
        {predicted.pinned_staging, "parameter staging: use a larger world size"},
        {predicted.pinned_params,
         opt.offload_param == OffloadDevice::kNvme
             ? "parameter shards in host memory and NVMe slots: lower offload_param.max_in_cpu or buffer_count"
             : "parameter shards (offload_param cpu): set offload_param.device to nvme or none"}};
    const auto* largest = &parts[0];
    for (const auto& p : parts)
      if (p.first > largest->first) largest = &p;
    return ResourceExhausted(fmt::format(
        "{}: this rank's host tier needs {} of pinned memory (optimizer state {}, gradient shards {}, staging {}, "
        "parameter shards {}) but its share of strata.host_memory_budget is {}; the largest is the {}",
        opt.source, format_bytes(predicted.pinned, true), format_bytes(predicted.pinned_optimizer, true),
        format_bytes(predicted.pinned_grads, true), format_bytes(predicted.pinned_staging, true),
        format_bytes(predicted.pinned_params, true), format_bytes(opt.host_memory_budget, true), largest->second));
  }
  const size_t n = model.layers().size();
  layers.resize(n);
  expected_bwd.assign(n, 0);
  forward_acquires.assign(n, 0);
  for (size_t i = 0; i < n; ++i) STRATA_RETURN_IF_ERROR(init_layer(i));
  // The initial state is written (NVMe tier) before the first step reads it.
  STRATA_RETURN_IF_ERROR(tier->flush().with_context("writing the initial optimizer state"));
  worker = std::make_unique<SerialWorker>(fmt::format("optimizer of rank {}", rank));
  if (split()) dev_worker = std::make_unique<SerialWorker>(fmt::format("device optimizer of rank {}", rank));
  return Status::Ok();
}

// offload_optimizer nvme: the NVMe tier, its slots sized for the largest
// piece, its capacity for every piece this rank owns, its folder named for
// this run (rank 0's process id, the same on every rank) and rank.
Status Engine::Impl::make_nvme_tier() {
  if (opt.ratio < 1.0)
    return Unsupported(fmt::format("{}: offload_optimizer.ratio < 1 with nvme is not supported; use cpu", opt.source));
  uint64_t largest = 0, total = 0;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerPartition& lp = part.layer(li);
    const bool master = true;  // the host optimizer keeps fp32 master weights for every dtype
    for (const SubGroup& g : lp.groups)
      for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
        const uint64_t b = nvme_piece_bytes(lp.piece_real(g, r), master, opt.moment_dtype);
        largest = std::max(largest, b);
        total += b;
      }
  }
  NvmeStateTierOptions o;
  o.nvme_paths = {opt.nvme.path};
  o.job = job_name;
  o.rank = rank;
  // The state; the tier sizes its swap file for two versions of it, room
  // for uneven pieces and its slots (Note [Piece versions]).
  o.capacity_bytes = total;
  o.aio = opt.nvme.aio;
  o.buffer_count = static_cast<size_t>(opt.nvme.buffer_count);
  o.slot_bytes = std::max<uint64_t>(largest, kNvmeStateAlign);
  o.moment_dtype = opt.moment_dtype;
  o.pipeline_read = opt.nvme.pipeline_read;
  o.pipeline_write = opt.nvme.pipeline_write;
  o.verify_checksums = opt.nvme.verify_checksums;
  o.io_engine = opt.nvme.io_engine;
  STRATA_ASSIGN_OR_RETURN(tier, make_nvme_state_tier(o, device, stats));
  return Status::Ok();
}

// offload_param nvme: which layers' shards go to NVMe (every partitioned
// layer after the first max_in_cpu shard elements, which stay in pinned host
// memory), and the swap store with slots for the largest of them.
Status Engine::Impl::make_param_swap() {
  if (opt.stage != 3) return InvalidArgument(fmt::format("{}: offload_param nvme needs stage 3", opt.source));
  layers.resize(part.layer_count());  // (sized again, unchanged, below)
  uint64_t cached = 0, capacity = 0, largest = 0, largest_elements = 0;
  std::string largest_name;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerSpec& spec = model.layers()[li];
    const LayerPartition& lp = part.layer(li);
    const bool persistent = static_cast<int64_t>(spec.param_count) < opt.persistence_threshold;
    if (persistent) continue;
    const size_t pe = dtype_size(spec.params.empty() ? DType::kF32 : spec.params.front().dtype);
    if (cached + lp.shard_elements <= static_cast<uint64_t>(opt.nvme_param.max_in_cpu)) {
      cached += lp.shard_elements;
      continue;
    }
    layers[li].on_nvme = true;
    const uint64_t bytes = lp.shard_elements * pe;
    capacity += bytes;
    if (bytes > largest) {
      largest = bytes;
      largest_elements = lp.shard_elements;
      largest_name = fmt::format("layer {} '{}'", li, printable(lp.name, 64));
    }
  }
  if (capacity == 0) return Status::Ok();  // everything fits max_in_cpu: no NVMe I/O at all
  if (static_cast<uint64_t>(opt.nvme_param.buffer_size) < largest_elements)
    return InvalidArgument(fmt::format(
        "{}: zero_optimization.offload_param.buffer_size {} elements is smaller than the largest parameter shard on "
        "NVMe ({} elements, {}); raise buffer_size to at least {}",
        opt.source, opt.nvme_param.buffer_size, largest_elements, largest_name, largest_elements));
  ParamSwapOptions o;
  o.path = opt.nvme_param.path;
  o.job = job_name + "-params";
  o.rank = rank;
  o.buffer_count = static_cast<size_t>(opt.nvme_param.buffer_count);
  o.slot_bytes = largest;
  o.capacity_bytes = capacity;
  o.aio = opt.nvme.aio;
  o.verify_checksums = opt.nvme.verify_checksums;
  o.io_engine = opt.nvme_param.io_engine;
  STRATA_ASSIGN_OR_RETURN(param_swap, ParamSwap::create(o, device, stats));
  return Status::Ok();
}

Status Engine::Impl::init_layer(size_t li) {
  const LayerSpec& spec = model.layers()[li];
  const LayerPartition& lp = part.layer(li);
  Layer& l = layers[li];
  l.pd = spec.params.empty() ? DType::kF32 : spec.params.front().dtype;
  for (const ParamTensorSpec& t : spec.params) {
    if (t.dtype != l.pd || t.offset_bytes != t.offset_elements * dtype_size(t.dtype))
      return Unsupported(fmt::format("layer {} '{}': tensor '{}' ({}) — the engine needs one dtype per layer, "
                                     "tensors back to back",
                                     li, printable(spec.name, 64), printable(t.name, 64), dtype_name(t.dtype)));
  }
  if (!is_state_float(l.pd))
    return Unsupported(fmt::format("layer '{}' has dtype {}; the engine trains fp32, bf16 or fp16 parameters",
                                   printable(spec.name, 64), dtype_name(l.pd)));
  l.pe = dtype_size(l.pd);
  l.persistent = opt.stage < 3 || static_cast<int64_t>(spec.param_count) < opt.persistence_threshold;

  // Initial values: the model's, rounded to the declared dtype, and fp32 for masters.
  std::vector<std::byte> init(lp.padded_elements * l.pe, std::byte{0});
  STRATA_RETURN_IF_ERROR(model.init_layer(li, std::span<std::byte>(init.data(), spec.param_bytes)));
  std::vector<float> init32;
  if (has_master(l)) {
    init32.assign(lp.padded_elements, 0.0f);
    STRATA_RETURN_IF_ERROR(model.init_layer_fp32(li, std::span<float>(init32.data(), spec.param_count)));
  }
  const std::string lname = fmt::format("layer {} '{}'", li, printable(spec.name, 64));
  if (l.persistent) {
    STRATA_ASSIGN_OR_RETURN(l.full_params, alloc_device(lp.padded_elements * l.pe, "parameters of " + lname));
    STRATA_RETURN_IF_ERROR(device.copy(l.full_params.data(), init.data(), init.size(), CopyKind::kHostToDevice));
  } else if (l.on_nvme) {
    std::vector<std::byte> shard(lp.shard_elements * l.pe);
    for (const SubGroup& g : lp.groups)
      std::memcpy(shard.data() + g.shard_offset * l.pe, init.data() + lp.piece_begin(g, rank) * l.pe, g.piece * l.pe);
    STRATA_RETURN_IF_ERROR(
        param_swap->put(static_cast<uint32_t>(li), shard.data(), shard.size(), "parameter shard of " + lname));
  } else if (param_on_host()) {
    STRATA_ASSIGN_OR_RETURN(l.host_shard, HostBuffer::create(device, stats, lp.shard_elements * l.pe,
                                                             "parameter shard of " + lname));
    for (const SubGroup& g : lp.groups)
      std::memcpy(l.host_shard.data() + g.shard_offset * l.pe, init.data() + lp.piece_begin(g, rank) * l.pe,
                  g.piece * l.pe);
  } else {
    STRATA_ASSIGN_OR_RETURN(l.dev_shard, alloc_device(lp.shard_elements * l.pe, "parameter shard of " + lname));
    for (const SubGroup& g : lp.groups)
      STRATA_RETURN_IF_ERROR(device.copy(l.dev_shard.as<std::byte>() + g.shard_offset * l.pe,
                                         init.data() + lp.piece_begin(g, rank) * l.pe, g.piece * l.pe,
                                         CopyKind::kHostToDevice));
  }
  if (opt.stage <= 1) {
    STRATA_ASSIGN_OR_RETURN(l.full_grads, alloc_device(lp.padded_elements * ge(), "gradients of " + lname));
    STRATA_RETURN_IF_ERROR(device.memset(l.full_grads.data(), 0, lp.padded_elements * ge()));
  }
  const size_t owned = owned_elements(lp);
  if (opt_on_host()) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_host,
                            HostBuffer::create(device, stats, owned * ge(), "gradient shard of " + lname));
    // Updated values wait here for their H2D copy, unless they go straight into a host shard.
    if (!(param_on_host() && !l.persistent) || l.on_nvme) {
      STRATA_ASSIGN_OR_RETURN(l.staging, HostBuffer::create(device, stats, owned * l.pe,
                                                            "parameter staging of " + lname));
    }
  }
  if ((!opt_on_host() && !grads_in_place()) || split()) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_dev, alloc_device(owned * ge(), "gradient shard of " + lname));
  }
  if (device_opt()) {
    const size_t n = grads_in_place() ? lp.padded_elements : owned;
    STRATA_ASSIGN_OR_RETURN(l.norm_grads,
                            HostBuffer::create(device, stats, n * ge(), "gradient copy for the norm of " + lname));
  }
  // Optimizer state of every owned piece.
  for (size_t gi = 0; gi < lp.groups.size(); ++gi) {
    const SubGroup& g = lp.groups[gi];
    for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
      const size_t count = lp.piece_real(g, r), host = host_n(count);
      const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      std::span<const float> master;
      if (has_master(l)) master = std::span<const float>(init32.data() + lp.piece_begin(g, r), host);
      STRATA_RETURN_IF_ERROR(tier->add(id, state_name(li, gi, r), host, master));
      if (split()) {
        // The device part: fp32 parameters are their own master there.
        std::span<const float> dev_master;
        if (l.pd != DType::kF32)
          dev_master = std::span<const float>(init32.data() + lp.piece_begin(g, r) + host, count - host);
        STRATA_RETURN_IF_ERROR(dev_tier->add(id, state_name(li, gi, r) + " (device part)", count - host, dev_master));
      }
    }
  }
  l.block_sums.assign(owned / kShardAlign, 0.0);
  return Status::Ok();
}

// ---------------------------------------------------------------- Engine

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_) {
    // Everything that may still use the engine's buffers finishes before
    // they are freed, in this order (each waits only on work that runs by
    // itself on other threads, so none can wait for a later one):
    // the model's stream (a step that failed half-way may still run),
    if (impl_->model_stream) impl_->model_stream->synchronize().ignore();
    // the optimizer threads (they run what is queued; the state they step is still alive),
    if (impl_->worker) impl_->worker.reset();
    if (impl_->dev_worker) impl_->dev_worker.reset();
    // the updates' parameter write-backs to NVMe (stage 3, offload_param
    // nvme): the optimizer thread started them; each one's continuation runs
    // on an I/O thread when it completes, and a failed one records its error
    // in this engine (update_failure, failure_mu, destroyed before
    // param_swap). A layer's shard_ready completes after that continuation,
    // so none is left once every layer's has,
    for (Impl::Layer& l : impl_->layers) {
      l.update_done.wait().ignore();
      l.shard_ready.wait().ignore();
    }
    // the checkpoint save in flight (its snapshot was taken: it only writes
    // files; rank 0 does not wait for peers that may have failed),
    impl_->abandon_save();
    impl_->wait_save().status().ignore();
    // then the copies and the collectives lent those buffers.
    if (impl_->xfer) impl_->xfer->synchronize().ignore();
    impl_->comm.synchronize().ignore();
  }
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, ModelRunner& runner, Device& device,
                                               comm::Communicator& comm) {
  auto impl = std::make_unique<Impl>(options, runner, device, comm);
  std::unique_ptr<Engine> e(new Engine(std::move(impl)));
  e->impl_->self = e.get();
  STRATA_RETURN_IF_ERROR(e->impl_->init().with_context(fmt::format("engine on rank {}", comm.rank())));
  return e;
}

Result<StepMetrics> Engine::step() {
  if (!impl_->stopped.ok()) return impl_->stopped;
  Result<StepMetrics> r = impl_->step();
  if (!r.ok()) return impl_->stop_unless_recovered(r.status());
  return r;
}

Status Engine::stopped() const { return impl_->stopped; }

Result<double> Engine::evaluate() {
  if (!impl_->stopped.ok()) return impl_->stopped;
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
  Status st = m.settle(nullptr);
  if (!st.ok()) return m.stop_unless_recovered(std::move(st));
  for (auto& l : m.layers) {
    STRATA_RETURN_IF_ERROR(l.params_ready.wait());
    STRATA_RETURN_IF_ERROR(l.shard_ready.wait());
  }
  STRATA_RETURN_IF_ERROR(m.xfer->synchronize());
  STRATA_RETURN_IF_ERROR(m.tier->flush());  // NVMe: every write-back durable, errors reported
  return m.comm.synchronize();
}

Result<LayerMemory> Engine::acquire(size_t layer_index, Pass pass) { return impl_->acquire(layer_index, pass); }
Status Engine::release(size_t layer_index, Pass pass, const Completion& done) {
  return impl_->release(layer_index, pass, done);
}
Status Engine::begin_step() { return Status::Ok(); }
Status Engine::end_micro_batch(bool) { return Status::Ok(); }

const EngineOptions& Engine::options() const { return impl_->opt; }
const Partition& Engine::partition() const { return impl_->part; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
int64_t Engine::steps_done() const { return impl_->steps; }

double Engine::loss_scale() const { return impl_->scaler->scale(); }
EngineMemory Engine::predicted_memory() const { return impl_->predicted; }
uint64_t Engine::model_state_bytes() const {
  const Impl& m = *impl_;
  uint64_t total = 0;
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const uint64_t n = m.part.layer(li).elements;
    const Impl::Layer& l = m.layers[li];
    total += n * (l.pe + m.ge() + 2 * dtype_size(m.opt.moment_dtype) + (l.pd == DType::kF32 ? 0 : 4));
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
  if (li >= m.layers.size()) return InvalidArgument(fmt::format("layer {} out of range", li));
  STRATA_RETURN_IF_ERROR(synchronize());
  const LayerPartition& lp = m.part.layer(li);
  // This rank's own pieces in shard layout, as fp32.
  std::vector<float> mine(lp.shard_elements, 0.0f);
  for (size_t gi = 0; gi < lp.groups.size(); ++gi) {
    float* out = mine.data() + lp.groups[gi].shard_offset;
    STRATA_RETURN_IF_ERROR(m.read_piece_state(li, gi, m.rank, kind == StateKind::kMaster ? out : nullptr,
                                              kind == StateKind::kExpAvg ? out : nullptr,
                                              kind == StateKind::kExpAvgSq ? out : nullptr));
  }
  std::vector<float> all(lp.shard_elements * m.world);
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      m.comm, mine.data(), mine.size() * sizeof(float), all.data(), all.size() * sizeof(float),
      [&](const void* s, void* r) {
        return m.comm.all_gather(s, r, lp.shard_elements, DType::kF32, comm::CommQueue::kReduce);
      },
      fmt::format("gathering the state of layer {}", li)));
  std::vector<float> out(lp.elements);
  for (const SubGroup& g : lp.groups)
    for (int r = 0; r < m.world; ++r) {
      const size_t n = lp.piece_real(g, r);
      std::memcpy(out.data() + lp.piece_begin(g, r),
                  all.data() + static_cast<size_t>(r) * lp.shard_elements + g.shard_offset, n * sizeof(float));
    }
  return out;
}

std::string Engine::describe() const {
  const EngineOptions& o = impl_->opt;
  return fmt::format("stage {}, optimizer {} ({}), params {}, grads {}, {} rank{}", o.stage,
                     offload_device_name(o.offload_optimizer), impl_->tier->describe(),
                     offload_device_name(o.offload_param), dtype_name(o.grad_dtype), impl_->world,
                     impl_->world == 1 ? "" : "s");
}

}  // namespace strata::offload
