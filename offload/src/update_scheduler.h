#pragma once
// UpdateScheduler: the optimizer state and the per-layer updates. Private to
// offload/src.
//
// Note [Update scheduling]
// The optimizer state (fp32 master weights, moments) lives in an
// OptimizerStateTier: pinned host or device memory (updated in place), or
// NVMe (streamed through pinned slots, each update written as a new piece
// version; Note [Piece versions]); with offload_optimizer.ratio < 1 each
// piece's last elements live in a second, device tier stepped by a second
// thread (one SplitStateTier, Note [Split optimizer state]: the scheduler
// reaches the parts, the other components ask it about the state as a
// whole). A layer's update is queued on the optimizer thread (SerialWorker)
// once its reduced gradient and block sums are in (GradientReduction's
// UpdateInput) and, for a layer lent in place, its last release
// (ParameterGathering::writable_after); layers are queued in forward order,
// so the next forward waits only for the layers it reaches (Note [Exact
// overlap] in engine.h). A piece is stepped as its runs of equal per-tensor
// hyper-parameters; the updated 16-bit values go H2D tile by tile from the
// optimizer's tile callback while later tiles compute, or into pinned
// staging for an NVMe shard's write-back (Note [Update staging] in
// state_placement.h). An update's failure is absorbed
// into the context's StepFailures (the commit point votes on it); one that
// leaves state kept in place part-stepped is kTorn.
//
// Note [Early, exact updates] (docs/engine.md) adds a second way in: where
// the placement allows it (StatePlacement::early_updates), a layer's update
// is queued as soon as its reduced gradient is in during the step's last
// backward, with the arguments the step will most likely have (no
// clipping, finite gradients). It steps out of place: the state is read
// from the tier's pieces and the new state written into their pending
// buffers (Note [Pending versions in memory] in state_tier.h), so the
// committed state stays whole, at the cost of no extra pass. At the step's
// end the updates not started yet are claimed back (queued normally, in
// forward order, with the true arguments); a started one is kept when its
// arguments were the true ones (the same kernel on the same inputs: the same
// bits; its pending buffers become the state), else redone by a normal
// update of the untouched state or, when the step is skipped or dropped,
// forgotten (the parameters it wrote are rewritten from the state).
//
// Note [Kept values in forward order]
// A kept early update's staged 16-bit values go to the device at the step's
// end. The device serves host-to-device copies from one queue, in order (a
// GPU's copy engine; the cpu device's H2D engine). Queued from the driving
// thread as each layer was kept, the kept layers' copies (most of the model)
// went ahead of the tile copies of the layers whose early updates were
// claimed back: those reduced last, which the next forward needs first. The
// forward waited for all of them (measured on `small`, stage 2: 8-11 ms of
// its 15-17 ms wait for updates). So the copies of a kept layer are queued
// on the optimizer thread, behind the updates of the layers before it: the
// copies reach the queue in the order the forward needs them.
//
// Threads: the driving thread queues; the optimizer threads step.
#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "engine_context.h"
#include "gradient_reduction.h"
#include "parameter_gathering.h"
#include "piece_stepper.h"
#include "serial_worker.h"
#include "split_state_tier.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/offload/state_tier.h"

namespace strata::offload::engine_detail {

class StepNvmeBytes;  // step_nvme_bytes.h

class UpdateScheduler {
 public:
  // A run of a layer's elements with the same per-tensor hyper-parameters
  // (ParamTensorSpec::weight_decay, lr_scale): the optimizer steps a piece
  // as its runs. Adjacent tensors with equal values share a run.
  struct HyperRun {
    size_t begin = 0, end = 0;  // layer elements [begin, end)
    double weight_decay = 0;
    double lr_scale = 1;
  };
  struct LayerUpdate {
    std::vector<HyperRun> hyper_runs;
    HostBuffer staging;          // UpdateStaging::kLayer: updated values until the step keeps them
    Completion update_ran;       // the update ran (ok even when it failed: Note [Atomic steps])
    Completion update_written;   // the update and its parameter write-back; fails when either did
  };
  // What queue_update hands on: when the update ran (the gradient's last
  // reader) and when its values are in place (absorbed: completes ok).
  struct Queued {
    Completion update_ran;
    Completion updated;
  };

