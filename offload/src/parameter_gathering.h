#pragma once
// ParameterGathering: where each layer's 16-bit parameters live and how a
// pass gets them. Private to offload/src.
//
// Note [Parameter gathering]
// A layer kept whole (stages 0-2, stage-3 layers under the persistence
// threshold) lives on the device and is lent as it is; its update
// republishes it (stages 1-3: the owned pieces all-gathered on kUpdate). A
// stage-3 layer lives as this rank's shard (device, pinned host, or NVMe
// through ParamSwap and the shard reader thread: its ShardHome, Note [Shard
// homes] in shard_home.h) and is gathered into a
// device buffer for its uses, under stage3_max_live_parameters (LentBuffers).
// What to gather ahead along the recorded acquire order, keep on release
// and drop for room is PrefetchPolicy's (Note [Prefetch policy]); this
// class carries its decisions out. At world size 1 a device shard is the
// whole layer and is lent in place (acquired_in_place: its update waits for
// its last release, writable_after).
//
// Threads: the driving thread calls everything; the shard reader reads NVMe
// shards (recording a failed read in the context's StepFailures as kCall).
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "acquire_trace.h"
#include "engine_context.h"
#include "lent_buffers.h"
#include "param_swap.h"
#include "prefetch_policy.h"
#include "serial_worker.h"
#include "shard_home.h"

namespace strata::offload::engine_detail {

class ParameterGathering {
 public:
  struct LayerParams {
    DeviceBuffer full_params;  // kept whole: the layer on the device
    Completion params_ready;   // kept whole: its latest update republished
    std::unique_ptr<ShardHome> shard;  // stage 3: this rank's shard, where it lives (Note [Shard homes])
    Completion shard_ready;    // stage 3: the shard holds its latest update (NVMe: durable)
    DeviceBuffer gathered;     // stage 3: this layer gathered
    Completion gathered_ready;
    Completion last_use;       // the `done` of the latest release of the lent parameters
    Completion returned;       // the caller no longer reads the gathered copy (Engine::release's memory_returned)
    Status prefetch_failure;   // a prefetch of this layer failed: its next acquire returns it
  };
  // What a pass reads: the parameters, complete once `ready` completes;
  // `update_ready` is the update part of that wait (the exposed-wait probe).
  struct Lease {
    std::byte* params = nullptr;
    Completion ready;
    Completion update_ready;
  };
  // Where the driving thread is, for the keep-or-drop decision of a release.
  using PassPosition = PrefetchPolicy::PassPosition;

  explicit ParameterGathering(EngineContext& ctx) : ctx_(ctx) {}
  ~ParameterGathering();  // NVMe shard I/O done before the shards are freed

  // The live cap, the trace and (offload_param nvme) the swap store and its
  // reader, named for this run.
  Status init(const std::string& job_name);
  // Layer li's buffers, holding `padded` (the padded layout, its dtype), or
  // zeros where `padded` is null (no layer-sized host copy is made then).
  Status init_layer(size_t li, const std::byte* padded);

  AcquireTrace& trace() { return *trace_; }
  const AcquireTrace& trace() const { return *trace_; }
  const LayerParams& layer(size_t li) const { return layers_[li]; }
  // The layers set up so far (0 until init; fewer when the engine's init failed part-way).
  size_t layer_count() const { return layers_.size(); }
  bool held(size_t li) const { return holdings_[li].held > 0; }
  int holds(size_t li) const { return holdings_[li].held; }  // passes holding layer li

  // A pass's acquire: gathers on demand (and prefetches, following the trace).
  Result<Lease> acquire(size_t li, Pass pass, bool training);
  // `returned`: when the caller stops reading the memory (its views may
  // outlive the release); a gathered copy is freed only after it.
  Status release(size_t li, const Completion& done, const PassPosition& at, const Completion& returned = {});
  // Every layer a pass still holds is released, its last use `done` (an
  // abandoned step: the caller's passes are over).
  Status release_every_held(const Completion& done);
  // Drops every gathered copy no pass holds (end of a step's last backward,
  // end of an evaluation); each is freed after its last reader.
  Status drop_unheld();
  // Waits until every dropped copy is freed (the memory plan counts one set).
  Status drain() { return live_->drain(); }
  // The failed prefetch of a layer no pass acquired after it, if any.
  Status take_unclaimed_prefetch_failure();

