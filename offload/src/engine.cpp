// The ZeRO engine (engine.h): state, the provider hooks and the step.
//
// Threads: the driving thread calls step(), evaluate() and, through the
// runner, acquire/release. It issues every collective (one issuing thread
// per comm queue: kReduce for gradients, norms and losses, kGather for
// parameter gathers). The optimizer runs on `worker` (SerialWorker); copies,
// memsets and stream-ordered frees run on `xfer`, a stream of the Device.
// Completions order everything (docs/async.md); the driving thread blocks
// only where the step needs a number (the loss, the global norm).
#include "strata/offload/engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "serial_worker.h"
#include "strata/core/dtype_convert.h"
#include "strata/core/memory_stats.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/grad_stats.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/grad_norm.h"
#include "strata/offload/loss_scaler.h"
#include "strata/offload/lr_schedule.h"
#include "strata/offload/state_tier.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Pinned host memory from the Device, counted in the engine's host stats.
class HostBuffer {
 public:
  HostBuffer() = default;
  static Result<HostBuffer> create(Device& device, MemoryStats& stats, size_t bytes, const std::string& what) {
    Result<void*> p = device.allocate_pinned_host(bytes == 0 ? 64 : bytes);
    if (!p.ok())
      return OutOfMemory(fmt::format("{} ({}) could not be allocated in pinned host memory: {}", what,
                                     format_bytes(bytes, true), p.status().message()));
    HostBuffer b;
    b.device_ = &device;
    b.stats_ = &stats;
    b.data_ = static_cast<std::byte*>(*p);
    b.bytes_ = bytes == 0 ? 64 : bytes;
    std::memset(b.data_, 0, b.bytes_);
    stats.on_allocate(Tier::kPinnedHost, b.bytes_);
    return b;
  }
  HostBuffer(HostBuffer&& o) noexcept { swap(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    HostBuffer t(std::move(o));
    swap(t);
    return *this;
  }
  ~HostBuffer() {
    if (data_ != nullptr) {
      device_->free_pinned_host(data_, bytes_);
      stats_->on_free(Tier::kPinnedHost, bytes_);
    }
  }
  std::byte* data() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void swap(HostBuffer& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(stats_, o.stats_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
  }
  Device* device_ = nullptr;
  MemoryStats* stats_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

// Wall-clock moments of one forward wait, filled by callbacks on other threads.
struct WaitProbe {
  std::atomic<int64_t> reached_ns{-1};  // the model's stream reached the layer
  std::atomic<int64_t> update_ns{-1};   // the optimizer's update of the layer was in place
  std::atomic<int64_t> ready_ns{-1};    // everything the layer waited for was done
};
int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

}  // namespace

struct Engine::Impl {
  EngineOptions opt;
  ModelRunner& runner;
  const LayeredModel& model;
  Device& device;
  comm::Communicator& comm;
  int world = 1, rank = 0;
  Partition part;
  // What this engine holds: device (its own buffers and device optimizer
  // state, not the model's activations), pinned and pageable host memory.
  MemoryStats stats;
  EngineMemory predicted;
  std::unique_ptr<Stream> xfer;
  std::unique_ptr<Stream> frees;  // only frees: never gated
  std::unique_ptr<OptimizerStateTier> tier;      // the optimizer state (the host part with ratio < 1)
  std::unique_ptr<OptimizerStateTier> dev_tier;  // ratio < 1: the device part
  std::optional<cpu_adam::CpuOptimizer> optimizer;
  std::optional<cpu_adam::CpuOptimizer> dev_optimizer;  // ratio < 1: steps the device part (its own thread)
  std::optional<LrSchedule> schedule;
  std::optional<LossScaler> scaler;
  Stream* model_stream = nullptr;
  Engine* self = nullptr;
  std::unique_ptr<SerialWorker> worker;  // last-but-one: destroyed before the state it steps
  std::unique_ptr<SerialWorker> dev_worker;  // ratio < 1: steps the device part at the same time

  struct Layer {
    DType pd = DType::kF32;  // parameter dtype
    size_t pe = 4;           // its size
    bool persistent = true;  // full parameters stay on the device
    DeviceBuffer full_params;
    Completion params_ready;
    DeviceBuffer dev_shard;  // stage 3, offload_param none
    HostBuffer host_shard;   // stage 3, offload_param cpu
    Completion shard_ready;
    DeviceBuffer gathered;   // stage 3: this layer gathered
    Completion gathered_ready;
    Completion last_use;            // the `done` of the latest release of the gathered copy
    bool gathered_valid = false;
    int held = 0;
    // gradients
    DeviceBuffer full_grads;
    int64_t zeroed_step = -1;
    Completion grads_zeroed;
    Completion grad_done;           // `done` of the latest kBackward release
    int bwd_releases = 0;           // this micro-batch
    bool reduce_launched = false;   // this step
    Completion grads_consumed;      // everything that read full_grads this step
    // optimizer input
    DeviceBuffer opt_grads_dev;     // owned layout, when the optimizer tier is the device and grads are not in place
    HostBuffer opt_grads_host;      // owned layout, offload_optimizer cpu
    HostBuffer staging;             // updated 16-bit (or fp32 master) values before their H2D copy
    Completion grads_taken;
    std::vector<double> block_sums; // owned blocks, owned order
    Completion partials_done;
    Completion opt_done;
    std::shared_ptr<WaitProbe> probe;  // this step's forward wait, when measured
  };
  std::vector<Layer> layers;

  // acquire sequence of one micro-batch, recorded in the first one
  std::vector<std::pair<size_t, Pass>> trace;
  bool tracing = true;
  size_t cursor = 0;
  std::vector<int> expected_bwd;  // kBackward acquires per layer per micro-batch
  std::vector<int> forward_acquires;  // kForward acquires per layer in the first micro-batch
  bool window_spans_micro_batch = false;  // max(reuse, prefetch) >= every stage-3 use of a micro-batch
  std::vector<std::vector<size_t>> uses;  // trace positions of each layer

  int64_t steps = 0;        // applied updates
  int64_t step_index = 0;   // step() calls, for zeroing
  int micro = 0;
  bool in_train_micro = false;
  bool in_eval = false;
  bool last_micro = false;
  // Device elements held by stage-3 gathers and stage 2-3 full gradients,
  // including lent buffers not yet freed: what the caps
  // (stage3_max_live_parameters, reduce_bucket_size) bound.
  //
  // A buffer the engine lent out (to the model's stream, a collective, a
  // copy) is freed only once `safe` has completed, successfully or not:
  // then nobody uses it any more. Frees are not left to a stream's order
  // alone, because a failed stream skips its waits and would free early.
  struct Deferred {
    Completion safe;
    DeviceBuffer buffer;
    uint64_t elements = 0;
  };
  struct LiveCount {
    uint64_t held = 0;              // allocated and not handed back
    std::deque<Deferred> freeing;   // handed back, waiting for `safe`, in order
  };
  LiveCount live_params, live_grads;
  // per-step counters
  uint64_t h2d_bytes = 0, d2h_bytes = 0, gather_bytes = 0, reduce_bytes = 0;
  std::vector<std::shared_ptr<WaitProbe>> probes;
  std::array<std::byte, 4> fault_bytes{};  // the injected gradient value, in the gradient dtype

  Impl(const EngineOptions& o, ModelRunner& r, Device& d, comm::Communicator& c)
      : opt(o), runner(r), model(r.model()), device(d), comm(c) {}

  bool stage0() const { return opt.stage == 0; }
  bool opt_on_host() const { return opt.offload_optimizer == OffloadDevice::kCpu; }
  bool param_on_host() const { return opt.offload_param == OffloadDevice::kCpu; }
  size_t ge() const { return dtype_size(opt.grad_dtype); }
  // Grads are read by the optimizer from the full buffer (no copy) when
  // both live on the device and the full buffer persists (stages 0, 1).
  bool grads_in_place() const { return !opt_on_host() && opt.stage <= 1; }
  bool has_master(const Layer& l) const { return !(l.pd == DType::kF32 && !opt_on_host()); }
  bool split() const { return opt.ratio < 1.0; }
  size_t host_n(size_t count) const { return host_part(opt.ratio, count); }

  // Owned pieces: every rank's at stage 0, this rank's otherwise; the owned
  // layout is padded space at stage 0 and the shard layout otherwise.
  int owned_rank_begin() const { return stage0() ? 0 : rank; }
  int owned_rank_end() const { return stage0() ? world : rank + 1; }
  size_t owned_offset(const LayerPartition& lp, const SubGroup& g, int r) const {
    return stage0() ? lp.piece_begin(g, r) : g.shard_offset;
  }
  size_t owned_elements(const LayerPartition& lp) const { return stage0() ? lp.padded_elements : lp.shard_elements; }

  std::string state_name(size_t layer, size_t group, int r) const {
    return part.describe(StateId{static_cast<uint32_t>(layer), static_cast<uint32_t>(group), r});
  }

  Result<DeviceBuffer> alloc_device(size_t bytes, const std::string& what) {
    Result<DeviceBuffer> b = device.allocate(bytes == 0 ? 64 : bytes);
    if (!b.ok())
      return OutOfMemory(fmt::format("{} ({}) does not fit in device memory on rank {}: {}", what,
                                     format_bytes(bytes, true), rank, b.status().message()));
    stats.on_allocate(Tier::kDevice, b->size_bytes());
    return b;
  }
  // Hands `buffer` back: it is freed once `safe` has completed.
  void free_after(LiveCount& lc, DeviceBuffer&& buffer, Completion safe, uint64_t elements) {
    lc.held -= elements;
    lc.freeing.push_back(Deferred{std::move(safe), std::move(buffer), elements});
  }
  // Frees what is safe to free (oldest first; with `block`, waits for the
  // oldest first). The free runs on `frees`, a stream nothing gates, so it
  // is immediate; synchronizing it makes the memory reusable at once.
  Status reap(LiveCount& lc, bool block) {
    bool freed = false;
    while (!lc.freeing.empty()) {
      Deferred& d = lc.freeing.front();
      if (block) d.safe.wait().ignore();  // failed or not, its users are done
      if (!d.safe.done()) break;
      const uint64_t bytes = d.buffer.size_bytes();
      STRATA_RETURN_IF_ERROR(frees->free_async(std::move(d.buffer)));
      stats.on_free(Tier::kDevice, bytes);
      lc.freeing.pop_front();
      freed = true;
      block = false;
    }
    return freed ? frees->synchronize() : Status::Ok();
  }
  uint64_t live_now(LiveCount& lc) {
    reap(lc, false).ignore();
    uint64_t n = lc.held;
    for (const Deferred& d : lc.freeing) n += d.elements;
    return n;
  }
  // Waits (oldest first) until `more` elements fit under `cap`, or nothing is left to wait for.
  Status make_room(LiveCount& lc, uint64_t more, uint64_t cap) {
    while (live_now(lc) + more > cap && !lc.freeing.empty()) STRATA_RETURN_IF_ERROR(reap(lc, true));
    return Status::Ok();
  }
  Status drain(LiveCount& lc) {
    while (!lc.freeing.empty()) STRATA_RETURN_IF_ERROR(reap(lc, true));
    return Status::Ok();
  }
  EngineMemory plan() const;

  // Where rank piece (g, r)'s parameters live on this rank (device or host pointer).
  std::byte* param_location(size_t li, const SubGroup& g, int r) {
    Layer& l = layers[li];
    const LayerPartition& lp = part.layer(li);
    if (l.persistent) return l.full_params.as<std::byte>() + lp.piece_begin(g, r) * l.pe;
    STRATA_CHECK(r == rank, "a stage-3 rank holds only its own shard");
    if (param_on_host()) return l.host_shard.data() + g.shard_offset * l.pe;
    return l.dev_shard.as<std::byte>() + g.shard_offset * l.pe;
  }

  Status init();
  Status init_layer(size_t li);
  Result<LayerMemory> acquire(size_t li, Pass pass);
  Status release(size_t li, Pass pass, const Completion& done);
  Status issue_gather(size_t li);
  Status make_room_for_gather(size_t li);
  void prefetch_after(size_t position);
  Status drop_gathered(size_t li, const Completion& done);
  Status launch_reduction(size_t li);
  Status queue_update(size_t li, int64_t step, double clip, double scale, double lr);
  struct PieceJob {
    StateId id;
    size_t count = 0;
    const std::byte* grads = nullptr;
    std::byte* param = nullptr;    // where the kernel writes the updated value (param_copy, or fp32 in place)
    bool param_is_master = false;  // fp32 parameters stepped in place
  };
  Status step_pieces(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
                     const cpu_adam::StepArgs& args, DType pd);
  Result<StepMetrics> step();
  Result<double> evaluate();
  Result<double> global_norm_squared();
};

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
  if (opt.offload_optimizer == OffloadDevice::kNvme || opt.offload_param == OffloadDevice::kNvme)
    return Unsupported(fmt::format("{}: nvme offload is not built yet; use \"cpu\"", opt.source));
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
  STRATA_ASSIGN_OR_RETURN(tier, make_memory_state_tier(device, opt_on_host() ? Tier::kPinnedHost : Tier::kDevice,
                                                       opt.moment_dtype, stats));
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
        {predicted.pinned_optimizer, "optimizer state (master weights and moments): move it to nvme (issue 12) or use "
                                     "offload_optimizer.ratio < 1 at stage 3, or strata.optimizer_state_dtype bf16"},
        {predicted.pinned_grads, "gradient shards: use a larger world size or data_types.grad_accum_dtype bf16"},
        {predicted.pinned_staging, "parameter staging: use a larger world size"},
        {predicted.pinned_params, "parameter shards (offload_param cpu): set offload_param.device to none"}};
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
  uses.assign(n, {});
  for (size_t i = 0; i < n; ++i) STRATA_RETURN_IF_ERROR(init_layer(i));
  worker = std::make_unique<SerialWorker>(fmt::format("optimizer of rank {}", rank));
  if (split()) dev_worker = std::make_unique<SerialWorker>(fmt::format("device optimizer of rank {}", rank));
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
    if (!(param_on_host() && !l.persistent)) {
      STRATA_ASSIGN_OR_RETURN(l.staging, HostBuffer::create(device, stats, owned * l.pe,
                                                            "parameter staging of " + lname));
    }
  }
  if ((!opt_on_host() && !grads_in_place()) || split()) {
    STRATA_ASSIGN_OR_RETURN(l.opt_grads_dev, alloc_device(owned * ge(), "gradient shard of " + lname));
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

// ---------------------------------------------------------------- provider hooks

Result<LayerMemory> Engine::Impl::acquire(size_t li, Pass pass) {
  if (li >= layers.size())
    return InvalidArgument(fmt::format("acquire of layer {}: the model has {} layers", li, layers.size()));
  Layer& l = layers[li];
  const LayerPartition& lp = part.layer(li);
  if (in_train_micro) {
    if (tracing) {
      trace.emplace_back(li, pass);
      uses[li].push_back(trace.size() - 1);
      if (pass == Pass::kForward) ++forward_acquires[li];
      if (pass == Pass::kBackward) ++expected_bwd[li];
    }
    ++cursor;
  }
  if (pass == Pass::kBackward && l.reduce_launched)
    return FailedPrecondition(fmt::format(
        "layer {} '{}' was acquired for backward after its gradient reduction started: the model's backward "
        "acquires a layer more often than its forward did (Note [Acquire and release]); the engine needs them to match",
        li, printable(lp.name, 64)));
  LayerMemory mem;
  std::vector<Completion> waits;
  Completion update_ready;
  if (l.persistent) {
    mem.params = l.full_params.as<std::byte>();
    update_ready = l.params_ready;
    waits.push_back(l.params_ready);
  } else {
    if (!l.gathered_valid) {
      // On demand: wait for frees in flight when the live cap would be passed.
      STRATA_RETURN_IF_ERROR(make_room_for_gather(li).with_context("freeing gathered parameters"));
      STRATA_RETURN_IF_ERROR(issue_gather(li));
    }
    update_ready = l.shard_ready;
    mem.params = l.gathered.as<std::byte>();
    waits.push_back(l.gathered_ready);
    if (in_train_micro && !tracing) prefetch_after(cursor - 1);
  }
  ++l.held;
  mem.params_tier = Tier::kDevice;
  if (pass == Pass::kBackward) {
    if (!l.full_grads) {
      // Gradients waiting for their reduction are capped by reduce_bucket_size
      // (stages 2, 3): wait for earlier layers' reductions to free theirs.
      STRATA_RETURN_IF_ERROR(make_room(live_grads, lp.padded_elements, static_cast<uint64_t>(opt.reduce_bucket_size))
                                 .with_context("freeing reduced gradients"));
      live_grads.held += lp.padded_elements;
      STRATA_ASSIGN_OR_RETURN(l.full_grads, alloc_device(lp.padded_elements * ge(),
                                                         fmt::format("gradients of layer {} '{}'", li,
                                                                     printable(lp.name, 64))));
      // Zeroed in the copy stream's order; the model waits for it (below).
      STRATA_RETURN_IF_ERROR(xfer->memset_async(l.full_grads.data(), 0, lp.padded_elements * ge()));
      l.grads_zeroed = xfer->record_completion();
      l.zeroed_step = step_index;
    } else if (l.zeroed_step != step_index) {
      // Persistent gradients: zero once per step, after the last step's readers.
      STRATA_RETURN_IF_ERROR(xfer->wait(l.grads_consumed));
      STRATA_RETURN_IF_ERROR(xfer->memset_async(l.full_grads.data(), 0, lp.padded_elements * ge()));
      l.grads_zeroed = xfer->record_completion();
      l.zeroed_step = step_index;
    }
    waits.push_back(l.grads_zeroed);
    mem.grads = l.full_grads.data();
    mem.grad_dtype = opt.grad_dtype;
    mem.grads_tier = Tier::kDevice;
  }
  bool pending = false;
  for (const Completion& c : waits) pending = pending || !c.done();
  mem.ready = waits.size() == 1 ? waits.front() : when_all(waits, fmt::format("layer {} ready", li));
  // Exposed-wait probe: when the model's stream reaches this layer, and when
  // what it waits for completes.
  if (pending && model_stream != nullptr && pass == Pass::kForward) {
    auto probe = std::make_shared<WaitProbe>();
    STRATA_RETURN_IF_ERROR(model_stream->launch_host([probe] { probe->reached_ns.store(now_ns()); }));
    update_ready.then([probe](const Status&) { probe->update_ns.store(now_ns()); });
    mem.ready.then([probe](const Status&) { probe->ready_ns.store(now_ns()); });
    probes.push_back(std::move(probe));
  }
  return mem;
}

Status Engine::Impl::issue_gather(size_t li) {
  Layer& l = layers[li];
  const LayerPartition& lp = part.layer(li);
  STRATA_ASSIGN_OR_RETURN(l.gathered, alloc_device(lp.padded_elements * l.pe,
                                                   fmt::format("gathered parameters of layer {} '{}'", li,
                                                               printable(lp.name, 64))));
  live_params.held += lp.padded_elements;
  std::byte* full = l.gathered.as<std::byte>();
  if (param_on_host()) {
    // H2D of this rank's pieces into their place, then gather in place.
    STRATA_RETURN_IF_ERROR(xfer->wait(l.shard_ready));
    for (const SubGroup& g : lp.groups)
      STRATA_RETURN_IF_ERROR(xfer->copy_async(full + lp.piece_begin(g, rank) * l.pe,
                                              l.host_shard.data() + g.shard_offset * l.pe, g.piece * l.pe,
                                              CopyKind::kHostToDevice));
    h2d_bytes += lp.shard_elements * l.pe;
    STRATA_RETURN_IF_ERROR(comm.wait(xfer->record_completion(), comm::CommQueue::kGather));
  } else {
    STRATA_RETURN_IF_ERROR(comm.wait(l.shard_ready, comm::CommQueue::kGather));
  }
  Completion last;
  for (const SubGroup& g : lp.groups) {
    const std::byte* send = param_on_host() ? full + lp.piece_begin(g, rank) * l.pe
                                            : l.dev_shard.as<std::byte>() + g.shard_offset * l.pe;
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(send, full + g.padded_begin * l.pe, g.piece, l.pd,
                                                              comm::CommQueue::kGather));
    last = w.completion();
  }
  gather_bytes += lp.padded_elements * l.pe;
  l.gathered_ready = last;
  l.gathered_valid = true;
  return Status::Ok();
}

