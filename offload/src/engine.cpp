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

EngineMemory Engine::Impl::plan() const { return plan_engine_memory(opt, part, placement); }

// ---------------------------------------------------------------- set-up

Status Engine::Impl::init() {
  world = comm.world_size();
  rank = comm.rank();
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
  STRATA_RETURN_IF_ERROR(cpu_adam::validate_hyper_params(opt.optimizer, opt.hyper));
  STRATA_ASSIGN_OR_RETURN(LrSchedule s, LrSchedule::create(opt.scheduler, opt.hyper.lr, opt.source));
  schedule.emplace(std::move(s));
  STRATA_ASSIGN_OR_RETURN(LossScaler ls, LossScaler::create(opt.fp16, opt.source));
  scaler.emplace(std::move(ls));

  STRATA_ASSIGN_OR_RETURN(part, Partition::create(model.layers(), world, opt.sub_group_size));
  STRATA_ASSIGN_OR_RETURN(placement, StatePlacement::compute(opt, model.layers(), part, rank,
                                                             PlannedDevice::of(device.caps())));
  STRATA_ASSIGN_OR_RETURN(xfer, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(frees, device.create_stream());
  auto bounded = [this](const Completion& c, std::string_view what) { return wait_bounded(c, what); };
  live_params.emplace(frees.get(), bounded);
  live_grads.emplace(frees.get(), bounded);
  STRATA_ASSIGN_OR_RETURN(update_stream, device.create_stream());
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
  if (split()) {
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
  if (runner != nullptr) model_stream = runner->model_stream();

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
  trace.emplace(n);
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
  uint64_t largest = 0, total = 0;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    if (placement.layers[li].frozen) continue;  // no optimizer state
    const LayerPartition& layer_part = part.layer(li);
    const bool master = true;  // the host optimizer keeps fp32 master weights for every dtype
    for (const SubGroup& g : layer_part.groups)
      for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
        const uint64_t b = nvme_piece_bytes(layer_part.piece_real(g, r), master, opt.moment_dtype);
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
  o.io_engine = faults.optimizer_io;  // null unless a test's (Note [Testing seam])
  o.wait_timeout_s = opt.wait_timeout_s;
  STRATA_ASSIGN_OR_RETURN(tier, make_nvme_state_tier(o, device, stats));
  return Status::Ok();
}

// offload_param nvme: the swap store for the shards the placement puts on
// NVMe (every partitioned layer after the first max_in_cpu shard elements,
// which stay in pinned host memory), with slots for the largest of them.
Status Engine::Impl::make_param_swap() {
  if (opt.stage != 3) return InvalidArgument(fmt::format("{}: offload_param nvme needs stage 3", opt.source));
  uint64_t capacity = 0, largest = 0, largest_elements = 0;
  std::string largest_name;
  for (size_t li = 0; li < part.layer_count(); ++li) {
    const LayerPlacement& where = placement.layers[li];
    if (!where.shard_on_nvme()) continue;
    const LayerPartition& layer_part = part.layer(li);
    const uint64_t bytes = layer_part.shard_elements * where.param_element_bytes;
    capacity += bytes;
    if (bytes > largest) {
      largest = bytes;
      largest_elements = layer_part.shard_elements;
      largest_name = fmt::format("layer {} '{}'", li, printable(layer_part.name, 64));
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
  o.io_engine = faults.param_io;
  STRATA_ASSIGN_OR_RETURN(param_swap, ParamSwap::create(o, device, stats));
  shard_reader = std::make_unique<SerialWorker>(fmt::format("parameter shard reader of rank {}", rank));
  return Status::Ok();
}

Status Engine::Impl::init_layer(size_t li) {
  const LayerSpec& spec = model.layers()[li];
  const LayerPartition& layer_part = part.layer(li);
  Layer& l = layers[li];
  const LayerPlacement& where = placement.layers[li];
  l.param_dtype = where.param_dtype;
  l.element_bytes = where.param_element_bytes;
  l.persistent = where.persistent();
  l.frozen = where.frozen;
  l.on_nvme = where.shard_on_nvme();
  l.acquired_in_place = where.acquired_in_place;
  l.initialized = model.provides_initial_values();
  for (const ParamTensorSpec& t : spec.params) {
    const size_t begin = t.offset_elements, end = begin + static_cast<size_t>(t.numel());
  const double decay = t.weight_decay.value_or(opt.hyper.weight_decay);
    if (!l.hyper_runs.empty() && l.hyper_runs.back().end == begin && l.hyper_runs.back().weight_decay == decay &&
        l.hyper_runs.back().lr_scale == t.lr_scale)
      l.hyper_runs.back().end = end;
    else
      l.hyper_runs.push_back(HyperRun{begin, end, decay, t.lr_scale});
  }

  // Initial values: the model's, rounded to the declared dtype, and fp32 for masters.
  std::vector<std::byte> init(layer_part.padded_elements * l.element_bytes, std::byte{0});
  STRATA_RETURN_IF_ERROR(model.init_layer(li, std::span<std::byte>(init.data(), spec.param_bytes)));
  std::vector<float> init32;
  if (where.master) {
    init32.assign(layer_part.padded_elements, 0.0f);
    STRATA_RETURN_IF_ERROR(model.init_layer_fp32(li, std::span<float>(init32.data(), spec.param_count)));
  }
  const std::string lname = fmt::format("layer {} '{}'", li, printable(spec.name, 64));
  if (l.persistent) {
    STRATA_ASSIGN_OR_RETURN(l.full_params, alloc_device(layer_part.padded_elements * l.element_bytes, "parameters of " + lname));
    STRATA_RETURN_IF_ERROR(device.copy(l.full_params.data(), init.data(), init.size(), CopyKind::kHostToDevice));
  } else {
    const std::vector<std::byte> shard = own_shard(li, init.data());
    if (l.on_nvme) {
      STRATA_RETURN_IF_ERROR(
          param_swap->put(static_cast<uint32_t>(li), shard.data(), shard.size(), "parameter shard of " + lname));
    } else {
      if (where.shard_in_host()) {
        STRATA_ASSIGN_OR_RETURN(l.host_shard, HostBuffer::create(device, stats, shard.size(), "parameter shard of " + lname));
      } else {
        STRATA_ASSIGN_OR_RETURN(l.dev_shard, alloc_device(shard.size(), "parameter shard of " + lname));
      }
      STRATA_RETURN_IF_ERROR(put_shard(li, shard));
    }
  }
  // A frozen layer has its parameters and nothing else.
  if (l.frozen) return Status::Ok();
  if (where.gradients == GradientBuffer::kPersistent) {
    STRATA_ASSIGN_OR_RETURN(l.full_grads, alloc_device(layer_part.padded_elements * grad_bytes(), "gradients of " + lname));
    STRATA_RETURN_IF_ERROR(device.memset(l.full_grads.data(), 0, layer_part.padded_elements * grad_bytes()));
  }
  const size_t owned = owned_elements(layer_part);
  if (where.pinned_gradient_shard) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_host,
                            HostBuffer::create(device, stats, owned * grad_bytes(), "gradient shard of " + lname));
  }
  if (where.pinned_staging) {
    STRATA_ASSIGN_OR_RETURN(l.staging,
                            HostBuffer::create(device, stats, owned * l.element_bytes, "parameter staging of " + lname));
  }
  if (where.device_gradient_shard) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_dev, alloc_device(owned * grad_bytes(), "gradient shard of " + lname));
  }
  if (where.norm_gradient_copy) {
    const size_t n = grads_in_place() ? layer_part.padded_elements : owned;
    STRATA_ASSIGN_OR_RETURN(l.norm_grads,
                            HostBuffer::create(device, stats, n * grad_bytes(), "gradient copy for the norm of " + lname));
  }
  // Optimizer state of every owned piece.
  for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    const SubGroup& g = layer_part.groups[gi];
    for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
      const size_t count = layer_part.piece_real(g, r), host = host_n(count);
      const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      std::span<const float> master;
      if (where.master) master = std::span<const float>(init32.data() + layer_part.piece_begin(g, r), host);
      STRATA_RETURN_IF_ERROR(tier->add(id, state_name(li, gi, r), host, master));
      if (split()) {
        // The device part: fp32 parameters are their own master there.
        std::span<const float> dev_master;
        if (l.param_dtype != DType::kF32)
          dev_master = std::span<const float>(init32.data() + layer_part.piece_begin(g, r) + host, count - host);
        STRATA_RETURN_IF_ERROR(dev_tier->add(id, state_name(li, gi, r) + " (device part)", count - host, dev_master));
      }
    }
  }
  l.block_sums.assign(owned / kShardAlign, 0.0);
  return Status::Ok();
}

