#pragma once
// ShardHome: where one stage-3 layer's parameter shard (this rank's pieces,
// shard layout, the layer's dtype) lives, and the operations that depend on
// it. Private to offload/src.
//
// Note [Shard homes]
// StatePlacement decides each layer's ParamHome once; make_shard_home turns
// a sharded layer's home into an object that owns the shard's memory:
//  - DeviceShard (kShardOnDevice): a device buffer, sent to the all-gather
//    from where it is (at world size 1 it is the whole padded layer, lent
//    in place: resident());
//  - PinnedHostShard (kShardInPinnedHost): pinned host memory, copied H2D
//    into its pieces' places in the gathered buffer on the shard copy
//    stream, then gathered in place;
//  - NvmeShard (kShardOnNvme): a ParamSwap tensor, read into a slot on the
//    shard reader thread and copied into place from there; its update is
//    stepped into a borrowed slot and written back from it (update_slot,
//    write_back).
// ParameterGathering keeps what every shard has (its ready completion, the
// gathered copy, the holdings) and asks the home the rest, so it has no
// branch on where a shard lives, and a new home (say memory on a CPU-less
// NUMA node) is a new ParamHome decided by StatePlacement, its line in the
// memory plan and one new class here. A layer kept whole is not a shard: it
// has no home object (ParameterGathering lends its full copy).
//
// Threads, as for the optimizer state's pieces (Note [Piece leases] in
// state_tier.h): the driving thread calls everything but update_slot and
// write_back, which the optimizer thread calls for the layer it updates;
// the engine never writes a shard while a gather reads it (a gather waits
// for the shard's `ready`, the update for the layer's gathers' readers).
// NvmeShard's reads for a gather run on the shard reader thread, which is
// joined before any home is destroyed (ParameterGathering::stop_reader).
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine_context.h"
#include "param_swap.h"
#include "serial_worker.h"

namespace strata::offload::engine_detail {

// Writes a shard's values into the span it is given (every byte).
using ShardFill = std::function<void(std::span<std::byte>)>;

class ShardHome {
 public:
  virtual ~ShardHome() = default;
  virtual ParamHome home() const = 0;

  // Once, at set-up: the shard made where it lives from `fill`'s values
  // (Note [Shards made in place] in parameter_gathering.cpp).
  virtual Status create(const ShardFill& fill) = 0;
  // Outside the step (a load, a rollback's re-derived values): the shard's
  // new values from `fill`, made where they are written from; or a whole
  // shard's `values`, written as they are. Durable on return.
  virtual Status refill(const ShardFill& fill) = 0;
  virtual Status put(std::span<const std::byte> values) = 0;
  // The shard's values into `out` (shard bytes), blocking (off the step path).
  virtual Status read(std::span<std::byte> out) = 0;

  // Queues what brings this rank's pieces to the device for the all-gather
  // into `gathered` (the padded layout), after `ready` (the shard holds its
  // latest update), and gates the communicator's kGather queue behind it.
  // Every completion of work that writes `gathered` is added to `queued`.
  virtual Status stage_for_gather(std::byte* gathered, const Completion& ready, std::vector<Completion>& queued) = 0;
  // Where this rank's piece of group `g` is sent from in that all-gather.
  virtual const std::byte* gather_source(const SubGroup& g, std::byte* gathered) const = 0;

  // The shard's memory where it stays (device or pinned host), the host
  // optimizer's in-place target (UpdateStaging::kNone); null on NVMe, which
  // is only ever read into a slot.
  virtual std::byte* resident() = 0;

  // UpdateStaging::kParameterSlot (a shard on NVMe; the other homes refuse):
  // a slot to step the update into (blocks until one is free, bounded by
  // the pool's timeout), and the start of its write back from it; the slot
  // returns to the pool when the write ends, and the completion (ok when
  // durable) is what the next gather waits for.
  virtual Result<Slot> update_slot() = 0;
  virtual Result<Completion> write_back(Slot staging) = 0;
};

// Layer li's shard home as the placement says (a sharded layer; its buffer
// allocated, under the names the memory accounts and errors use). `swap`
// and `shard_reader` are the rank's NVMe parameter store and its reader
// thread: needed (and outliving the home) for kShardOnNvme, unused otherwise.
Result<std::unique_ptr<ShardHome>> make_shard_home(EngineContext& ctx, size_t li, ParamSwap* swap,
                                                   SerialWorker* shard_reader);

}  // namespace strata::offload::engine_detail