  UpdateScheduler(EngineContext& ctx, ParameterGathering& params) : ctx_(ctx), params_(params) {}

  // The tiers, the optimizers, the streams and the optimizer threads.
  Status init(const std::string& job_name);
  // Where a layer's initial master weights come from: its padded fp32
  // values, or zeros (a model whose values are handed in later through
  // Engine::put_initial_layer: then no layer-sized buffer is made, only one
  // piece of zeros at a time).
  struct InitialMaster {
    std::span<const float> layer;  // padded fp32 values; empty with `zeros` or for a layer without master
    bool zeros = false;
  };
  // Layer li's hyper-parameter runs, staging and optimizer state.
  Status init_layer(size_t li, const InitialMaster& master);

  Result<Queued> queue_update(size_t li, const GradientReduction::UpdateInput& input, int64_t step, double clip,
                              double scale, const cpu_adam::HyperParams& hyper);

  // Note [Early, exact updates]. The step's last micro-batch begins: early
  // updates assume step number `step`, loss scale `scale`, `hyper` (its lr
  // and betas), clip coefficient 1 and finite gradients until
  // close_early_updates().
  // `previous_step_bytes`, when given (the previous step's updates of state
  // on NVMe are still pending): on the optimizer thread, before the step's
  // first early update (the updates queued before it have run), the
  // previous step's updates end there (StepNvmeBytes::previous_updates_done;
  // Note [A step's NVMe bytes]).
  void open_early_updates(int64_t step, double scale, const cpu_adam::HyperParams& hyper,
                          StepNvmeBytes* previous_step_bytes);
  bool early_updates_open() const { return early_open_; }
  // Layer li's reduced gradient is in: its update is queued now.
  Status queue_early_update(size_t li, const GradientReduction::UpdateInput& input);
  // The step's end (or its abandonment): the early updates not started are
  // claimed back; the started ones are waited for (bounded).
  Status close_early_updates();
  // After close: layer li's early update started (its state may differ from
  // the previous step's); `matches`: it ran to the end with exactly these
  // arguments, so it is the step's update.
  bool ran_early(size_t li) const { return li < early_.size() && early_[li].ran; }
  bool early_matches(size_t li, int64_t step, double clip, double scale, const cpu_adam::HyperParams& hyper) const;
  // Every piece of layer li's early update is whole in the tier (waits for
  // a versioned tier's pending writes; false names nothing: the caller
  // redoes the layer, which rewrites the piece).
  bool early_written(size_t li);
  // The kept early update of layer li, as queue_update would have returned
  // it: its pending buffers become the state, its staged values are copied
  // to the device now; with offload_optimizer.ratio < 1 the layer's device
  // part (never stepped early) is queued now from `input`.
  Result<Queued> keep_early(size_t li, const GradientReduction::UpdateInput& input);
  // Every layer whose early update started: the parameters it wrote are
  // rewritten from the (untouched) state, on the calling (driving) thread;
  // the early updates are forgotten. For a skipped or dropped step; returns
  // how many.
  Result<int64_t> undo_every_early();
  // The step's updates are queued (kept, redone or normal): its early
  // updates are forgotten, so no later commit point undoes them.
  void forget_early_updates() { early_.clear(); }
  // Behind the updates queued so far: a versioned tier reads ahead for the
  // next step, its early updates' walk when `next_step_early`, else the
  // forward one (Note [Read-ahead at the step's end] in docs/engine.md).
  void read_ahead_for_next_step(bool next_step_early);
  // The same before the first step, every layer's state added (nothing is
  // queued yet): the tier is told on this thread.
  void read_ahead_for_first_step(bool first_step_early);