std::vector<std::byte> Engine::Impl::own_shard(size_t li, const std::byte* padded) const {
  const Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  std::vector<std::byte> shard(layer_part.shard_elements * l.element_bytes, std::byte{0});
  for (const SubGroup& g : layer_part.groups)
    std::memcpy(shard.data() + g.shard_offset * l.element_bytes, padded + layer_part.piece_begin(g, rank) * l.element_bytes, g.piece * l.element_bytes);
  return shard;
}

Result<Completion> Engine::Impl::gather_persistent(size_t li) {
  Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  std::byte* full = l.full_params.as<std::byte>();
  Completion last;
  for (const SubGroup& g : layer_part.groups) {
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(full + layer_part.piece_begin(g, rank) * l.element_bytes,
                                                              full + g.padded_begin * l.element_bytes, g.piece, l.param_dtype,
                                                              comm::CommQueue::kUpdate));
    last = w.completion();
  }
  gather_bytes += layer_part.padded_elements * l.element_bytes;
  return last;
}

// A SpecModel's initial values, handed in layer by layer (engine.h): this
// rank's pieces only, written where the placement keeps them; the moments
// start at zero, as for a model that provides its own values.
Status Engine::Impl::put_initial_layer(size_t li, std::span<const std::byte> params, std::span<const float> fp32) {
  const LayerSpec& spec = model.layers()[li];
  const LayerPartition& layer_part = part.layer(li);
  Layer& l = layers[li];
  const std::string lname = fmt::format("layer {} '{}'", li, printable(spec.name, 64));
  std::vector<std::byte> init(layer_part.padded_elements * l.element_bytes, std::byte{0});
  std::memcpy(init.data(), params.data(), spec.param_bytes);
  if (l.persistent) {
    STRATA_RETURN_IF_ERROR(device.copy(l.full_params.data(), init.data(), init.size(), CopyKind::kHostToDevice)
                               .with_context("writing the initial parameters of " + lname));
  } else {
    STRATA_RETURN_IF_ERROR(put_shard(li, own_shard(li, init.data()))
                               .with_context("writing the initial parameter shard of " + lname));
  }
  if (!l.frozen) {
    // The master weights: the fp32 values given, else the parameters widened.
    std::vector<float> master(layer_part.padded_elements, 0.0f);
    if (!fp32.empty()) std::copy(fp32.begin(), fp32.end(), master.begin());
    else params_to_fp32(l.param_dtype, params.data(), master.data(), spec.param_count);
    std::vector<float> zeros;
    for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
      const SubGroup& g = layer_part.groups[gi];
      for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
        const size_t n = layer_part.piece_real(g, r);
        if (n == 0) continue;
        zeros.assign(n, 0.0f);
        STRATA_RETURN_IF_ERROR(write_piece_state(li, gi, r, master.data() + layer_part.piece_begin(g, r), zeros.data(),
                                                 zeros.data())
                                   .with_context("writing the initial optimizer state of " + lname));
      }
    }
    // The written state is the committed one (Note [Piece versions]).
    STRATA_RETURN_IF_ERROR(tier->commit().with_context("writing the initial optimizer state of " + lname));
    if (dev_tier) STRATA_RETURN_IF_ERROR(dev_tier->commit());
  }
  l.initialized = true;
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
    // the optimizer threads (they run what is queued; the state they step is still alive),
    for (std::unique_ptr<SerialWorker>* w : {&m.worker, &m.dev_worker})
      if (*w) {
        m.wait_at_teardown((*w)->submit([] { return Status::Ok(); }, {}, "the end of the optimizer thread's queue",
                                        /*sticky=*/false),
                           "the optimizer thread's queued work");
        w->reset();
      }
    // the updates' parameter write-backs to NVMe (stage 3, offload_param
    // nvme): the optimizer thread started them; each one's continuation runs
    // on an I/O thread when it completes, and a failed one records its error
    // in this engine (update_failure, failure_mu, destroyed before
    // param_swap). A layer's shard_ready completes after that continuation,
    // so none is left once every layer's has,
    for (Impl::Layer& l : m.layers) {
      m.wait_at_teardown(l.update_written, "a layer's update");
      m.wait_at_teardown(l.shard_ready, "a layer's parameter shard write-back");
    }
    // the shard reader (its reads are gated on those write-backs and record
    // a failed read in this engine),
    if (m.shard_reader) {
      m.wait_at_teardown(m.shard_reader->submit([] { return Status::Ok(); }, {}, "the end of the shard reader's queue",
                                                /*sticky=*/false),
                         "the parameter shard reader's queued reads");
      m.shard_reader.reset();
    }
    // the checkpoint save in flight (its snapshot was taken: it only writes
    // files; rank 0 does not wait for peers that may have failed),
    impl_->abandon_save();
    impl_->wait_save().status().ignore();
    // then the copies and the collectives lent those buffers.
    if (m.xfer) {
      m.wait_at_teardown(m.xfer->record_completion(), "the engine's copies");
      m.xfer->synchronize().ignore();
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
  if (faults != nullptr) impl->faults = *faults;  // before init(): the NVMe tiers open through its I/O engines
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
  if (layer_index >= m.layers.size())
    return InvalidArgument(fmt::format("put_initial_layer(): layer {} is out of range (the model has {} layers)",
                                       layer_index, m.layers.size()));
  const LayerSpec& spec = m.model.layers()[layer_index];
  const std::string lname = fmt::format("layer {} '{}'", layer_index, printable(spec.name, 64));
  if (m.steps_begun != 0 || m.optimizer_steps != 0)
    return FailedPrecondition(fmt::format("put_initial_layer() of {}: training has begun ({} step(s)); initial "
                                          "values go in before the first step",
                                          lname, m.steps_begun));
  if (params.size() != spec.param_bytes)
    return InvalidArgument(fmt::format("put_initial_layer() of {}: {} bytes given, the layer has {} ({} elements of {})",
                                       lname, params.size(), spec.param_bytes, spec.param_count,
                                       dtype_name(m.layers[layer_index].param_dtype)));
  if (!fp32.empty() && fp32.size() != spec.param_count)
    return InvalidArgument(fmt::format("put_initial_layer() of {}: {} fp32 values given, the layer has {} elements",
                                       lname, fp32.size(), spec.param_count));
  Status st = m.put_initial_layer(layer_index, params, fp32);
  return st.ok() ? st : m.stop_unless_recovered(std::move(st));
}