  // Where rank piece (g, r)'s parameters live on this rank (device or host
  // pointer; a stage-3 rank holds only its own pieces).
  std::byte* param_location(size_t li, const SubGroup& g, int r);
  // What the layer's update may overwrite after: `reduced` (its gradient's
  // readers), and for a layer lent in place its last release too.
  Completion writable_after(size_t li, const Completion& reduced);
  // Note [Update staging]: one of the parameter slots, lent to layer li's
  // update (an NVMe shard) to step into; blocks until one is free (bounded
  // by the slot pool's timeout). Called on the optimizer thread.
  Result<Slot> update_slot(size_t li);
  // Starts writing the NVMe shard's updated values (in `staging`, shard
  // layout) back; the slot returns to the pool when the write ends, and the
  // returned completion (ok when durable) is what the next gather waits for.
  Result<Completion> write_back(size_t li, Slot staging);
  // The layer's update (absorbed: completes ok) is in place: a whole layer's
  // owned pieces are all-gathered behind it (stages 1-3), a shard is ready.
  Status publish_update(size_t li, const Completion& updated);
  // The completion a layer's current parameters wait on.
  const Completion& ready(size_t li) const {
    return ctx_.where(li).persistent() ? layers_[li].params_ready : layers_[li].shard_ready;
  }

  // Writes outside the step (initial values, a load, a rollback):
  // the whole layer from its padded values; this rank's shard from its
  // values (shard layout), durable on return, any gathered copy dropped.
  Status write_whole(size_t li, std::span<const std::byte> padded);
  Status write_whole_piece(size_t li, const SubGroup& g, int r, const std::byte* values, size_t count);
  Status replace_shard(size_t li, std::span<const std::byte> values);
  // The same from the layer's values (padded or not): this rank's pieces
  // cut straight into where the shard is written from.
  Status replace_shard_from_layer(size_t li, std::span<const std::byte> values);
  // A whole layer's owned pieces, rewritten by write_whole_piece, gathered
  // back on every rank (stages 1-3, world > 1) and waited for.
  Status regather_whole(size_t li);
  // This rank's pieces of layer li into `shard` (shard layout, every byte
  // written), from the layer's values (padded or not: bytes past `values`
  // are the padding's zeros).
  void cut_own_pieces(size_t li, std::span<const std::byte> values, std::span<std::byte> shard) const;
  // This rank's shard of layer li as fp32 (a whole layer's own pieces).
  Result<std::vector<float>> shard_fp32(size_t li);

  // Teardown: the shard reader's queued reads ended (they record failures in
  // the context and read into slots of the swap store).
  void stop_reader();

 private:
  Status make_param_swap(const std::string& job_name);
  // On failure the buffer goes back to the live count once what was queued
  // against it completed; `allocated` (when given) says whether it got that far.
  Status issue_gather(size_t li, bool* allocated = nullptr);
  Status queue_gather(size_t li, std::vector<Completion>& queued);  // issue_gather's work after the allocation
  Status make_room_for_gather(size_t li);
  void prefetch_after_acquire(bool training);
  Status drop_gathered(size_t li, const Completion& done);
  // A persistent layer's owned pieces all-gathered into its full copy (on
  // kUpdate, after what that queue waits for); the last gather's completion.
  Result<Completion> gather_persistent(size_t li);
  // Drops a gathered copy, runs `write` (the shard's new values), marks the shard ready.
  Status replace_shard_with(size_t li, const std::function<Status()>& write);
  size_t element_bytes(size_t li) const { return ctx_.where(li).param_element_bytes; }

  EngineContext& ctx_;
  std::vector<LayerParams> layers_;
  // The acquire sequence of a training micro-batch (Note [Acquire order]).
  std::optional<AcquireTrace> trace_;
  // What to gather ahead, keep and drop (Note [Prefetch policy]), and what
  // it reads of each layer: a valid gathered copy, the passes holding it.
  std::optional<PrefetchPolicy> policy_;
  std::vector<PrefetchPolicy::Holding> holdings_;
  // Gathered layers: device buffers under stage3_max_live_parameters, freed
  // once their users are done (Note [Lent buffers]).
  std::optional<LentBuffers> live_;
  // offload_param nvme; after `layers_`, so it closes (its writes from the
  // update's staging buffers done) before the buffers are freed.
  std::unique_ptr<ParamSwap> swap_;
  // Reads NVMe parameter shards (after their write-back) into place for the
  // gathers; after swap_: its thread is joined before the swap closes.
  std::unique_ptr<SerialWorker> shard_reader_;
};

}  // namespace strata::offload::engine_detail