// stage3_max_live_parameters for an on-demand gather of layer `li`: wait
// for frees in flight, then drop kept (gathered, not held) layers, oldest
// index first, until the gather fits or nothing else can go.
Status Engine::Impl::make_room_for_gather(size_t li) {
  const uint64_t more = part.layer(li).padded_elements, cap = static_cast<uint64_t>(opt.max_live_parameters);
  STRATA_RETURN_IF_ERROR(make_room(live_params, more, cap));
  for (size_t j = 0; j < layers.size() && live_now(live_params) + more > cap; ++j) {
    Layer& k = layers[j];
    if (j == li || k.persistent || !k.gathered_valid || k.held > 0) continue;
    STRATA_RETURN_IF_ERROR(drop_gathered(j, k.last_use));
    STRATA_RETURN_IF_ERROR(make_room(live_params, more, cap));
  }
  return Status::Ok();
}

void Engine::Impl::prefetch_after(size_t position) {
  uint64_t issued = 0;
  for (size_t p = position + 1; p < trace.size(); ++p) {
    const size_t lj = trace[p].first;
    Layer& l = layers[lj];
    if (l.persistent || l.gathered_valid) continue;
    const uint64_t n = part.layer(lj).padded_elements;
    if (issued + n > static_cast<uint64_t>(opt.prefetch_bucket_size)) break;
    if (live_now(live_params) + n > static_cast<uint64_t>(opt.max_live_parameters)) break;
    if (!issue_gather(lj).ok()) break;  // out of memory: it will be fetched on demand (and the error said then)
    issued += n;
  }
}

