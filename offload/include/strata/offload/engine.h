#pragma once
// The ZeRO engine: owns every piece of one rank's training state and is the
// model's ParameterProvider (strata/core/layered_model.h).
//
//   EngineOptions o = ...;                       // or engine_options_from_config(cfg)
//   auto engine = Engine::create(o, runner, device, comm);  // one per rank
//   for (...) { auto r = engine->step(); ... }   // drives runner's micro-batches
//   double val = *engine->evaluate();
//
// Stages (Note [Stages]):
//   0  every rank holds full parameters, gradients and optimizer state; the
//      gradient is summed over ranks and every rank steps every element.
//   1  + optimizer state sharded: a rank steps its shard, then the updated
//      parameters are all-gathered.
//   2  + gradients reduce-scattered as each layer's backward ends; the full
//      gradient buffer of a layer is freed once its shard is taken away.
//   3  + parameters partitioned: acquire all-gathers a layer (from its device
//      shard, or from the pinned host shard with offload_param cpu: H2D, then
//      gather); release frees it. Prefetch follows the acquire sequence
//      recorded in the first micro-batch; layers below the persistence
//      threshold stay gathered.
// Gradient sums always run as a reduce-scatter over ranks in rank order
// (fp32 accumulation; stage 0 all-gathers the reduced pieces back), so every
// stage adds the same numbers in the same order.
//
// Optimizer placement (Note [Optimizer tier]): offload_optimizer none keeps
// fp32 master weights (16-bit parameters only) and moments in device memory
// and steps them there (the CPU kernels on the cpu device, whose memory the
// host addresses; the fused device Adam kernel on cuda, where that build
// has it, Adam and AdamW only); cpu keeps them in pinned host memory,
// copies each layer's reduced gradient piece D2H as soon as it is reduced
// (while backward continues) and steps it there; nvme streams them through
// pinned slots. Each is an OptimizerStateTier (state_tier.h). With
// offload_optimizer.ratio < 1 (stage 3, cpu, params on the device) a
// fraction of each piece stays on the device and is stepped there at the
// same time.
//
// Note [Gradient norm]
// Every rank piece is a whole number of kShardAlign-element blocks. Each
// block's fp64 sum of squares is computed by whoever holds the block; the
// per-block sums of all ranks are gathered and added layer by layer,
// sub-group by sub-group, rank by rank, block by block. Stage 0 computes the
// same blocks itself and adds them in the same order, so the norm (and the
// clip coefficient and every update) is bit-identical across stages.
//
// Note [Exact overlap]
// With overlap_optimizer (default), step() returns once the optimizer step
// of every layer is queued on the optimizer thread in forward order. Each
// layer's parameters carry a ready Completion (the update, its H2D copy and
// gather); the next forward waits per layer, so it runs while later layers
// are still being stepped, and never sees a stale parameter. Off: step()
// waits for every update. Losses are bit-identical either way.
//
// Note [Atomic steps]
// A step's updates are pending until the commit point: in the next step,
// once every rank has run its forward and backward (the loss all-reduce),
// or in synchronize()/evaluate()/gather_state(), and at the end of the
// step itself with overlap off. A failed update (an NVMe read or write of a
// piece, a parameter shard's write-back) does not fail what later work
// waits on: the next forward runs on whatever the layer holds and the
// failure goes to the commit point, where every rank votes (in step(), in
// the collective that sums the loss: one all-gather of {loss, update failed,
// read failed} per rank, the loss added in rank order). All ranks agree, so
// they act together:
//  - every update succeeded: the NVMe tier's pending versions become the
//    committed ones (Note [Piece versions] in nvme_state_tier.h);
//  - one failed anywhere, optimizer state on NVMe: every rank drops the
//    pending versions, re-derives its parameters (device, pinned or NVMe
//    shards) from the committed master weights, puts back the step count,
//    loss scaler and the runner's data position of the step before, and
//    the call returns the error ("every rank rolled back to the state after
//    step N"; the cause, with file, offset and piece, on the rank it hit);
//    the next step() repeats the failed step with the same numbers;
//  - state in memory (cpu, none): the update ran in place and only a
//    parameter copy failed: the step stands, the parameters are re-derived
//    from it and the step() call in progress is dropped (repeated next);
//  - state in memory whose update failed part-way (a kernel or a piece
//    that failed after others of the step were stepped in place): part of
//    the state is step t, part t-1, and no copy of t-1 exists. It is never
//    committed: every rank stops, the error naming the rank, the layer and
//    piece and why no rollback is possible (resume from a checkpoint).
// A stage-3 parameter shard's NVMe read failing in a gather is voted the
// same way (the layer is gathered from whatever the slot holds): the
// pending step commits, the step() call in progress is dropped on every
// rank (counters and data position put back) and repeated by the next call;
// in evaluate() no loss is returned. Any other error (a forward, a
// collective, a rollback that fails) stops the engine: the error is
// returned and every later step/evaluate/save returns "this engine stopped
// ...; resume from the last checkpoint".
// A checkpoint snapshot waits for its layer's update and fails with it, so
// a failed step is never saved.
//
// Note [Bounded waits]
// Every wait of the engine for work on another thread, queue or device (an
// update, a gather, a copy, a reduction, a checkpoint's snapshot slot and
// write, the teardown's) is bounded by EngineOptions::wait_timeout_s
// (strata.wait_timeout_s, 600 s). One that expires returns DeadlineExceeded
// naming what it waited for (the completion's label), the layer, the time
// and the key to raise, and stops the engine: what it waited for may still
// run, so the state is unknown. The destructor cannot free buffers that a
// hung operation may still write: after the bound it says on stderr what it
// waits for and goes on waiting (a thread stuck in a system call cannot be
// cancelled safely); kill the process if it never completes.
//
// Note [Driving the engine]
// A caller that owns the model's passes and its data (a PyTorch module, a
// test) drives one optimizer step with four calls:
//   engine->begin_step();                        // gradient_scale(): what the loss's gradient is scaled by
//   for (int k = 0; k < grad_accum; ++k) {
//     engine->begin_micro_batch(k == grad_accum - 1);
//     ...forward and backward through acquire/release (Note [Acquire and release])...
//     engine->end_micro_batch(mean_loss, tokens);
//   }
//   StepOutcome outcome = *engine->finish_step();
// The outcome is the step's metrics, or: rolled back (the state is the one
// after step N: feed the batches of step N + 1 on again; with overlap on
// that is the step before the one in progress, whose update failed, so two
// steps' batches are fed again) or dropped (the step in progress was not
// applied: feed its batches again), each with the reason. Engine::step()
// is this loop over a ModelRunner's micro-batches, and turns a rolled-back
// or dropped outcome into an error (the runner's data was moved back). An
// evaluation is begin_evaluation(), kEval passes, finish_evaluation(loss_sum,
// batches). The calls come from the thread that drives the model; out of
// order they fail naming the expected call.
//
// A caller that needs to know where it is (a front end deciding whether a
// forward opens a step, or whether a save is allowed now) asks the engine:
// phase() and layer_holds() answer from the engine's own state, so a
// caller keeps no copy that a failed call could leave out of step. A call
// refused for its order or its arguments changes neither. A call that
// fails in its work leaves the phase where that work got to:
// end_micro_batch() has ended the micro-batch, finish_step() and
// abandon_step() the step, finish_evaluation() the evaluation; begin_step()
// and begin_evaluation() begin none. A stopped engine (stopped()) keeps
// the phase it stopped in and refuses the bracket calls, step(), evaluate()
// and saves; acquire() and release() still run, so that a caller can hand
// back what it holds. phase() may be asked from any thread.
//
// Note [Acquire order]
// The acquire sequence of a training micro-batch is recorded and then used
// as a hint: prefetch (stage 3) and early gradient reductions follow it
// while the micro-batch follows it. A micro-batch that departs from it (a
// conditional layer, a layer skipped, a recompute in backward) stops
// trusting it at that acquire (what is left is gathered on demand and
// reduced when the micro-batch ends) and the next micro-batch records it
// again. A layer no pass used in a step gets a zero gradient. Reductions
// are issued in a canonical order (layer index, highest first) whatever
// order a rank's backward completes layers in, so every rank issues the same
// collectives in the same order.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/device.h"
#include "strata/core/layered_model.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/cpu_adam/moment_storage.h"
#include "strata/offload/acquire_waiter.h"
#include "strata/offload/checkpoint.h"
#include "strata/offload/partition.h"
#include "strata/offload/speculation_mode.h"
#include "strata/offload/state_placement.h"

