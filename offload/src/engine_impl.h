#pragma once
// Engine::Impl: the state of one rank's engine, shared by engine.cpp (set-up
// and the public methods), engine_passes.cpp (the provider hooks: acquire,
// release, stage-3 gathers, gradient reductions) and engine_step.cpp (the
// global norm, the update, the step, evaluation). Private to offload/src.
//
// Threads: the driving thread calls the step's calls (Note [Driving the
// engine]) and acquire/release. It issues every collective (one issuing
// thread per comm queue: kReduce for gradients, norms and losses, kGather
// for stage-3 gathers in acquire order, kUpdate for the gathers that follow
// a persistent layer's update, in update order: a gate per layer, so a
// gather waiting for a late update never holds up the next forward's). The optimizer runs on `worker` (SerialWorker); copies
// and memsets run on `xfer`, a stream of the Device; frees on `frees`.
// Completions order everything (docs/async.md); the driving thread blocks
// only where the step needs a number (the loss, the global norm).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <optional>
#include <map>
#include <mutex>
#include <span>
#include <fmt/format.h>
#include "acquire_trace.h"
#include "lent_buffers.h"
#include "param_swap.h"
#include "serial_worker.h"
#include "strata/core/dtype_convert.h"
#include "strata/core/memory_stats.h"
#include "strata/core/spec_model.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/grad_stats.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/grad_norm.h"
#include "strata/offload/loss_scaler.h"
#include "strata/offload/lr_schedule.h"
#include "strata/offload/state_tier.h"
#include "strata/comm/host_collective.h"
#include "strata/offload/device_adam.h"
#include "strata/offload/engine.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/testing/engine_faults.h"

namespace strata::offload {
namespace engine_detail {

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Pinned host memory from the Device, which counts it in the engine's stats
// (Note [Accounts] in strata/core/device.h).
class HostBuffer {
 public:
  HostBuffer() = default;
  static Result<HostBuffer> create(Device& device, MemoryStats& stats, size_t bytes, const std::string& what) {
    Result<void*> p = device.allocate_pinned_host(bytes == 0 ? 64 : bytes, stats);
    if (!p.ok())
      return OutOfMemory(fmt::format("{} ({}) could not be allocated in pinned host memory: {}", what,
                                     format_bytes(bytes, true), p.status().message()));
    HostBuffer b;
    b.device_ = &device;
    b.data_ = static_cast<std::byte*>(*p);
    b.bytes_ = bytes == 0 ? 64 : bytes;
    std::memset(b.data_, 0, b.bytes_);
    return b;
  }
  HostBuffer(HostBuffer&& o) noexcept { swap(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    HostBuffer t(std::move(o));
    swap(t);
    return *this;
  }
  ~HostBuffer() {
    if (data_ != nullptr) device_->free_pinned_host(data_, bytes_);
  }
  std::byte* data() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void swap(HostBuffer& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
  }
  Device* device_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

// Wall-clock moments of one pass's wait for a layer's parameters, filled by
// callbacks on other threads.
struct WaitProbe {
  bool backward = false;                // in a micro-batch's backward (after its first backward acquire)
  std::atomic<int64_t> reached_ns{-1};  // the model's stream reached the layer
  std::atomic<int64_t> update_ns{-1};   // the optimizer's update of the layer was in place
  std::atomic<int64_t> ready_ns{-1};    // everything the layer waited for was done
};
inline int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// Parameters from fp32 master values: rounded to the parameters' dtype, as
// every step writes them (a load and a rollback derive them the same way).
inline void master_to_params(DType param_dtype, const float* master, std::byte* params, size_t n) {
  if (param_dtype == DType::kF32) std::memcpy(params, master, n * sizeof(float));
  else if (param_dtype == DType::kBF16) convert_fp32_to_bf16(master, reinterpret_cast<bfloat16*>(params), n);
  else convert_fp32_to_fp16(master, reinterpret_cast<float16*>(params), n);
}

// The inverse: parameters (any state dtype) widened to fp32 values, exactly.
inline void params_to_fp32(DType param_dtype, const std::byte* params, float* values, size_t n) {
  if (param_dtype == DType::kF32) std::memcpy(values, params, n * sizeof(float));
  else if (param_dtype == DType::kBF16) convert_bf16_to_fp32(reinterpret_cast<const bfloat16*>(params), values, n);
  else convert_fp16_to_fp32(reinterpret_cast<const float16*>(params), values, n);
}

}  // namespace engine_detail

using namespace engine_detail;

struct Engine::Impl {
  EngineOptions opt;
  testing::EngineFaults faults;  // none unless created through the testing seam (engine_seam.h)
  ModelRunner* runner = nullptr;  // null: a caller drives (Note [Driving the engine])
  const LayeredModel& model;
  Device& device;
  comm::Communicator& comm;
  int world = 1, rank = 0;
  Partition part;
  // What this engine holds: device (its own buffers and device optimizer
  // state, not the model's activations) and pinned host memory as the
  // Device counts them (Note [Accounts] in strata/core/device.h: every
  // allocation of those goes through device.allocate(bytes, stats)),
  // pageable host memory and NVMe bytes as the engine counts them.
  MemoryStats stats;
  EngineMemory predicted;
  std::unique_ptr<Stream> xfer;
  std::unique_ptr<Stream> frees;  // only frees: never gated
  std::unique_ptr<Stream> opt_stream;  // device_opt(): the device Adam kernel's stream
  // The optimizer thread's H2D copies of updated tiles (step_pieces): queued
  // from the tile callback while later tiles compute (cuda: asynchronous
  // copies from pinned staging), waited for once per piece.
  std::unique_ptr<Stream> update_stream;
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