Status Engine::Impl::drop_gathered(size_t li, const Completion& done) {
  Layer& l = layers[li];
  if (!l.gathered_valid) return Status::Ok();
  // Its users: the gather that filled it (and the H2D before), the model's last pass over it.
  const Completion users[] = {l.gathered_ready, done};
  free_after(live_params, std::move(l.gathered), when_all(users), part.layer(li).padded_elements);
  l.gathered_valid = false;
  return Status::Ok();
}

Status Engine::Impl::release(size_t li, Pass pass, const Completion& done) {
  if (li >= layers.size() || layers[li].held <= 0)
    return FailedPrecondition(fmt::format("release of layer {} that is not held", li));
  Layer& l = layers[li];
  --l.held;
  if (!l.persistent) {
    l.last_use = done;
    if (l.held == 0) {
      // Keep it when its next use in this micro-batch's sequence is near.
      // While the first micro-batch is recorded the next use is unknown: keep
      // the layer when the window spans a whole micro-batch anyway.
      // Evaluation passes reuse the same parameters: keep them until
      // evaluate() ends.
      bool keep = (in_train_micro && tracing && window_spans_micro_batch) || in_eval;
      if (in_train_micro && !tracing) {
        // The next use in this micro-batch's sequence, or, when another
        // micro-batch of this step follows, in its sequence (cyclically).
        const size_t here = cursor - 1, n = trace.size();
        const size_t span = last_micro ? n - here - 1 : n - 1;
        uint64_t distance = 0;
        for (size_t k = 1; k <= span; ++k) {
          const size_t p = (here + k) % n;
          if (trace[p].first == li) {
            // Soon reused, or within the prefetch window (a prefetch would
            // gather it again at once): dropping it would only cost a gather.
            keep = distance <= static_cast<uint64_t>(std::max(opt.max_reuse_distance, opt.prefetch_bucket_size));
            break;
          }
          distance += part.layer(trace[p].first).elements;
        }
      }
      if (!keep) STRATA_RETURN_IF_ERROR(drop_gathered(li, done));
    }
  }
  if (pass == Pass::kBackward) {
    l.grad_done = done;
    ++l.bwd_releases;
    // A layer's gradient is complete at its last backward release: as many
    // as the recorded sequence has, or, while the first micro-batch is being
    // recorded, as many as its forward acquires (a backward mirrors its
    // forward; acquire() fails loudly if a model breaks that).
    const int expected = tracing ? forward_acquires[li] : expected_bwd[li];
    if (in_train_micro && last_micro && l.bwd_releases == expected && !l.reduce_launched)
      STRATA_RETURN_IF_ERROR(launch_reduction(li));
  }
  return Status::Ok();
}