namespace strata::offload {

namespace testing {
class EngineSeam;     // strata/offload/testing/engine_seam.h (tests only, not installed)
struct EngineFaults;
}  // namespace testing

struct EngineOptions {
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  // offload_optimizer.ratio: the fraction of each piece's optimizer state
  // kept in pinned host memory and stepped by the host thread; the rest
  // stays in device memory and is stepped at the same time on the device's
  // side. < 1 only at stage 3 with offload_optimizer cpu and offload_param none.
  double ratio = 1.0;
  // The three above as the one value every placement question is asked of
  // (Note [Placement questions] in strata/core/placement.h).
  Placement placement() const { return {stage, offload_optimizer, offload_param}; }
  int64_t sub_group_size = 1'000'000'000;
  int64_t reduce_bucket_size = 500'000'000;
  int64_t prefetch_bucket_size = 50'000'000;        // stage3_prefetch_bucket_size
  int64_t max_live_parameters = 1'000'000'000;      // stage3_max_live_parameters
  int64_t max_reuse_distance = 1'000'000'000;       // stage3_max_reuse_distance
  int64_t persistence_threshold = 100'000;          // stage3_param_persistence_threshold
  bool overlap_optimizer = true;                    // strata.overlap_optimizer
  // strata.speculative_optimizer (Note [Early, exact updates] in docs/engine.md).
  SpeculationMode speculative_optimizer = SpeculationMode::kAuto;
  // strata.gradient_shards (Note [Gradient shards on NVMe], offload/src/gradient_spill.h).
  GradientShardsMode gradient_shards = GradientShardsMode::kAuto;
  DType grad_dtype = DType::kF32;                   // data_types.grad_accum_dtype
  cpu_adam::MomentStorage moments;                  // strata.optimizer_state_dtype (int8: offloaded state only)
  cpu_adam::OptimizerKind optimizer = cpu_adam::OptimizerKind::kAdamW;
  cpu_adam::HyperParams hyper{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.0,
                              .bias_correction = true};
  double grad_clip = 1.0;   // 0: off
  int grad_accum = 1;
  int optimizer_threads = 0;  // 0: all cores
  // offload_optimizer.device nvme: where and how the state is streamed.
  struct NvmeOptions {
    std::string path;             // offload_optimizer.nvme_path
    int64_t buffer_count = 4;     // offload_optimizer.buffer_count: pinned slots
    bool pipeline_read = false;   // offload_optimizer.pipeline_read
    bool pipeline_write = false;  // offload_optimizer.pipeline_write
    bool verify_checksums = true; // strata.verify_checksums
    AioConfig aio;                // the aio section
  } nvme;
  // offload_param.device nvme (stage 3): shards of layers beyond the first
  // max_in_cpu elements live on NVMe and are read through buffer_count slots.
  struct NvmeParamOptions {
    std::string path;                    // offload_param.nvme_path
    int64_t buffer_count = 5;            // offload_param.buffer_count
    int64_t buffer_size = 100'000'000;   // offload_param.buffer_size: elements per slot, >= the largest shard
    int64_t max_in_cpu = 1'000'000'000;  // offload_param.max_in_cpu: shard elements kept in pinned host memory
  } nvme_param;
  // This rank's share of strata.host_memory_budget (strata train gives each
  // of its --ranks an equal share); 0: unlimited. It bounds the engine's
  // pinned host memory as planned (predicted_memory().pinned: optimizer
  // state or its NVMe slots, gradient shards, parameter staging, parameter
  // shards and their NVMe slots), refused at creation when above it, and at
  // each save_checkpoint() that plus the checkpoint snapshot slots
  // (pageable: snapshot_slots x predicted_memory().snapshot_slot_bytes),
  // refused before anything is written. Not counted: the model's own
  // buffers and the transient copies of load_checkpoint() and gather_state().
  uint64_t host_memory_budget = 0;
  // fp16 dynamic (or static) loss scaling; off unless fp16.enabled.
  Fp16Config fp16;
  // The learning-rate schedule; type kNone keeps hyper.lr.
  SchedulerConfig scheduler;
  std::string source = "engine options";  // config file name, for messages
  // The swap folders' job name (`<nvme path>/strata-<job>[-params|-gradients]/rank<R>`); empty: train-<rank 0's
  // process id>. Two engines on one nvme path need two names (a folder is locked by its engine). 1..48
  // characters of A-Z a-z 0-9 . _ - (the suffixes fill the rest of a swap job name's 64).
  std::string job_name;
  // How the caller resumes from a checkpoint, named where an error stops the engine ("resume every rank from
  // the last checkpoint (<resume_hint>)"): the CLI's flag, or the call of the front end that drives the engine.
  std::string resume_hint = "strata train --resume DIR";
  // strata.wait_timeout_s: the bound on each wait of the engine (Note [Bounded
  // waits]); one that expires stops the engine with an error naming what it
  // waited for. 0.001 .. 604800.
  double wait_timeout_s = 600;
  // Faults for tests (a poisoned gradient, a failing update or gather,
  // fault-injecting NVMe I/O, a crash during a checkpoint's commit) are not
  // options: Note [Testing seam].
};

// The engine options a DeepSpeed config asks for. Fails (naming the key and
// the fix) for what this engine cannot run: ratio < 1 outside stage 3 +
// offload_optimizer cpu + offload_param none, nvme without nvme_path,
// offload_param without stage 3, an unsupported grad_accum_dtype.
Result<EngineOptions> engine_options_from_config(const Config& config);
// Where the options put the state is one the engine can run (the checks
// above; Engine::create runs them too). Names the config key and the fix.
Status check_placement(const EngineOptions& options);
// Why the optimizer state's NVMe reads or writes stay on the step's path:
// offload_optimizer nvme without both pipeline_read and pipeline_write
// (docs/engine.md, Note [Read-ahead at the step's end]); empty otherwise.
// What `strata train` notes and strata.torch.initialize warns.
std::string nvme_pipelines_note(OffloadDevice optimizer, bool pipeline_read, bool pipeline_write);

// One step's numbers, the same on every rank except the per-rank bytes.
struct StepMetrics {
  // Note [Early, exact updates]: this rank's layers stepped under the
  // backward (their reduced gradient in, before the step's norm), and of
  // those the ones redone at the step's end (clipping applied, the lr or
  // scale changed) or restored (an fp16 overflow skipped the step).
  int64_t speculated_layers = 0, redone_layers = 0;
  int64_t step = 0;            // optimizer steps applied so far (a skipped step does not count)
  double loss = 0;             // mean over the global batch (every rank, every micro-batch)
  double lr = 0;
  double beta1 = 0;            // Adam's beta1 of this step (OneCycle's cycle_momentum changes it per step)
  double loss_scale = 1;
  double grad_norm = 0;        // unscaled, before clipping
  bool skipped = false;        // fp16 overflow: nothing was updated
  double tokens_per_s = 0;     // global tokens (all ranks) per second
  double step_ms = 0;          // begin_step() .. finish_step() returning
  // The driving thread's time in the micro-batches' forwards: from
  // begin_micro_batch() to the micro-batch's first backward acquire (all of
  // it when it has none), summed over the step's micro-batches.
  double forward_ms = 0;
  // The rest of each micro-batch (first backward acquire .. end_micro_batch),
  // summed, plus finish_step()'s wait for the last layers' backward.
  double backward_ms = 0;
  // The optimizer thread's time in one step's updates (not its other work:
  // gradient block sums, checkpoint snapshots). Overlap off: this step's.
  // On: the previous step's, which ran while this one did and are all done
  // at its commit point (0 on the first step).
  double optimizer_ms = 0;
  // Time the model waited, per link, this step.
  double wait_reduce_ms = 0;     // the driving thread: last backward done -> every gradient reduced, norm and vote
  // The model waited for a layer's parameters: for their update (exposed
  // optimizer, forward or backward), or after it for their gather: in the
  // forwards (the passes before each micro-batch's first backward acquire)
  // and in the backwards (stage 3 gathers a dropped layer again). Timed
  // from when the acquire's waiter reached the layer (Note [Who waits for
  // an acquired layer]: Engine::create's model_stream by default, the host
  // or a caller's stream); 0 when nothing names one.
  double wait_optimizer_ms = 0;
  // wait_optimizer_ms by layer: each pass that waited for its layer's
  // update, in the order the stream reached them (a layer acquired twice,
  // as a tied embedding is, can appear twice). Their ms add up to
  // wait_optimizer_ms. Which layers the next forward waits for is what
  // to look at when the optimizer is exposed (docs/engine.md, Step metrics).
  struct LayerWait {
    size_t layer = 0;
    double ms = 0;
  };
  std::vector<LayerWait> optimizer_waits;
  double wait_gather_ms = 0;
  double wait_gather_backward_ms = 0;
  // Bytes moved this step, per link, by this rank.
  uint64_t h2d_bytes = 0, d2h_bytes = 0, gather_bytes = 0, reduce_bytes = 0;
  // NVMe (offload_optimizer nvme), exact (Note [A step's NVMe bytes] in
  // offload/src/step_nvme_bytes.h): the optimizer state the updates read and
  // wrote back and the gradient shards they read back, of the same step as
  // optimizer_ms (overlap on: the previous step's, 0 on the first), plus the
  // gradient shards this step's backward wrote (strata.gradient_shards nvme).
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double wait_nvme_ms = 0;  // the optimizer thread waited for NVMe reads and write-backs
  // Peaks since the start, per tier, for this rank.
  uint64_t peak_device_bytes = 0, peak_pinned_bytes = 0, peak_host_bytes = 0, peak_nvme_bytes = 0;
};

// Bytes one rank's engine holds at its peak, per tier: its own buffers and
// optimizer state, not the model's activations. predicted_memory() is the
// plan from the partition and the options, made before anything is
// allocated; measured_memory() what the run held (peaks since creation).
struct EngineMemory {
  uint64_t device = 0;  // = the four parts below
  uint64_t device_params = 0, device_grads = 0, device_optimizer = 0, device_gathered = 0;
  uint64_t pinned = 0;  // = the five parts below
  uint64_t pinned_optimizer = 0, pinned_grads = 0, pinned_staging = 0, pinned_params = 0;
  // Note [Early, exact updates]: the copy of each layer's state an update
  // under the backward keeps until the step commits (0 when off).
  uint64_t pinned_speculation = 0;
  uint64_t nvme = 0;  // optimizer state on NVMe (offload_optimizer nvme)
  // Pageable host memory of one checkpoint snapshot slot: the largest of this
  // rank's pieces as fp32 master and moments (12 B per element, each part
  // 4 KiB-aligned). Not in the sums above: a save holds
  // CheckpointSaveOptions::snapshot_slots of them, from the first save on.
  uint64_t snapshot_slot_bytes = 0;
};

// With offload_optimizer.ratio < 1: how many of a piece's `count` elements
// live (and are stepped) on the host; the rest stay on the device. A
// multiple of 16 (whole SIMD vectors on both sides).
inline size_t host_part(double ratio, size_t count) {
  if (ratio >= 1.0) return count;
  const size_t n = static_cast<size_t>(ratio * static_cast<double>(count));
  return n / 16 * 16;
}

// The plan (no engine, nothing allocated): what rank `placement.rank`
// holds per tier; a pure function of the placement (Note [State
// placement]), which is what the engine allocates from.
EngineMemory plan_engine_memory(const EngineOptions& options, const Partition& partition,
                                const StatePlacement& placement);
// The same from the model: rank `rank` of `world` training `layers` with
// `options` on `device` (PlannedDevice::cpu() or gpu()). What
// Engine::predicted_memory() returns for the same inputs, and what
// `strata estimate --model` and `strata plan --model` print.
Result<EngineMemory> plan_engine_memory(const EngineOptions& options, std::span<const LayerSpec> layers, int world,
                                        int rank, const PlannedDevice& device);

// Engine::save_checkpoint's request (docs/checkpoints.md).
struct CheckpointSaveOptions {
  std::string dir;                   // the checkpoint folder (--save-dir); created (one level) if missing
  std::string tag;                   // "" : global_step<step() calls>
  int keep = 0;                      // after the commit, keep only the newest `keep` tags (0: all)
  bool sync = false;                 // return once written and committed (--save-sync)
  nlohmann::json app = nlohmann::json::object();  // stored as the manifest's "app" (rank 0's is used)
  double commit_timeout_s = 600;     // rank 0 waits this long for every rank's files
  // Host slots (each the size of the largest piece's fp32 state) between
  // the snapshot and the writer; more let the optimizer thread finish the
  // snapshot sooner when the disk is slower than the copy (--save-slots).
  int snapshot_slots = 2;
};
struct CheckpointSaveInfo {
  std::string tag;
  double blocked_ms = 0;   // the caller was blocked this long (a sync save: the whole save)
  uint64_t bytes = 0;      // this rank's bytes to write
};
// A finished save, as wait_checkpoint() reports it.
struct CheckpointSaveDone {
  std::string tag;
  bool committed = false;  // rank 0: manifest and `latest` written; other ranks: their files written
  double seconds = 0;      // from save_checkpoint() to the end of this rank's part
  uint64_t bytes = 0;      // this rank's bytes written
};

// What finish_step() (Note [Driving the engine]) says of the step.
enum class StepOutcomeKind : uint8_t {
  kApplied,     // the step ran (an fp16 overflow skip too: metrics.skipped)
  kRolledBack,  // a failed update was undone on every rank: the state is the one after step state_step
  kDropped,     // the step in progress was not applied (a failed parameter read, or a failed update of the
                // state in memory, which stands); the state is the one after step state_step
};
const char* step_outcome_name(StepOutcomeKind kind);
struct StepOutcome {
  StepOutcomeKind kind = StepOutcomeKind::kApplied;
  StepMetrics metrics;     // kApplied only
  int64_t state_step = 0;  // optimizer steps applied to the state now
  Status reason;           // why, unless kApplied
  bool applied() const { return kind == StepOutcomeKind::kApplied; }
};

class Engine final : public ParameterProvider {
 public:
  // `runner` (whose model runs on `device`), `device` and `comm` must
  // outlive the engine. Every rank creates its engine with the same options.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options, ModelRunner& runner, Device& device,
                                                comm::Communicator& comm);
  // An engine that a caller drives (Note [Driving the engine]): `model`
  // describes the layers (e.g. a SpecModel), `model_stream` (or null) is the
  // stream the model's work runs on (exposed-wait metrics only). step(),
  // evaluate() and seeking data need a runner and fail without one.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options, const LayeredModel& model,
                                                Device& device, comm::Communicator& comm,
                                                Stream* model_stream = nullptr);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One optimizer step: grad_accum micro-batches of the runner, gradient
  // reduction, global norm, clipping, the (possibly overlapped) update. A
  // rolled-back or dropped step is an error (the runner's data moved back;
  // the next call repeats it).
  Result<StepMetrics> step();
  // Mean validation loss over the runner's evaluation batches and all ranks.
  Result<double> evaluate();

  // Note [Driving the engine]. begin_step() is also the provider's
  // "before the first micro-batch" hook.
  Status begin_step() override;
  // The factor the gradient of a micro-batch's mean loss is scaled by (the
  // loss scale / (grad_accum x world size)); valid after begin_step().
  double gradient_scale() const;
  Status begin_micro_batch(bool last);
  // `mean_loss`: this rank's mean loss of the micro-batch; `tokens`: the
  // tokens (or samples) it trained on, for throughput.
  Status end_micro_batch(double mean_loss, int64_t tokens);
  // The commit point of the previous step, the global norm, the overflow
  // vote and the update. An error only when the engine stopped (stopped()).
  Result<StepOutcome> finish_step();
  // The lr of every step from the next finish_step() on, instead of the
  // config's (optimizer.params.lr or its "scheduler"): a caller's own
  // schedule (a torch lr scheduler through strata.torch) sets it before each
  // finish_step(). Each run's lr_scale still applies; a OneCycle config's
  // betas still cycle. Refused (InvalidArgument, nothing changed) unless
  // finite and in [0, 1000], the range the config accepts.
  Status set_step_lr(double lr);
  // Drops the step in progress (after begin_step(), before finish_step()):
  // the caller's model failed part-way (e.g. an exception in a PyTorch
  // forward) or the caller gives the step up. Layers it still holds are
  // released (its passes must be over: with a model stream, what is queued
  // there is waited for), the gradients accumulated so far are discarded,
  // the counters go back to the step's start, and the next begin_step()
  // repeats the step: its losses are those of a run that never began it.
  // The previous step's updates stay pending (committed at the next commit
  // point). Every rank abandons the same step (reductions already issued
  // are collectives).
  Status abandon_step();
  // Initial values of layer `layer_index` for a model that does not provide
  // its own (LayeredModel::provides_initial_values() false, e.g. a
  // SpecModel): `params` is the whole layer (param_bytes, declared dtypes);
  // `fp32`, when given (param_count values), is what the master weights start
  // from, else the parameters widened. Every rank calls it for every layer
  // before the first step (begin_step refuses a layer still missing); each
  // rank keeps only its own pieces, written straight to where the
  // placement puts them (device, pinned host, NVMe).
  Status put_initial_layer(size_t layer_index, std::span<const std::byte> params, std::span<const float> fp32 = {});
  Status begin_evaluation();
  // `loss_sum`: the sum of this rank's `batches` evaluation losses. Returns
  // the mean over every rank's batches.
  Result<double> finish_evaluation(double loss_sum, int64_t batches);
  // Waits for every queued update and commits it (the end of training, or
  // before reading state); with several ranks every rank calls it (the
  // commit point's vote, Note [Atomic steps]).
  Status synchronize();

  // Where the driving thread is (Note [Driving the engine]): between steps
  // (and evaluations), inside a step between its micro-batches, inside a
  // micro-batch, inside an evaluation.
  enum class Phase : uint8_t { kIdle, kStep, kMicroBatch, kEvaluation };
  Phase phase() const;
  // The passes holding layer `layer_index` now: acquires (of any pass) not
  // yet released. An acquire that fails after its layer was lent (e.g. a
  // backward's gradient buffer that cannot be allocated) leaves it held:
  // release it, or abandon_step() releases every held layer.
  // InvalidArgument for a layer out of range.
  Result<int> layer_holds(size_t layer_index) const;

  // ParameterProvider
  Result<LayerMemory> acquire(size_t layer_index, Pass pass) override;
  // acquire() for a caller that says who waits for the layer's `ready`
  // (Note [Who waits for an acquired layer] in acquire_waiter.h): the step
  // metrics' exposed waits are timed from when that waiter reaches it.
  Result<LayerMemory> acquire(size_t layer_index, Pass pass, AcquireWaiter waiter);
  Status release(size_t layer_index, Pass pass, const Completion& done) override;
  // release() for a caller whose views of the layer's parameters may
  // outlive the pass (autograd's saved tensors: the Python bindings):
  // `done` ends the pass (gradients written, as above), `memory_returned`
  // completes when nothing reads the parameter memory any more. A gathered
  // copy is freed only after both; the engine never waits for
  // `memory_returned` (until it completes the copy counts against
  // stage3_max_live_parameters and the memory plan is exceeded by it).
  Status release(size_t layer_index, Pass pass, const Completion& done, const Completion& memory_returned);

  const EngineOptions& options() const;
  const Partition& partition() const;
  // Where every kind of each layer's state lives (Note [State placement]):
  // e.g. placement().layers[i].persistent(), whether layer i's parameter
  // memory stays the same from one acquire to the next.
  const StatePlacement& placement() const;
  int rank() const;
  int world_size() const;
  int64_t optimizer_steps() const;  // updates applied (a skipped fp16 step is not one)
  // The full values of one piece of layer i's state, gathered from every
  // rank's shard as fp32 (a collective: every rank must call it), after
  // every queued update. kMaster is the fp32 master (the parameters
  // themselves for fp32 parameters stepped on the device). For tests and export.
  enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq };
  Result<std::vector<float>> gather_state(size_t layer_index, StateKind kind = StateKind::kMaster);
  // Checkpoints (Note [Checkpoint layout], checkpoint.h). A collective: every
  // rank calls it after the same step. Waits for the previous save, then
  // queues a snapshot of each piece of this rank's state on the optimizer
  // thread, after this step's updates and before the next step's (so the
  // next step runs while the state is written), into snapshot_slots bounded slots that
  // a writer thread drains to files; returns at once unless options.sync
  // (or ratio < 1, whose device part is stepped on a second thread: then it
  // returns once the snapshot is taken). Rank 0 commits (manifest, rename,
  // `latest`) when every rank's files are durable.
  Result<CheckpointSaveInfo> save_checkpoint(const CheckpointSaveOptions& options);
  // Waits for the save in flight; its error, or what it did (nullopt: none in
  // flight). Call it before destroying the engine: the destructor lets this
  // rank's files finish but rank 0 no longer waits for its peers to commit.
  Result<std::optional<CheckpointSaveDone>> wait_checkpoint();
  // Loads DIR (its latest tag), DIR/TAG or a tag folder, saved at any world
  // size, stage or placement, into this fresh engine (before its first
  // step) and moves the runner's data to where the save left it. Every rank
  // calls it; each reads only the extents its pieces overlap.
  //
  // Note [A failed load]
  // A load writes the state layer by layer as it reads the extents, each
  // checked against its checksum as it is read: a damaged extent (DataLoss
  // naming the file, offset and layer), a read error, or a failed write of
  // the NVMe tier found part-way leaves the layers before it holding the
  // checkpoint's values and the rest their own. Checking every extent
  // before writing anything would read this rank's share of the checkpoint
  // twice (docs/checkpoints.md measures it) and still not cover a read or
  // write that fails after the check. So the load does not try to undo:
  // from the first write on, a failure leaves the engine refusing every
  // step, evaluation pass over a trained layer, save and gather_state() of
  // a trained layer, with an error (FailedPrecondition) that names the
  // checkpoint and the failure, until a load_checkpoint() succeeds (of
  // another tag, or of this one repaired). A load refused before it writes
  // (a missing file, another model shape, frozen layers that differ)
  // changes nothing.
  Result<CheckpointManifest> load_checkpoint(const std::string& dir_or_tag);
  // Ok while the engine can go on (after a rolled-back step too); else why
  // it stopped (Note [Atomic steps]).
  Status stopped() const;
  // Steps begun (begin_step, step()), skipped fp16 steps included, a
  // rolled-back one not; a resumed run counts the saved ones (the manifest's step_calls).
  int64_t steps_begun() const;
  // The loss scale the next step will use (1 unless fp16).
  double loss_scale() const;
  EngineMemory predicted_memory() const;
  // The whole model's training state as one rank would hold it without
  // ZeRO (parameters, gradients, master weights, moments), in bytes.
  uint64_t model_state_bytes() const;
  EngineMemory measured_memory() const;  // device, pinned and nvme peaks only
  // A one-line description: "stage 3, optimizer cpu (pinned host), params cpu, bf16, 2 ranks".
  std::string describe() const;

 private:
  // Creates engines with injected faults (Note [Testing seam] in
  // strata/offload/testing/engine_seam.h; not part of the installed API).
  friend class testing::EngineSeam;
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  // Both create()s, and EngineSeam's with `faults` (null: none).
  static Result<std::unique_ptr<Engine>> create_with_faults(const EngineOptions& options, ModelRunner* runner,
                                                            const LayeredModel& model, Device& device,
                                                            comm::Communicator& comm, Stream* model_stream,
                                                            const testing::EngineFaults* faults);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