  // A run of a layer's elements with the same per-tensor hyper-parameters
  // (ParamTensorSpec::weight_decay, lr_scale): the optimizer steps a piece
  // as its runs. Adjacent tensors with equal values share a run.
  struct HyperRun {
    size_t begin = 0, end = 0;  // layer elements [begin, end)
    double weight_decay = 0;
    double lr_scale = 1;
  };
  struct Layer {
    // Copied once from placement.layers[li] (init_layer): the layer's
    // dtype, its size, and where its parameters live.
    DType param_dtype = DType::kF32;  // the parameters' dtype
    size_t element_bytes = 4;         // its size
    bool persistent = true;  // full parameters stay on the device
    bool frozen = false;     // parameters only: no gradient, no optimizer state, never reduced or stepped
    bool initialized = true; // its initial values are in place (put_initial_layer, for a SpecModel)
    std::vector<HyperRun> hyper_runs;
    DeviceBuffer full_params;
    Completion params_ready;
    DeviceBuffer dev_shard;  // stage 3, offload_param none
    HostBuffer host_shard;   // stage 3, offload_param cpu (and nvme's cached layers)
    bool on_nvme = false;    // stage 3, offload_param nvme: the shard lives in param_swap
    bool acquired_in_place = false;  // LayerPlacement::acquired_in_place
    Completion shard_ready;
    DeviceBuffer gathered;   // stage 3: this layer gathered
    Completion gathered_ready;
    Completion last_use;            // the `done` of the latest release of the gathered copy
    bool gathered_valid = false;
    Status prefetch_failure;        // a prefetch of this layer failed: its next acquire returns it
    int held = 0;
    // gradients
    DeviceBuffer full_grads;
    int64_t zeroed_step = -1;
    Completion grads_zeroed;
    Completion last_backward_released;  // `done` of the latest kBackward release
    int bwd_releases = 0;           // this micro-batch
    bool reduce_launched = false;   // this step
    Completion full_gradient_read;      // everything that read full_grads this step (reduction, copies)
    // optimizer input
    DeviceBuffer opt_grads_dev;     // owned layout, when the optimizer tier is the device and grads are not in place
    HostBuffer opt_grads_host;      // owned layout, offload_optimizer cpu
    HostBuffer staging;             // updated 16-bit (or fp32 master) values before their H2D copy
    HostBuffer norm_grads;          // device_opt(): the reduced gradient's host copy for the block sums
    Completion reduced_gradient_moved;  // the reduced gradient is in the optimizer's input buffer
    std::vector<double> block_sums; // owned blocks, owned order
    Completion norm_partials_ready;     // block_sums hold this step's partial sums of the norm
    Completion update_ran;              // the update ran (ok even when it failed: Note [Atomic steps])
    Completion update_written;          // the update and its parameter write-back; fails when either did
  };
  std::vector<Layer> layers;
  // offload_param nvme; after `layers`, so it closes (its writes from the
  // layers' staging buffers done) before they are freed.
  std::unique_ptr<ParamSwap> param_swap;
  // Reads NVMe parameter shards (after their write-back) into place for the
  // gathers; after param_swap: its thread is joined before the swap closes.
  std::unique_ptr<SerialWorker> shard_reader;