// Sums the layer's gradient over ranks (reduce-scatter in rank order; stage
// 0 gathers the reduced pieces back), moves the owned pieces to where the
// optimizer reads them, and queues their block sums.
Status Engine::Impl::launch_reduction(size_t li) {
  Layer& l = layers[li];
  const LayerPartition& lp = part.layer(li);
  l.reduce_launched = true;
  if (!l.full_grads) {  // no backward touched the layer: its gradient is zero
    live_grads.held += lp.padded_elements;
    STRATA_ASSIGN_OR_RETURN(l.full_grads, alloc_device(lp.padded_elements * ge(), fmt::format("gradients of layer {}", li)));
    STRATA_RETURN_IF_ERROR(device.memset(l.full_grads.data(), 0, lp.padded_elements * ge()));
  }
  std::byte* full = l.full_grads.as<std::byte>();
  const size_t e = ge();
  Completion local = l.grad_done;
  if (opt.fault_step == step_index && opt.fault_rank == rank && opt.fault_layer == li) {
    const float v = opt.fault_value;
    if (opt.grad_dtype == DType::kF32) std::memcpy(fault_bytes.data(), &v, 4);
    if (opt.grad_dtype == DType::kBF16) convert_fp32_to_bf16(&v, reinterpret_cast<bfloat16*>(fault_bytes.data()), 1);
    if (opt.grad_dtype == DType::kF16) convert_fp32_to_fp16(&v, reinterpret_cast<float16*>(fault_bytes.data()), 1);
    STRATA_RETURN_IF_ERROR(xfer->wait(l.grad_done));
    STRATA_RETURN_IF_ERROR(xfer->copy_async(full, fault_bytes.data(), e, CopyKind::kHostToDevice));
    local = xfer->record_completion();
  }
  STRATA_RETURN_IF_ERROR(comm.wait(local, comm::CommQueue::kReduce));
  Completion reduced;
  for (const SubGroup& g : lp.groups) {
    std::byte* send = full + g.padded_begin * e;
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.reduce_scatter(send, send + g.piece * rank * e, g.piece,
                                                                  opt.grad_dtype, comm::ReduceOp::kSum,
                                                                  comm::CommQueue::kReduce));
    reduced = w.completion();
  }
  reduce_bytes += lp.padded_elements * e;
  if (stage0()) {
    for (const SubGroup& g : lp.groups) {
      STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(full + lp.piece_begin(g, rank) * e,
                                                                full + g.padded_begin * e, g.piece, opt.grad_dtype,
                                                                comm::CommQueue::kReduce));
      reduced = w.completion();
    }
    reduce_bytes += lp.padded_elements * e;
  }
  // Where the optimizer reads the owned pieces.
  std::byte* dst = nullptr;
  CopyKind kind = CopyKind::kDeviceToDevice;
  if (opt_on_host()) {
    dst = l.opt_grads_host.data();
    kind = CopyKind::kDeviceToHost;
  } else if (!grads_in_place()) {
    dst = l.opt_grads_dev.as<std::byte>();
  }
  if (dst == nullptr) {
    l.grads_taken = reduced;
  } else if (split()) {
    // ratio < 1: the whole piece stays on the device (the device part steps
    // from there, the block sums read it), only the host part goes D2H.
    STRATA_RETURN_IF_ERROR(xfer->wait(reduced));
    std::byte* dev = l.opt_grads_dev.as<std::byte>();
    for (const SubGroup& g : lp.groups) {
      const std::byte* piece = full + lp.piece_begin(g, rank) * e;
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dev + g.shard_offset * e, piece, g.piece * e, CopyKind::kDeviceToDevice));
      const size_t host = host_n(lp.piece_real(g, rank));
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dst + g.shard_offset * e, piece, host * e, CopyKind::kDeviceToHost));
      d2h_bytes += host * e;
    }
    dst = dev;  // where the block sums read
  } else {
    STRATA_RETURN_IF_ERROR(xfer->wait(reduced));
    if (stage0()) {
      STRATA_RETURN_IF_ERROR(xfer->copy_async(dst, full, lp.padded_elements * e, kind));
    } else {
      for (const SubGroup& g : lp.groups)
        STRATA_RETURN_IF_ERROR(
            xfer->copy_async(dst + g.shard_offset * e, full + lp.piece_begin(g, rank) * e, g.piece * e, kind));
    }
    if (kind == CopyKind::kDeviceToHost) d2h_bytes += owned_elements(lp) * e;
  }
  if (dst != nullptr) {
    l.grads_taken = xfer->record_completion();
    if (opt.stage >= 2) {
      // Its users: the model's backward, the reduction in place, the copy out.
      const Completion users[] = {l.grad_done, reduced, l.grads_taken};
      free_after(live_grads, std::move(l.full_grads), when_all(users), lp.padded_elements);
    }
  }
  // Block sums of the owned pieces (padding blocks sum to zero).
  const std::byte* src = dst != nullptr ? dst : full;
  const bool in_padded_layout = dst == nullptr || stage0();
  l.partials_done = worker->submit(
      [this, li, src, in_padded_layout] {
        Layer& lay = layers[li];
        const LayerPartition& p = part.layer(li);
        size_t out = 0;
        for (const SubGroup& g : p.groups)
          for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
            const size_t at = in_padded_layout ? p.piece_begin(g, r) : g.shard_offset;
            block_sums_of_squares(src + at * ge(), opt.grad_dtype, g.piece, kShardAlign,
                                  std::span<double>(lay.block_sums.data() + out, g.piece / kShardAlign));
            out += g.piece / kShardAlign;
          }
        return Status::Ok();
      },
      l.grads_taken, fmt::format("gradient block sums of layer {}", li));
  l.grads_consumed = l.partials_done;
  return Status::Ok();
}