Status Engine::begin_step() {
  if (!impl_->stopped.ok()) return impl_->stopped;
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

Result<double> Engine::evaluate() {
  if (!impl_->stopped.ok()) return impl_->stopped;
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
  Status st = m.settle(nullptr);
  if (!st.ok()) return m.stop_unless_recovered(std::move(st));
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const std::string what = fmt::format("synchronize(): the parameters of layer {}", li);
    STRATA_RETURN_IF_ERROR(m.wait_status(m.layers[li].params_ready, what));
    STRATA_RETURN_IF_ERROR(m.wait_status(m.layers[li].shard_ready, what));
  }
  STRATA_RETURN_IF_ERROR(m.wait_status(m.xfer->record_completion(), "synchronize(): the engine's copies"));
  STRATA_RETURN_IF_ERROR(m.xfer->synchronize());
  STRATA_RETURN_IF_ERROR(m.tier->flush());  // NVMe: every write-back durable, errors reported
  return m.comm.synchronize();
}

Result<LayerMemory> Engine::acquire(size_t layer_index, Pass pass) { return impl_->acquire(layer_index, pass); }
Status Engine::release(size_t layer_index, Pass pass, const Completion& done) {
  return impl_->release(layer_index, pass, done);
}

const EngineOptions& Engine::options() const { return impl_->opt; }
const Partition& Engine::partition() const { return impl_->part; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
int64_t Engine::optimizer_steps() const { return impl_->optimizer_steps; }

double Engine::loss_scale() const { return impl_->scaler->scale(); }
EngineMemory Engine::predicted_memory() const { return impl_->predicted; }
uint64_t Engine::model_state_bytes() const {
  const Impl& m = *impl_;
  uint64_t total = 0;
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const uint64_t n = m.part.layer(li).elements;
    const Impl::Layer& l = m.layers[li];
    const uint64_t trained = m.grad_bytes() + 2 * dtype_size(m.opt.moment_dtype) + (l.param_dtype == DType::kF32 ? 0 : 4);
    total += n * (l.element_bytes + (l.frozen ? 0 : trained));  // a frozen layer holds its parameters only
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

// A frozen layer's parameters as fp32, this rank's shard layout (a
// persistent layer's own pieces from its full copy).
Result<std::vector<float>> Engine::Impl::frozen_shard_fp32(size_t li) {
  const Layer& l = layers[li];
  const LayerPartition& layer_part = part.layer(li);
  std::vector<std::byte> shard(layer_part.shard_elements * l.element_bytes);
  if (l.persistent) {
    for (const SubGroup& g : layer_part.groups)
      STRATA_RETURN_IF_ERROR(device.copy(shard.data() + g.shard_offset * l.element_bytes,
                                         l.full_params.as<std::byte>() + layer_part.piece_begin(g, rank) * l.element_bytes,
                                         g.piece * l.element_bytes, CopyKind::kDeviceToHost));
  } else if (l.on_nvme) {
    const std::string name = fmt::format("parameter shard of layer {} '{}'", li, printable(layer_part.name, 64));
    STRATA_ASSIGN_OR_RETURN(ParamSwap::Read rd, param_swap->read(static_cast<uint32_t>(li), shard.size(), name));
    // gather_state() blocks by design (off the step path: tests and export).
    const Status st = wait_status(rd.done, "reading the " + name);
    if (st.ok()) std::memcpy(shard.data(), rd.slot.as<std::byte>(), shard.size());
    rd.slot.release_after(rd.done);  // once the read ended (a timed-out one may still write the slot)
    STRATA_RETURN_IF_ERROR(st);
  } else if (param_on_host()) {
    std::memcpy(shard.data(), l.host_shard.data(), shard.size());
  } else {
    STRATA_RETURN_IF_ERROR(device.copy(shard.data(), l.dev_shard.data(), shard.size(), CopyKind::kDeviceToHost));
  }
  std::vector<float> out(layer_part.shard_elements);
  params_to_fp32(l.param_dtype, shard.data(), out.data(), out.size());
  return out;
}

Result<std::vector<float>> Engine::gather_state(size_t li, StateKind kind) {
  Impl& m = *impl_;
  if (li >= m.layers.size()) return InvalidArgument(fmt::format("layer {} out of range", li));
  if (m.layers[li].frozen && kind != StateKind::kMaster)
    return FailedPrecondition(fmt::format("layer {} '{}' is frozen: it has no optimizer state (only kMaster, its "
                                          "parameters, can be gathered)",
                                          li, printable(m.part.layer(li).name, 64)));
  STRATA_RETURN_IF_ERROR(synchronize());
  const LayerPartition& layer_part = m.part.layer(li);
  // This rank's own pieces in shard layout, as fp32.
  std::vector<float> mine(layer_part.shard_elements, 0.0f);
  if (m.layers[li].frozen) {
    STRATA_ASSIGN_OR_RETURN(mine, m.frozen_shard_fp32(li));
  } else for (size_t gi = 0; gi < layer_part.groups.size(); ++gi) {
    float* out = mine.data() + layer_part.groups[gi].shard_offset;
    STRATA_RETURN_IF_ERROR(m.read_piece_state(li, gi, m.rank, kind == StateKind::kMaster ? out : nullptr,
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
                     offload_device_name(o.offload_optimizer), impl_->tier->describe(),
                     offload_device_name(o.offload_param), dtype_name(o.grad_dtype), impl_->world,
                     impl_->world == 1 ? "" : "s");
}

}  // namespace strata::offload