  // The acquire sequence of a training micro-batch (Note [Acquire order]).
  std::optional<AcquireTrace> trace;
  bool window_spans_micro_batch = false;  // max(reuse, prefetch) >= every stage-3 use of a micro-batch

  int64_t optimizer_steps = 0;        // applied updates
  int64_t steps_begun = 0;   // steps begun, for zeroing

  // Where the driving thread is (Note [Driving the engine]): set by the
  // bracket calls, read by acquire and release.
  enum class Phase : uint8_t { kIdle, kStep, kMicroBatch, kEvaluation };
  Phase phase = Phase::kIdle;
  static const char* phase_name(Phase p);
  Status expect_phase(Phase want, const char* call) const;
  // Every layer's initial values are in place (put_initial_layer for a model without its own).
  // Checkpoints hold every layer's master weights and moments; a frozen
  // layer has neither, and its parameters are not saved yet: refused,
  // naming it, before anything is written or read (every rank alike).
  Status expect_no_frozen_layer(const char* call) const {
    for (size_t li = 0; li < layers.size(); ++li)
      if (layers[li].frozen)
        return Unsupported(fmt::format(
            "{}: layer {} '{}' is frozen and checkpoints of models with frozen layers are not supported yet (a "
            "frozen layer has no optimizer state and its parameters are not saved); save the trainable state "
            "through gather_state() or train the layer with lr_scale 0",
            call, li, printable(part.layer(li).name, 64)));
    return Status::Ok();
  }
  Status expect_initialized() const {
    for (size_t li = 0; li < layers.size(); ++li)
      if (!layers[li].initialized)
        return FailedPrecondition(fmt::format(
            "layer {} '{}' has no initial values: this model does not provide its own, so every rank calls "
            "put_initial_layer() for every layer before the first step",
            li, printable(part.layer(li).name, 64)));
    return Status::Ok();
  }
  // The step in progress (begin_step .. finish_step).
  struct StepInProgress {
    Clock::time_point started;
    double scale = 1;             // the loss scale
    int micro = 0;                // micro-batches begun
    bool last_micro = false;      // the one in progress is the step's last
    Clock::time_point micro_started;
    // The micro-batch in progress is in its backward: it acquired a layer
    // for backward (from then on until end_micro_batch it counts as backward).
    bool in_backward = false;
    Clock::time_point backward_started;
    double forward_ms = 0;        // micro-batches' forwards: begin_micro_batch .. first backward acquire
    double backward_ms = 0;       // micro-batches' backwards: first backward acquire .. end_micro_batch
    double loss_sum = 0;          // this rank's micro-batch mean losses
    uint64_t tokens = 0;
  } progress;
  // Reductions are issued in descending layer order (Note [Acquire order]):
  // next_reduction is the highest layer not launched yet (-1: none left).
  std::vector<bool> gradient_complete;
  int64_t next_reduction = -1;
  Status gradient_completed(size_t li);
  Status launch_every_reduction();
  // Stage-3 gathered layers and stage 2-3 full gradients: device buffers
  // under stage3_max_live_parameters / reduce_bucket_size, freed once their
  // users are done (Note [Lent buffers]). Made in init(), with `frees`.
  std::optional<LentBuffers> live_params, live_grads;
  // per-step counters
  uint64_t h2d_bytes = 0, d2h_bytes = 0, gather_bytes = 0, reduce_bytes = 0;
  std::vector<std::shared_ptr<WaitProbe>> probes;
  // Nanoseconds the optimizer thread spent in one step's updates, added by
  // the update tasks themselves: the step queued last (pending, or applied
  // with overlap off), for StepMetrics::optimizer_ms.
  std::shared_ptr<std::atomic<int64_t>> update_ns;
  StateTierIoStats io_before;  // the tier's counters at the start of the step
  std::array<std::byte, 4> fault_bytes{};  // the injected gradient value, in the gradient dtype
  bool fault_gather_fired = false;          // testing::GatherFault fires once