// ---------------------------------------------------------------- the step

Result<double> Engine::Impl::global_norm_squared() {
  // Every layer's block sums, this rank's owned order, layer by layer.
  std::vector<double> mine;
  for (size_t li = 0; li < layers.size(); ++li) {
    STRATA_RETURN_IF_ERROR(layers[li].partials_done.wait().with_context(
        fmt::format("reducing the gradients of layer {} on rank {}", li, rank)));
    mine.insert(mine.end(), layers[li].block_sums.begin(), layers[li].block_sums.end());
  }
  double total = 0;
  if (stage0()) {
    for (double v : mine) total += v;  // already in (layer, group, rank, block) order
    return total;
  }
  std::vector<double> all(mine.size() * world);
  STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(mine.data(), all.data(), mine.size(), DType::kF64,
                                                            comm::CommQueue::kReduce));
  STRATA_RETURN_IF_ERROR(w.wait().with_context("gathering the gradient norm's block sums"));
  // all[r] holds rank r's blocks in (layer, group, block) order; add in
  // (layer, group, rank, block) order, as stage 0 does.
  size_t layer_base = 0;
  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerPartition& lp = part.layer(li);
    for (const SubGroup& g : lp.groups) {
      const size_t nb = g.piece / kShardAlign, gb = layer_base + g.shard_offset / kShardAlign;
      for (int r = 0; r < world; ++r)
        for (size_t j = 0; j < nb; ++j) total += all[static_cast<size_t>(r) * mine.size() + gb + j];
    }
    layer_base += lp.shard_elements / kShardAlign;
  }
  return total;
}