  // One piece's state (piece_real elements, host part then device part) as
  // fp32; a null pointer skips that kind. Reads and writes through the tiers.
  Status read_piece_state(size_t li, size_t gi, int r, float* master, float* exp_avg, float* exp_avg_sq);
  Status write_piece_state(size_t li, size_t gi, int r, const float* master, const float* exp_avg,
                           const float* exp_avg_sq);

  // The optimizer state as a whole (Note [Split optimizer state] in
  // split_state_tier.h: its parts are the scheduler's alone), after init.
  std::string describe_state() const { return state_->describe(); }
  bool state_versioned() const { return state_->versioned(); }
  StateTierIoStats state_io_stats() const { return state_->io_stats(); }
  // Every write-back durable (the initial state, synchronize(), the previous
  // step's updates before the next step's early ones); the first failure.
  Status flush_state() { return state_->flush(); }
  // The commit point: the pending step's write-backs are durable and none was lost.
  Status state_ready_to_commit() { return state_->ready_to_commit(); }
  // The pending step (or what init_layer or a load wrote) becomes the committed state.
  Status commit_state() { return state_->commit(); }
  // A failed step: the state back at the committed step where it keeps one
  // (state_versioned()), else the step kept as the state holds it.
  Status abandon_state_step() { return state_->abandon_step(); }
  // For a checkpoint snapshot, which must read one step's state: the
  // rollbacks so far, and whether a write-back of the pending step was lost.
  uint64_t state_rollbacks() const { return state_->rollbacks(); }
  Status state_committable() const { return state_->committable(); }
  // `task` on the optimizer thread, after `gate` and behind the updates
  // queued so far (a checkpoint's snapshots, the gradients' block sums).
  // `sticky`: as SerialWorker::submit (a failure skips the tasks after it).
  Completion queue_on_optimizer_thread(SerialWorker::Task task, Completion gate, std::string label, bool sticky) {
    return worker_->submit(std::move(task), std::move(gate), std::move(label), sticky);
  }
  const LayerUpdate& layer(size_t li) const { return layers_[li]; }
  // The layers set up so far (0 until init; fewer when the engine's init failed part-way).
  size_t layer_count() const { return layers_.size(); }

  // Time the optimizer threads spend in one step's updates: started when a
  // step's updates are queued, read (once) when they are done.
  // Early updates' time (Note [Early, exact updates]) counts in the step's.
  void start_timing() {
    update_ns_ = std::make_shared<std::atomic<int64_t>>(early_ns_ ? early_ns_->load() : 0);
    early_ns_.reset();
  }
  double timed_ms() const { return update_ns_ ? static_cast<double>(update_ns_->load()) / 1e6 : 0.0; }
  double take_timed_ms() {
    const double ms = timed_ms();
    update_ns_.reset();
    return ms;
  }

  // Teardown: the optimizer threads run what is queued, then stop.
  void stop_workers();

 private:
  // One layer's early update of the current step (Note [Early, exact updates]).
  struct EarlyUpdate {
    // Whoever sets it first steps the layer: the early task, or the step's
    // end claiming it back. A fresh one per step: a claimed task still
    // queued holds its own.
    std::shared_ptr<std::atomic<bool>> claimed;
    bool queued = false;
    bool ran = false;       // close(): the task started
    Completion done;        // the task (its failure included)
    // UpdateStaging::kParameterSlot: the shard's write-back the task started
    // (set by the task; read after `done`).
    std::shared_ptr<Completion> write_back;
    std::vector<PieceJob> jobs;
  };
  // Layer li's piece jobs (host part) and, split, the device part's.
  // `early`: staged values are not copied to the device by the update
  // (h2d_once_kept instead of h2d; no bytes counted yet).
  std::vector<PieceJob> jobs_of(size_t li, const GradientReduction::UpdateInput& input,
                                const cpu_adam::HyperParams& hyper, std::vector<PieceJob>* device_jobs,
                                bool early = false);
  // The parameters layer li's jobs write, rewritten from the (untouched)
  // state, as an update writes them (a shard on NVMe: written back, waited for).
  Status rewrite_params(size_t li, const std::vector<PieceJob>& jobs);
  // One layer's host update on the optimizer thread: stepped into a borrowed
  // parameter slot and written back from it when `in_slot` (Note [Update
  // staging]; `write_back` gets the write), else where the jobs point.
  Status step_layer(size_t li, std::vector<PieceJob>& jobs, const cpu_adam::StepArgs& args, DType param_dtype,
                    bool in_slot, bool out_of_place, std::atomic<int64_t>& spent, Completion& write_back);
  Result<std::unique_ptr<OptimizerStateTier>> make_nvme_tier(const std::string& job_name);
  // Layer li's runs intersected with layer elements [begin, begin + count), offsets from begin.
  std::vector<PieceJob::Run> runs_of(size_t li, size_t begin, size_t count, const cpu_adam::HyperParams& hyper) const;
  // ratio < 1: the device part's update of layer li on its own thread, after `gate`.
  Completion queue_device_part(size_t li, std::vector<PieceJob> jobs, const cpu_adam::StepArgs& args,
                               DType param_dtype, const Completion& gate);