  Impl(const EngineOptions& o, ModelRunner* r, const LayeredModel& m, Device& d, comm::Communicator& c)
      : opt(o), runner(r), model(m), device(d), comm(c) {}

  // Every placement decision, made once in init() (Note [State placement]);
  // the questions below read it.
  StatePlacement placement;
  bool stage0() const { return placement.owns_every_piece(); }
  // The optimizer runs on the host for cpu and nvme placements (nvme: its
  // state streams through pinned slots of the NVMe tier).
  bool opt_on_host() const { return placement.optimizer_on_host(); }
  bool opt_on_nvme() const { return placement.optimizer_on_nvme(); }
  // Stage-3 shards off the device: in pinned host memory (cpu, and nvme's
  // first max_in_cpu elements) or on NVMe (Layer::on_nvme).
  bool param_on_host() const { return opt.offload_param != OffloadDevice::kNone; }
  // A stage-3 layer acquired in place (LayerPlacement::acquired_in_place):
  // acquire hands out dev_shard itself; its update waits for the layer's
  // last release (queue_update).
  bool aliased(const Layer& l) const { return l.acquired_in_place; }
  size_t grad_bytes() const { return dtype_size(opt.grad_dtype); }  // per gradient element
  bool grads_in_place() const { return placement.gradients_in_place; }
  bool has_master(size_t li) const { return placement.layers[li].master; }
  bool split() const { return placement.split; }
  // The fused device Adam kernel steps the state on `opt_stream`, and each
  // layer's reduced gradient is also copied D2H for the norm.
  bool device_opt() const { return placement.device_kernel; }
  size_t host_n(size_t count) const { return host_part(placement.ratio, count); }

  // Owned pieces: every rank's at stage 0, this rank's otherwise; the owned
  // layout is padded space at stage 0 and the shard layout otherwise.
  int owned_rank_begin() const { return placement.owned_rank_begin(); }
  int owned_rank_end() const { return placement.owned_rank_end(); }
  size_t owned_offset(const LayerPartition& layer_part, const SubGroup& g, int r) const {
    return placement.owned_offset(layer_part, g, r);
  }
  size_t owned_elements(const LayerPartition& layer_part) const { return placement.owned_elements(layer_part); }

  std::string state_name(size_t layer, size_t group, int r) const {
    return part.describe(StateId{static_cast<uint32_t>(layer), static_cast<uint32_t>(group), r});
  }

  Result<DeviceBuffer> alloc_device(size_t bytes, const std::string& what) {
    Result<DeviceBuffer> b = device.allocate(bytes == 0 ? 64 : bytes, stats);  // the device counts it in stats
    if (!b.ok())
      return OutOfMemory(fmt::format("{} ({}) does not fit in device memory on rank {}: {}", what,
                                     format_bytes(bytes, true), rank, b.status().message()));
    return b;
  }
  EngineMemory plan() const;

  // Where rank piece (g, r)'s parameters live on this rank (device or host pointer).
  std::byte* param_location(size_t li, const SubGroup& g, int r) {
    Layer& l = layers[li];
    const LayerPartition& layer_part = part.layer(li);
    if (l.persistent) return l.full_params.as<std::byte>() + layer_part.piece_begin(g, r) * l.element_bytes;
    STRATA_CHECK(r == rank, "a stage-3 rank holds only its own shard");
    if (param_on_host()) return l.host_shard.data() + g.shard_offset * l.element_bytes;
    return l.dev_shard.as<std::byte>() + g.shard_offset * l.element_bytes;
  }