Status Engine::Impl::queue_update(size_t li, int64_t step, double clip, double scale, double lr) {
  Layer& l = layers[li];
  const LayerPartition& lp = part.layer(li);
  // Pointers are computed here (driving thread); the workers only step.
  std::vector<PieceJob> host_jobs, dev_jobs;
  const std::byte* gsrc = opt_on_host() ? l.opt_grads_host.data()
                          : grads_in_place() ? l.full_grads.as<std::byte>()
                                             : l.opt_grads_dev.as<std::byte>();
  const bool gpadded = grads_in_place() || stage0();
  for (size_t gi = 0; gi < lp.groups.size(); ++gi) {
    const SubGroup& g = lp.groups[gi];
    for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
      const size_t count = lp.piece_real(g, r), host = host_n(count);
      PieceJob j;
      j.id = StateId{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      j.count = host;
      j.grads = gsrc + (gpadded ? lp.piece_begin(g, r) : g.shard_offset) * ge();
      j.param_is_master = !has_master(l);
      j.param = l.staging ? l.staging.data() + owned_offset(lp, g, r) * l.pe : param_location(li, g, r);
      host_jobs.push_back(j);
      if (split()) {
        // The device part: grads from the device copy, the update straight
        // into the device parameters (fp32: they are the master).
        PieceJob d;
        d.id = j.id;
        d.count = count - host;
        d.grads = l.opt_grads_dev.as<std::byte>() + (g.shard_offset + host) * ge();
        d.param = param_location(li, g, r) + host * l.pe;
        d.param_is_master = l.pd == DType::kF32;
        dev_jobs.push_back(d);
      }
    }
  }
  cpu_adam::StepArgs args;
  args.step = step;
  args.hyper = opt.hyper;
  args.hyper.lr = lr;
  args.clip_coefficient = clip;
  args.loss_scale = scale;
  args.overflow_check = cpu_adam::OverflowCheck::kAssumeFinite;
  const DType pd = l.pd;
  l.opt_done = worker->submit([this, jobs = std::move(host_jobs), args, pd] { return step_pieces(*tier, *optimizer, jobs, args, pd); },
                              l.partials_done, fmt::format("optimizer step of layer {}", li));
  if (split()) {
    const Completion dev_done =
        dev_worker->submit([this, jobs = std::move(dev_jobs), args, pd] { return step_pieces(*dev_tier, *dev_optimizer, jobs, args, pd); },
                           l.partials_done, fmt::format("device optimizer step of layer {}", li));
    const Completion both[] = {l.opt_done, dev_done};
    l.opt_done = when_all(both, fmt::format("optimizer step of layer {}", li));
  }
  l.grads_consumed = l.opt_done;
  Completion updated = l.opt_done;
  if (l.staging) {
    // H2D of the updated owned pieces into the device parameters.
    STRATA_RETURN_IF_ERROR(xfer->wait(l.opt_done));
    for (const SubGroup& g : lp.groups)
      for (int r = owned_rank_begin(); r < owned_rank_end(); ++r) {
        const size_t at = owned_offset(lp, g, r);
        // ratio < 1: only the host part (the device part is already in place).
        const size_t n = split() ? host_n(lp.piece_real(g, r)) : g.piece;
        STRATA_RETURN_IF_ERROR(xfer->copy_async(param_location(li, g, r), l.staging.data() + at * l.pe, n * l.pe,
                                                CopyKind::kHostToDevice));
        h2d_bytes += n * l.pe;
      }
    updated = xfer->record_completion();
  }
  if (l.persistent) {
    if (!stage0()) {
      STRATA_RETURN_IF_ERROR(comm.wait(updated, comm::CommQueue::kGather));
      std::byte* full = l.full_params.as<std::byte>();
      for (const SubGroup& g : lp.groups) {
        STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_gather(full + lp.piece_begin(g, rank) * l.pe,
                                                                  full + g.padded_begin * l.pe, g.piece, l.pd,
                                                                  comm::CommQueue::kGather));
        updated = w.completion();
      }
      gather_bytes += lp.padded_elements * l.pe;
    }
    l.params_ready = updated;
  } else {
    l.shard_ready = updated;
  }
  return Status::Ok();
}

