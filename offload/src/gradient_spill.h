#pragma once
// GradientSpill: reduced gradient shards on NVMe beside the optimizer state
// (or beside the stage-3 parameter shards when the state is in host memory).
// Private to offload/src.
//
// Note [Gradient shards on NVMe]
// With the optimizer state on NVMe (streamed through its slots), what still
// grows with the model in pinned host memory is the reduced gradient shard
// (2-4 B per parameter): the step needs every layer's, and only once the
// backward is over (the norm, the overflow vote). With strata.gradient_shards
// nvme (or auto, when the pinned plan does not fit the host budget) a
// layer's reduced gradient stays on the device until this component's
// thread copies its owned pieces, one at a time, into a pinned gradient
// slot, takes their block sums for the norm there, and writes each piece as
// its own tensor of a swap store: a shadow write, the previous step's copy
// stays until the new one is durable; the slot returns once the write ends.
// The store's folder (StatePlacement::gradient_folder) is
// offload_optimizer.nvme_path, or offload_param.nvme_path when the state is
// in host memory: its 12 B per parameter (about 6 with 8-bit moments) are
// then the host's only per-parameter cost. The update reads each
// piece back into a slot just before stepping it, the next piece's read in
// flight while it steps.
//
// Host memory: the slots (StatePlacement::gradient_slot_count x the largest
// owned piece's gradient), whatever the model's size. The cost: every
// gradient byte written and read once more per step on NVMe (counted in
// the step's nvme bytes). The values and the order of every sum are the
// pinned path's, so losses are bit-identical. A copy, write or read that
// fails fails the step (recorded for the commit point's vote, Note [Atomic
// steps] in engine.h): the step is dropped and can be repeated.
//
// Threads: spill() queues on this component's thread (a SerialWorker, in
// submission order); read() is called from the optimizer thread.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine_context.h"
#include "serial_worker.h"
#include "strata/core/slot_pool.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_store.h"

namespace strata::offload::engine_detail {

class GradientSpill {
 public:
  static Result<std::unique_ptr<GradientSpill>> create(EngineContext& ctx, const std::string& job_name);
  ~GradientSpill();
  GradientSpill(const GradientSpill&) = delete;
  GradientSpill& operator=(const GradientSpill&) = delete;

  // Called once per piece with its host copy: `block_offset` is the index of
  // the piece's first block among the layer's owned blocks, `elements` its
  // (padded) size.
  using PieceSums = std::function<void(size_t block_offset, const std::byte* piece, size_t elements)>;
  // Queues layer li's spill: once `reduced` completes, each owned piece of
  // `full` (the layer's device gradient, padded layout) is copied into a
  // slot, summed, and written. The completion: every piece summed and its
  // write ended (ok even when something failed: the failure is recorded
  // for the commit point).
  Completion spill(size_t li, const std::byte* full, const Completion& reduced, PieceSums sums);

  // A piece's gradient being read back into a slot.
  struct Read {
    Slot slot;
    Completion done;
    uint64_t bytes = 0;
  };
  // Starts reading piece `id`'s gradient into a slot. `wait`: blocks for a
  // free slot (bounded by the pool's timeout); otherwise returns an empty
  // Read when none is free.
  Result<Read> read(const StateId& id, bool wait);
  // Waits (bounded) for `read` of piece `id`; counts its bytes once there,
  // as the optimizer-state tier counts a read when the step consumes it. A
  // read that failed or did not end keeps its slot until it ends.
  Status arrived(Read& read, const StateId& id);

  // Bytes written and read back since the engine began (the step's nvme bytes).
  uint64_t bytes_written() const { return bytes_written_; }
  uint64_t bytes_read() const { return bytes_read_; }
  // The queued spills run, then the thread stops (teardown).
  void stop();

 private:
  explicit GradientSpill(EngineContext& ctx) : ctx_(ctx) {}
  // The store's tensor of piece (layer, group, rank).
  nvme::TensorId key_of(const StateId& id) const;
  Status spill_now(size_t li, const std::byte* full, const PieceSums& sums);

  EngineContext& ctx_;
  std::unique_ptr<nvme::IoEngine> owned_engine_;
  nvme::IoEngine* engine_ = nullptr;
  bool registered_ = false;
  std::unique_ptr<SlotPool> pool_;
  std::unique_ptr<nvme::SwapStore> store_;
  std::vector<uint64_t> first_key_;  // per layer: the key of its first owned piece
  std::vector<bool> counted_;        // per key: its NVMe bytes are counted (first write; spill thread)
  uint64_t nvme_bytes_ = 0;          // counted so far
  std::atomic<uint64_t> bytes_written_{0}, bytes_read_{0};
  std::unique_ptr<SerialWorker> worker_;  // last: stopped before the store and slots go
};

}  // namespace strata::offload::engine_detail