  Status init();
  Status init_layer(size_t li);
  Status make_nvme_tier();
  Status make_param_swap();
  std::string job_name;  // the swap folders' run name, the same on every rank
  Result<LayerMemory> acquire(size_t li, Pass pass);
  Status release(size_t li, Pass pass, const Completion& done);
  // On failure the buffer goes back to the live count once what was queued
  // against it completed; `allocated` (when given) says whether it got that far.
  Status issue_gather(size_t li, bool* allocated = nullptr);
  Status queue_gather(size_t li, std::vector<Completion>& queued);  // issue_gather's work after the allocation
  Status make_room_for_gather(size_t li);
  void prefetch_after(size_t position);
  Status drop_gathered(size_t li, const Completion& done);
  Status launch_reduction(size_t li);
  Status queue_update(size_t li, int64_t step, double clip, double scale, const cpu_adam::HyperParams& hyper);
  Status put_initial_layer(size_t li, std::span<const std::byte> params, std::span<const float> fp32);
  Result<std::vector<float>> frozen_shard_fp32(size_t li);
  // This rank's pieces of layer li, shard layout, from the padded layer.
  std::vector<std::byte> own_shard(size_t li, const std::byte* padded) const;
  // A persistent layer's owned pieces all-gathered into its full copy (on
  // kUpdate, after what that queue waits for); the last gather's completion.
  Result<Completion> gather_persistent(size_t li);
  struct PieceJob {
    StateId id;
    size_t count = 0;
    // The piece's runs of equal hyper-parameters: offsets from the job's first element.
    struct Run {
      size_t offset = 0, count = 0;
      cpu_adam::HyperParams hyper;
    };
    std::vector<Run> runs;
    const std::byte* grads = nullptr;
    std::byte* param = nullptr;    // where the kernel writes the updated value (param_copy, or fp32 in place)
    bool param_is_master = false;  // fp32 parameters stepped in place
    // Device parameters the updated values are copied to, tile by tile, from
    // the optimizer's tile callback while later tiles compute; null: none.
    std::byte* h2d = nullptr;
  };
  // Layer li's runs intersected with layer elements [begin, begin + count), offsets from begin.
  std::vector<PieceJob::Run> runs_of(size_t li, size_t begin, size_t count, const cpu_adam::HyperParams& hyper) const;
  Status step_pieces(OptimizerStateTier& t, cpu_adam::CpuOptimizer& o, const std::vector<PieceJob>& jobs,
                     const cpu_adam::StepArgs& args, DType param_dtype);
  Status begin_step();
  double gradient_scale() const { return progress.scale / (static_cast<double>(opt.grad_accum) * world); }
  Status begin_micro_batch(bool last);
  Status end_micro_batch(double mean_loss, int64_t tokens);
  Result<StepOutcome> finish_step();
  Status begin_evaluation();
  Result<double> finish_evaluation(double loss_sum, int64_t batches);
  // The runner-driven loops over the calls above.
  Result<StepMetrics> step();
  Result<double> evaluate();
  Result<double> global_norm_squared();