Status Engine::Impl::step_pieces(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
                                 const cpu_adam::StepArgs& args, DType pd) {
  for (const PieceJob& j : jobs) {
    if (j.count == 0) continue;
    STRATA_ASSIGN_OR_RETURN(PieceState st, t.open(j.id));
    cpu_adam::StateSpans sp;
    sp.count = j.count;
    sp.grads = j.grads;
    sp.grad_dtype = opt.grad_dtype;
    sp.exp_avg = st.exp_avg;
    sp.exp_avg_sq = st.exp_avg_sq;
    sp.moment_dtype = st.moment_dtype;
    if (j.param_is_master) {
      sp.params = reinterpret_cast<float*>(j.param);
    } else {
      sp.params = st.master;
      if (pd != DType::kF32) {
        sp.param_copy = j.param;
        sp.param_copy_dtype = pd;
      }
    }
    Result<cpu_adam::StepReport> rep = o.step(args, sp);
    if (!rep.ok()) return rep.status().with_context(fmt::format("optimizer step of {}", part.describe(j.id)));
    if (!j.param_is_master && pd == DType::kF32) std::memcpy(j.param, st.master, j.count * sizeof(float));
    STRATA_RETURN_IF_ERROR(t.close(j.id, true));
  }
  return Status::Ok();
}

Result<StepMetrics> Engine::Impl::step() {
  const auto t0 = Clock::now();
  const double old_busy = worker->busy_seconds();
  h2d_bytes = d2h_bytes = gather_bytes = reduce_bytes = 0;
  probes.clear();
  STRATA_RETURN_IF_ERROR(drain(live_params));  // an evaluation's dropped copies
  ++step_index;
  for (Layer& l : layers) l.reduce_launched = false;
  const double scale = scaler->scale();
  const double dloss = scale / (static_cast<double>(opt.grad_accum) * world);
  double loss_sum = 0, fwd_ms = 0, bwd_ms = 0;
  for (micro = 0; micro < opt.grad_accum; ++micro) {
    last_micro = micro == opt.grad_accum - 1;
    for (Layer& l : layers) l.bwd_releases = 0;
    cursor = 0;
    in_train_micro = true;
    const auto tf = Clock::now();
    Result<float> loss = runner.train_micro_batch(static_cast<float>(dloss), *self);
    in_train_micro = false;
    if (!loss.ok()) return loss.status().with_context(fmt::format("micro-batch {} on rank {}", micro + 1, rank));
    fwd_ms += ms_since(tf);
    loss_sum += *loss;
    if (tracing) {
      tracing = false;  // the sequence is known from now on
    }
    for (size_t li = 0; li < layers.size(); ++li) {
      Layer& l = layers[li];
      // Stage 3 drops gathered copies at the end of a step's last backward
      // (the update will change them); kept ones wait for their last reader.
      if (last_micro && !l.persistent && l.held == 0) STRATA_RETURN_IF_ERROR(drop_gathered(li, l.last_use));
      if (last_micro && !l.reduce_launched) STRATA_RETURN_IF_ERROR(launch_reduction(li));
    }
  }
  const auto tb = Clock::now();
  for (size_t li = 0; li < layers.size(); ++li)
    STRATA_RETURN_IF_ERROR(layers[li].grad_done.wait().with_context(fmt::format("backward of layer {}", li)));
  bwd_ms = ms_since(tb);
  const auto tr = Clock::now();
  STRATA_ASSIGN_OR_RETURN(double sum_squares, global_norm_squared());
  // The loss of the global batch: every rank's micro-batch losses, in rank order.
  double loss_all = 0;
  {
    STRATA_ASSIGN_OR_RETURN(comm::CommWork w, comm.all_reduce(&loss_sum, &loss_all, 1, DType::kF64,
                                                              comm::ReduceOp::kSum, comm::CommQueue::kReduce));
    STRATA_RETURN_IF_ERROR(w.wait().with_context("summing the loss over ranks"));
  }
  const double wait_reduce_ms = ms_since(tr);
  StepMetrics m;
  m.loss = loss_all / (static_cast<double>(opt.grad_accum) * world);
  m.loss_scale = scale;
  m.grad_norm = std::sqrt(sum_squares) / scale;
  const bool finite = std::isfinite(sum_squares);
  if (!std::isfinite(m.loss) && opt.fp16.enabled == false)
    return DataLoss(fmt::format("step {}: the loss is {} (not finite); training stopped", steps + 1, m.loss));
  if (!finite && !opt.fp16.enabled)
    return DataLoss(fmt::format("step {}: the gradient norm is not finite ({}); training stopped (only fp16 skips "
                                "steps on overflow)",
                                steps + 1, m.grad_norm));
  m.skipped = !finite;
  STRATA_RETURN_IF_ERROR(scaler->update(!finite).with_context(fmt::format("step {}", steps + 1)));
  m.lr = schedule->lr(steps + 1);
  if (finite) {
    ++steps;
    const double clip = cpu_adam::clip_coefficient(m.grad_norm, opt.grad_clip);
    for (size_t li = 0; li < layers.size(); ++li) STRATA_RETURN_IF_ERROR(queue_update(li, steps, clip, scale, m.lr));
    if (!opt.overlap_optimizer)
      for (size_t li = 0; li < layers.size(); ++li) {
        Layer& l = layers[li];
        STRATA_RETURN_IF_ERROR((l.persistent ? l.params_ready : l.shard_ready).wait());
      }
  }
  m.step = steps;
  m.step_ms = ms_since(t0);
  m.forward_ms = fwd_ms;
  m.backward_ms = bwd_ms;
  m.wait_reduce_ms = wait_reduce_ms;
  m.optimizer_ms = (worker->busy_seconds() - old_busy) * 1e3;
  for (const auto& p : probes) {
    const int64_t reached = p->reached_ns.load(), upd = p->update_ns.load(), ready = p->ready_ns.load();
    if (reached < 0 || ready < 0) continue;
    const double total = std::max<int64_t>(0, ready - reached) / 1e6;
    const double on_update = upd < 0 ? 0 : std::max<int64_t>(0, std::min(upd, ready) - reached) / 1e6;
    m.wait_optimizer_ms += on_update;
    m.wait_gather_ms += total - on_update;
  }
  m.tokens_per_s = static_cast<double>(runner.tokens_per_micro_batch()) * opt.grad_accum * world / (m.step_ms / 1e3);
  m.h2d_bytes = h2d_bytes;
  m.d2h_bytes = d2h_bytes;
  m.gather_bytes = gather_bytes;
  m.reduce_bytes = reduce_bytes;
  m.peak_device_bytes = device.memory_stats().get(Tier::kDevice).peak_bytes;
  m.peak_pinned_bytes = stats.get(Tier::kPinnedHost).peak_bytes;
  m.peak_host_bytes = stats.get(Tier::kPageableHost).peak_bytes;
  m.peak_nvme_bytes = 0;
  return m;
}

