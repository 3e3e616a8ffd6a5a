#pragma once
// CheckpointIO: the engine's checkpoints (engine.h: save_checkpoint,
// wait_checkpoint, load_checkpoint; the format in checkpoint.h). Private to
// offload/src. Note [Asynchronous save], Note [Snapshot slots and the host
// budget] and Note [Checkpoint atomicity] are in checkpoint_io.cpp.
//
// It owns the save in flight, the snapshot slots (kept between saves) and
// the writer thread; it reads and writes the state through the
// UpdateScheduler (optimizer state, on its thread for a snapshot) and
// ParameterGathering (a load's parameters). The step counters, data
// position and loss scaler are the orchestrator's: a save is handed them
// (CheckpointScalars), a load returns the manifest for the orchestrator to
// apply after the state was written.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine_context.h"
#include "parameter_gathering.h"
#include "serial_worker.h"
#include "strata/offload/checkpoint.h"
#include "strata/offload/loss_scaler.h"
#include "update_scheduler.h"

namespace strata::offload::engine_detail {

// The orchestrator's scalars a save records.
struct CheckpointScalarsNow {
  int64_t optimizer_steps = 0, steps_begun = 0;
  std::optional<uint64_t> data_position;
  LossScalerState scaler;
};

class CheckpointIO {
 public:
  CheckpointIO(EngineContext& ctx, ParameterGathering& params, UpdateScheduler& updates)
      : ctx_(ctx), params_(params), updates_(updates), opt(ctx.opt), faults(ctx.faults), model(ctx.model),
        device(ctx.device), comm(ctx.comm), part(ctx.part), stats(ctx.stats), rank(ctx.rank), world(ctx.world) {}
  ~CheckpointIO();  // the writer's thread joined first, before anything a save's task may use

  // `predicted`: the engine's memory plan (the snapshot slot size, the host budget).
  Result<CheckpointSaveInfo> save(const CheckpointSaveOptions& o, const CheckpointScalarsNow& now,
                                  const EngineMemory& predicted);
  Result<std::optional<CheckpointSaveDone>> wait_save();
  // Rank 0 stops waiting for its peers (teardown: a peer may have failed).
  void abandon_save();
  // Opens and checks a checkpoint against this model and optimizer; nothing
  // is written yet.
  Result<CheckpointReader> open_for_load(const std::string& given) const;
  // Writes the checkpoint's parameters and optimizer state into place (a
  // fresh engine) and commits the state.
  Status load_state(CheckpointReader& reader);

 private:
  struct SaveState;
  struct SnapshotSlots;
  struct SnapshotPiece;
  // The save's steps, in the order save() takes them.
  Status agree_snapshot_budget(const EngineMemory& predicted, const std::string& tag, size_t nslots,
                               uint64_t slot_bytes);
  Result<int64_t> agree_save_folder(const std::filesystem::path& dir, const std::string& tag,
                                    const std::string& shown);
  Result<std::shared_ptr<SaveState>> open_save(const CheckpointSaveOptions& o, const std::string& tag, int64_t run_id,
                                               Clock::time_point t0);
  CheckpointManifest save_manifest(const CheckpointSaveOptions& o, const std::string& tag,
                                   const CheckpointScalarsNow& now) const;
  std::vector<SnapshotPiece> lay_out_pieces(SaveState& s, uint64_t slot_bytes) const;
  Status prepare_snapshot_slots(size_t nslots, uint64_t slot_bytes);
  void queue_snapshots(const std::shared_ptr<SaveState>& s, const std::vector<SnapshotPiece>& pieces,
                       const std::string& needs);
  void snapshot_piece(const std::shared_ptr<SaveState>& s, const std::shared_ptr<SnapshotSlots>& slots,
                      const SnapshotPiece& p, size_t e, const std::string& needs);
  static void write_snapshot(SaveState& s, SnapshotSlots& slots, const SnapshotPiece& p, size_t e, size_t k,
                             const std::string& needs);
  void queue_save_end(const std::shared_ptr<SaveState>& s);
  void end_save(SaveState& s);
  Completion snapshot_gate(size_t li);
  Status finish_save(SaveState& s);
  Status prune_checkpoints(const std::filesystem::path& dir, int keep, const std::string& current);

  EngineContext& ctx_;
  ParameterGathering& params_;
  UpdateScheduler& updates_;
  // The context's facts the save and load read (names as in EngineContext).
  const EngineOptions& opt;
  const FaultHooks& faults;
  const LayeredModel& model;
  Device& device;
  comm::Communicator& comm;
  const Partition& part;
  MemoryStats& stats;
  const int rank, world;
  std::shared_ptr<SaveState> pending_save_;        // the save in flight
  std::shared_ptr<SnapshotSlots> snapshot_slots_;  // kept between saves
  std::unique_ptr<SerialWorker> writer_;           // last: its thread is joined first
};

}  // namespace strata::offload::engine_detail