  EngineContext& ctx_;
  ParameterGathering& params_;
  std::unique_ptr<Stream> opt_stream_;  // device_opt(): the device Adam kernel's stream
  // The optimizer thread's H2D copies of updated tiles (PieceStepper): queued
  // from the tile callback while later tiles compute (cuda: asynchronous
  // copies from pinned staging), waited for once per piece.
  std::unique_ptr<Stream> update_stream_;
  std::optional<PieceStepper> stepper_;  // one layer's step over its pieces (init)
  // UpdateStaging::kSharedPiece: every such layer's pieces, one at a time
  // (Note [Update staging] in state_placement.h).
  HostBuffer shared_staging_;
  std::optional<SplitStateTier> state_;  // the optimizer state (init)
  std::optional<cpu_adam::CpuOptimizer> optimizer_;
  std::optional<cpu_adam::CpuOptimizer> dev_optimizer_;  // ratio < 1: steps the device part (its own thread)
  std::vector<LayerUpdate> layers_;
  // Note [Early, exact updates]: the step's assumed arguments and each
  // layer's early update.
  bool early_open_ = false;
  cpu_adam::StepArgs early_args_;
  std::vector<EarlyUpdate> early_;
  // A versioned tier reads ahead in the order it will be opened: the
  // pieces in add() order for the step's updates (forward), the layers
  // in reverse for the early ones (the backward's reductions), set when
  // the first early update of a step is queued; at that step's end, the
  // layers stepped late, then the kept ones in the early walk (Note
  // [Read-ahead at the step's end] in docs/engine.md).
  enum class Walk : uint8_t { kForward, kEarly, kStepEnd };
  std::vector<StateId> forward_walk_, early_walk_;
  const std::vector<StateId>& early_walk();  // built from forward_walk_ on first use
  Walk walk_ = Walk::kForward;  // the walk last given to the tier (add() order at first)
  bool early_walk_set_ = false;  // this step's early updates set theirs
  StepNvmeBytes* previous_step_bytes_ = nullptr;  // open_early_updates()'s, told once per step
  // Queues the main tier's set_order(walk) (unless the tier reads in `which` already),
  // then `then` (when given), on the optimizer thread.
  void set_walk(const std::vector<StateId>& walk, Walk which, const char* label, std::function<void()> then = {});
  // Nanoseconds the optimizer threads spent in one step's updates, added by
  // the update tasks themselves.
  std::shared_ptr<std::atomic<int64_t>> update_ns_;
  std::shared_ptr<std::atomic<int64_t>> early_ns_;  // the early updates' (a step's last backward)
  std::unique_ptr<SerialWorker> worker_;      // last-but-one: stopped before the state it steps
  std::unique_ptr<SerialWorker> dev_worker_;  // ratio < 1: steps the device part at the same time
};

}  // namespace strata::offload::engine_detail