  // Note [Atomic steps] in engine.h (engine_recovery.cpp).
  struct Mark {  // the counters a rollback restores
    int64_t optimizer_steps = 0, steps_begun = 0;
    LossScalerState scaler;
    std::optional<uint64_t> data;  // the runner's data position, when it has one
  };
  Mark mark() const;
  Status restore(const Mark& m);
  Mark step_start;  // the counters at begin_step() (the step in progress is dropped back to them)
  Result<StepMetrics> finish_applied_step();
  bool pending = false;           // a step's updates are queued and not committed yet
  bool pending_complete = false;  // every layer's update of that step was queued
  Mark pending_mark;              // the counters before that step
  std::mutex failure_mu;
  Status update_failure;          // the first failure of the pending step's updates (guarded by failure_mu)
  Status call_failure;            // the first failure of this call's parameter reads (guarded by failure_mu)
  Status torn_failure;            // an update of state kept in place that failed part-way (guarded by failure_mu)
  bool recovered = false;         // the error being returned came with a completed rollback
  StepOutcomeKind recovery = StepOutcomeKind::kDropped;  // what that rollback did to the step (finish_step)
  Status stopped;                 // not ok: the engine refuses to go on (an error it could not recover from)
  // `c`, completing ok once `c` has completed; c's failure is recorded in
  // update_failure (an update) or call_failure (a read the call's passes use).
  // kTorn: an in-place update that failed part-way (step_pieces), which no
  // rollback can undo.
  enum class FailureOf : uint8_t { kUpdate, kCall, kTorn };
  Completion absorb(const Completion& c, const std::string& label, FailureOf of = FailureOf::kUpdate);
  void record_failure(FailureOf of, const Status& s);
  Status take_failure(FailureOf of);
  // The commit point: waits for the pending step's updates, lets every rank
  // vote (a collective when world > 1), commits them when every rank's
  // succeeded, else rolls every rank back and returns the error. `call`:
  // the counters at the start of the step() call in progress (dropped with
  // the rollback), or null outside step(). `loss` (step() only): this rank's
  // loss sum in, the sum over ranks in rank order out (the vote carries it).
  Status settle(const Mark* call, double* loss = nullptr);
  // Every layer's parameters from the committed master weights (a
  // collective: stage 1-3 layers kept whole are gathered again).
  Status rederive_params();
  // Layer li's stage-3 shard (this rank's, shard layout) written where it
  // lives: NVMe (durable on return), pinned host or device memory.
  Status put_shard(size_t li, std::span<const std::byte> values);
  // The error an engine method returns: when it did not come with a
  // completed rollback, the engine stops (every later call gets it).
  Status stop_unless_recovered(Status error);
  // Note [Bounded waits] in engine.h: ok once `c` has completed, failed or
  // not (the caller reads c.status()), within opt.wait_timeout_s; else
  // DeadlineExceeded naming `what`, c's label, the time waited and the key
  // to raise, and the engine stops. The driving thread's waits go through it.
  Status wait_bounded(const Completion& c, std::string_view what);
  std::chrono::nanoseconds wait_bound() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(opt.wait_timeout_s));
  }
  // `c`'s Status (its failure in the context of `what`), waited for through wait_bounded.
  Status wait_status(const Completion& c, std::string_view what) {
    STRATA_RETURN_IF_ERROR(wait_bounded(c, what));
    return c.status().with_context(what);
  }
  // The destructor's wait: nothing can be freed before `c` completes, so
  // after the bound it says on stderr what it waits for and waits on.
  void wait_at_teardown(const Completion& c, std::string_view what) const;

  // Checkpoints (engine_checkpoint.cpp).
  struct SaveState;
  struct SnapshotSlots;
  std::shared_ptr<SaveState> pending_save;        // the save in flight
  std::shared_ptr<SnapshotSlots> snapshot_slots;  // kept between saves
  // One piece's state (piece_real elements, host part then device part) as
  // fp32; a null pointer skips that kind. Reads and writes through the tiers.
  Status read_piece_state(size_t li, size_t gi, int r, float* master, float* exp_avg, float* exp_avg_sq);
  Status write_piece_state(size_t li, size_t gi, int r, const float* master, const float* exp_avg,
                           const float* exp_avg_sq);
  Completion snapshot_gate(size_t li);
  Result<CheckpointSaveInfo> save(const CheckpointSaveOptions& o);
  Result<std::optional<CheckpointSaveDone>> wait_save();
  void abandon_save();
  Status finish_save(SaveState& s);
  Status prune_checkpoints(const std::filesystem::path& dir, int keep, const std::string& current);
  Result<CheckpointManifest> load(const std::string& given);
  // Last: its thread is joined first, before anything a save's task may use.
  std::unique_ptr<SerialWorker> ckpt_writer;
};


}  // namespace strata::offload
