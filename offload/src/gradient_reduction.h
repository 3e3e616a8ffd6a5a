#pragma once
// GradientReduction: each layer's gradient from its backward to the
// optimizer's input, and the global norm. Private to offload/src.
//
// Note [Gradient reduction]
// A layer's full gradient lives on the device: a buffer kept across steps
// (stages 0-1, zeroed once per step after the last step's readers) or one
// per step (stages 2-3, allocated at the first backward acquire under
// reduce_bucket_size, LentBuffers, freed once reduced and moved). A layer's
// gradient is complete at its last backward release (the trace's count) or,
// for one the step did not use, when the step's last micro-batch ends (a
// zero gradient). Reductions are issued in canonical order, descending
// layer index, never in arrival order, so every rank issues the same
// collectives in the same order: reduce-scatter per sub-group (stage 0
// all-gathers the reduced pieces back), then the owned pieces move to where
// the optimizer reads them (pinned host, a device shard, or in place), then
// the optimizer thread computes their block sums of squares; the global norm
// adds every rank's blocks in (layer, group, rank, block) order, the same
// sum at every stage and world size's placement (docs/engine.md).
//
// Threads: the driving thread calls everything; the block sums run on the
// optimizer thread (UpdateScheduler::queue_on_optimizer_thread), in
// submission order; a small layer's run inline when its gradient is
// already in place.
//
// One rank (world size 1): the sum over ranks is the gradient itself, so a
// reduction queues no collective and its completion is the backward's.
#include <array>
#include <functional>
#include <optional>
#include <vector>

#include "engine_context.h"
#include "lent_buffers.h"
#include "serial_worker.h"

namespace strata::offload::engine_detail {

class UpdateScheduler;  // update_scheduler.h

class GradientReduction {
 public:
  struct LayerGradients {
    DeviceBuffer full_grads;
    int64_t zeroed_step = -1;               // the step (steps_begun) its buffer was zeroed for
    Completion grads_zeroed;
    Completion last_backward_released;      // `done` of the latest kBackward release
    int backward_releases = 0;              // this micro-batch
    bool reduce_launched = false;           // this step
    Completion full_gradient_read;          // everything that read full_grads this step (reduction, copies, update)
    DeviceBuffer opt_grads_dev;             // owned layout, when the optimizer reads a device shard
    HostBuffer opt_grads_host;              // owned layout, offload_optimizer cpu / nvme
    HostBuffer norm_grads;                  // device_opt(): the reduced gradient's host copy for the block sums
    Completion reduced_gradient_moved;      // the reduced gradient is in the optimizer's input buffer
    std::vector<double> block_sums;         // owned blocks, owned order
    Completion norm_partials_ready;         // block_sums hold this step's partial sums of the norm
  };
  // Where layer li's update reads its reduced gradient (owned pieces).
  struct UpdateInput {
    const std::byte* grads = nullptr;              // the optimizer's input (host part when split); null: on NVMe
    bool on_nvme = false;                          // Note [Gradient shards on NVMe]: read back piece by piece
    bool padded_layout = false;                    // at piece_begin offsets, else shard offsets
    const std::byte* device_part_grads = nullptr;  // split: the device shard (shard offsets)
    Completion reduced;                            // the gradient is there and its block sums are done
  };

  // `updates`: the block sums run on its optimizer thread, and where early
  // updates are on (Note [Early, exact updates]) a layer's update is queued
  // there as soon as its reduction is issued (EarlyUpdates::queue,
  // on the driving thread, in the reductions' canonical order).
  GradientReduction(EngineContext& ctx, UpdateScheduler& updates) : ctx_(ctx), updates_(updates) {}

  // After UpdateScheduler::init (its optimizer thread runs the block sums).
  void init();
  Status init_layer(size_t li);

