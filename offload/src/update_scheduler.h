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

class EarlyUpdates;  // early_updates.h

class UpdateScheduler {
  // Steps its layers early through jobs_of, step_layer, queue_device_part,
  // the optimizer thread and stream, and their LayerUpdate (early_updates.h).
  friend class EarlyUpdates;

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

  UpdateScheduler(EngineContext& ctx, ParameterGathering& params);
  ~UpdateScheduler();

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

  // Note [Early, exact updates] and the tier's read-ahead order (early_updates.h).
  EarlyUpdates& early() { return *early_; }

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
  void start_timing();
  double timed_ms() const { return update_ns_ ? static_cast<double>(update_ns_->load()) / 1e6 : 0.0; }
  double take_timed_ms() {
    const double ms = timed_ms();
    update_ns_.reset();
    return ms;
  }

  // Teardown: the optimizer threads run what is queued, then stop.
  void stop_workers();

 private:
  // Layer li's piece jobs (host part) and, split, the device part's.
  // `early`: staged values are not copied to the device by the update
  // (h2d_once_kept instead of h2d; no bytes counted yet).
  std::vector<PieceJob> jobs_of(size_t li, const GradientReduction::UpdateInput& input,
                                const cpu_adam::HyperParams& hyper, std::vector<PieceJob>* device_jobs,
                                bool early = false);
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
  // Nanoseconds the optimizer threads spent in one step's updates, added by
  // the update tasks themselves.
  std::shared_ptr<std::atomic<int64_t>> update_ns_;
  // Note [Early, exact updates]; before the workers: its tasks on them point to it.
  std::unique_ptr<EarlyUpdates> early_;
  std::unique_ptr<SerialWorker> worker_;      // last-but-one: stopped before the state it steps
  std::unique_ptr<SerialWorker> dev_worker_;  // ratio < 1: steps the device part at the same time
};

}  // namespace strata::offload::engine_detail