Result<double> Engine::Impl::evaluate() {
  double sum = 0;
  const size_t count = runner.eval_batch_count();
  STRATA_RETURN_IF_ERROR(drain(live_params));  // the step's dropped copies are gone before eval gathers
  in_eval = true;
  for (size_t b = 0; b < count; ++b) {
    Result<float> loss = runner.eval_batch(b, *self);
    if (!loss.ok()) {
      in_eval = false;
      return loss.status();
    }
    sum += *loss;
  }
  in_eval = false;
  // Stage 3: nothing stays gathered between evaluations.
  for (size_t li = 0; li < layers.size(); ++li)
    if (!layers[li].persistent && layers[li].held == 0)
      STRATA_RETURN_IF_ERROR(drop_gathered(li, layers[li].last_use));
  double all = 0;
  STRATA_ASSIGN_OR_RETURN(comm::CommWork w,
                          comm.all_reduce(&sum, &all, 1, DType::kF64, comm::ReduceOp::kSum, comm::CommQueue::kReduce));
  STRATA_RETURN_IF_ERROR(w.wait().with_context("summing the validation loss over ranks"));
  return all / (static_cast<double>(count) * world);
}

// ---------------------------------------------------------------- Engine

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_) {
    // The model's stream may still run work that reads or writes the
    // engine's buffers (a step that failed half-way): let it finish first.
    if (impl_->model_stream) impl_->model_stream->synchronize().ignore();
    if (impl_->xfer) impl_->xfer->synchronize().ignore();
    impl_->comm.synchronize().ignore();
    if (impl_->worker) impl_->worker.reset();  // runs what is queued; the state it steps is still alive
    if (impl_->dev_worker) impl_->dev_worker.reset();
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

Result<StepMetrics> Engine::step() { return impl_->step(); }
Result<double> Engine::evaluate() { return impl_->evaluate(); }

Status Engine::synchronize() {
  for (auto& l : impl_->layers) {
    STRATA_RETURN_IF_ERROR(l.params_ready.wait());
    STRATA_RETURN_IF_ERROR(l.shard_ready.wait());
  }
  STRATA_RETURN_IF_ERROR(impl_->xfer->synchronize());
  return impl_->comm.synchronize();
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
  return m;
}

Result<std::vector<float>> Engine::gather_state(size_t li, StateKind kind) {
  Impl& m = *impl_;
  if (li >= m.layers.size()) return InvalidArgument(fmt::format("layer {} out of range", li));
  STRATA_RETURN_IF_ERROR(synchronize());
  const LayerPartition& lp = m.part.layer(li);
  Impl::Layer& l = m.layers[li];
  // This rank's own pieces in shard layout, as fp32.
  std::vector<float> mine(lp.shard_elements, 0.0f);
  // One tier's part of a piece (`count` elements from element `first`) into `out`.
  auto read_part = [&](OptimizerStateTier& t, const StateId& id, const SubGroup& g, size_t first, size_t count,
                       float* out) -> Status {
    if (count == 0) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(PieceState s, t.open(id));
    if (kind != StateKind::kMaster) {
      const void* src = kind == StateKind::kExpAvg ? s.exp_avg : s.exp_avg_sq;
      if (s.moment_dtype == DType::kF32)
        std::memcpy(out, src, count * sizeof(float));
      else
        convert_bf16_to_fp32(static_cast<const bfloat16*>(src), out, count);
    } else if (s.master != nullptr) {
      std::memcpy(out, s.master, count * sizeof(float));
    } else {
      // fp32 parameters are their own master, in device memory.
      STRATA_RETURN_IF_ERROR(m.device.copy(out, m.param_location(li, g, m.rank) + first * l.pe, count * l.pe,
                                           CopyKind::kDeviceToHost));
    }
    return t.close(id, false);
  };
  for (size_t gi = 0; gi < lp.groups.size(); ++gi) {
    const SubGroup& g = lp.groups[gi];
    const size_t count = lp.piece_real(g, m.rank), host = m.host_n(count);
    const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), m.rank};
    float* out = mine.data() + g.shard_offset;
    STRATA_RETURN_IF_ERROR(read_part(*m.tier, id, g, 0, host, out));
    if (m.split()) STRATA_RETURN_IF_ERROR(read_part(*m.dev_tier, id, g, host, count - host, out + host));
  }
  std::vector<float> all(lp.shard_elements * m.world);
  STRATA_ASSIGN_OR_RETURN(comm::CommWork w, m.comm.all_gather(mine.data(), all.data(), lp.shard_elements, DType::kF32,
                                                              comm::CommQueue::kReduce));
  STRATA_RETURN_IF_ERROR(w.wait());
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