  void begin_step();
  void begin_micro_batch();
  // A backward acquire: refused once the layer's reduction started (it
  // departed from the recording after its last recorded backward).
  Status check_backward_acquire(size_t li) const;
  // The layer's gradient buffer for a backward pass, zeroed once per step;
  // the model accumulates into it once `zeroed` completes.
  struct Lease {
    std::byte* grads = nullptr;
    Completion zeroed;
  };
  Result<Lease> acquire_for_backward(size_t li);
  // A backward release; `expected` backward releases complete the gradient
  // when `completes` (a training micro-batch, the step's last).
  Status released_in_backward(size_t li, const Completion& done, std::optional<int> expected, bool completes);
  // Every gradient is complete (the step's last micro-batch ended): the
  // rest are reduced, in canonical order, the unused layers' as zeros.
  Status launch_every_reduction();
  // The sum of squares of the reduced gradient over every rank (blocks).
  Result<double> global_norm_squared();

  const Completion& backward_released(size_t li) const { return layers_[li].last_backward_released; }
  UpdateInput update_input(size_t li) const;
  // The update of the layer reads the reduced gradient until `update_ran`.
  void read_until(size_t li, const Completion& update_ran) { layers_[li].full_gradient_read = update_ran; }
  // The step is abandoned (Engine::abandon_step): waits for the reductions
  // it issued, block sums included, so the repeated step's moves into the
  // optimizer's input buffers never overlap their reads.
  Status wait_for_issued_reductions();
  // The step is being repeated (a rollback): gradients are zeroed again.
  void forget_zeroing() {
    for (LayerGradients& l : layers_) l.zeroed_step = -1;
  }

 private:
  Status gradient_completed(size_t li);
  // Layer li's reduction was issued (its update_input is valid): its early
  // update is queued when the placement has them.
  Status reduction_issued(size_t li);
  // Sums the layer's gradient over ranks, moves the owned pieces to where
  // the optimizer reads them, and queues their block sums.
  Status launch_reduction(size_t li);
  // Its steps, in order (`full`: the layer's gradient buffer).
  Status zero_untouched_gradient(LayerGradients& l, size_t li);
  Result<Completion> gradient_to_reduce(LayerGradients& l, size_t li, std::byte* full);
  Result<Completion> sum_over_ranks(size_t li, std::byte* full, const Completion& local);
  void spill_reduced_gradient(LayerGradients& l, size_t li, std::byte* full, const Completion& reduced);
  Result<std::byte*> move_to_optimizer_input(LayerGradients& l, size_t li, std::byte* full, const Completion& reduced);
  Result<std::byte*> move_split_pieces(LayerGradients& l, size_t li, std::byte* full, std::byte* host_dst,
                                       const Completion& reduced);
  Status move_owned_pieces(size_t li, std::byte* full, std::byte* dst, CopyKind kind, const Completion& reduced);
  Result<const std::byte*> copy_for_host_sums(LayerGradients& l, size_t li, const std::byte* full,
                                              const std::byte* dst, const Completion& reduced);
  void gradient_moved(LayerGradients& l, size_t li, const Completion& reduced);
  void queue_block_sums(LayerGradients& l, size_t li, const std::byte* src, bool in_padded_layout);
  // The block sums of squares of the layer's owned pieces at `src`, into its block_sums.
  void sum_blocks(size_t li, const std::byte* src, bool in_padded_layout);
  // One owned piece's (`elements`, padded) block sums, into block_sums from `block_offset`.
  void sum_piece_blocks(size_t li, size_t block_offset, const std::byte* piece, size_t elements);
  // Zeroes the layer's gradient buffer on the zeroing stream once `readers`
  // are done (Note [Gradient buffers zeroed apart]); sets grads_zeroed.
  Status zero(LayerGradients& l, size_t li, const Completion& readers);
  // Owned elements up to which a layer's block sums run on the driving
  // thread when its gradient is already in place: summing them takes about
  // as long as handing the work to the optimizer thread (a wake-up).
  static constexpr size_t kInlineBlockSumElements = 16 * 1024;

  EngineContext& ctx_;
  UpdateScheduler& updates_;
  std::vector<LayerGradients> layers_;
  // Reductions are issued in descending layer order: next_reduction_ is
  // the highest layer not launched yet (-1: none left).
  std::vector<bool> gradient_complete_;
  int64_t next_reduction_ = -1;
  // Stage 2-3 full gradients: device buffers under reduce_bucket_size,
  // freed once their users are done (Note [Lent buffers]).
  std::optional<LentBuffers> live_;
};

}  // namespace strata::offload::engine_detail
