#pragma once
// Where a rank's optimizer state lives: the fp32 master weights (for 16-bit
// parameters) and the moments of every piece it steps (partition.h).
//
// The engine never touches optimizer state except through open/close of
// one piece at a time, so a tier may keep it in device memory, in pinned
// host memory (offload_optimizer cpu) or, in the next tier, on NVMe behind a
// few pinned slots (open = read into a slot, close(modified) = write back).
//
// Note [Piece leases]
// Two threads of the engine open pieces: the optimizer thread (updates, and
// checkpoint snapshots queued behind them) and the driving thread
// (gather_state(), the re-derivation of a rollback), possibly at once right
// after save_checkpoint(). The NVMe tier holds an open piece in one slot, so
// it lends a piece to one thread at a time: open() of a piece another
// thread holds open waits for that thread's close(), a demand read with
// every slot held by another thread's open pieces waits for one of them,
// and rollback() waits until no other thread holds a piece. Opening a piece
// the calling thread already holds open is a bug (a check). A wait longer
// than kPieceOpenWait fails with DeadlineExceeded naming the piece. The
// memory tiers hand every caller the state in place: two readers are fine,
// and the engine never writes a piece while another thread reads it (the
// updates and the snapshots run in order on the optimizer thread; the
// driving thread reads once the updates are done).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"
#include "strata/cpu_adam/moment_storage.h"
#include "strata/offload/partition.h"

namespace strata::offload {

struct PieceState {
  size_t count = 0;
  float* master = nullptr;  // null when the piece has no master (fp32 params stepped in place)
  void* exp_avg = nullptr;     // moments.moment_bytes(count) bytes each
  void* exp_avg_sq = nullptr;
  cpu_adam::MomentStorage moments;
};

// Bytes of one piece in a memory tier: both moments, then the master, each
// section starting on 64 bytes.
uint64_t memory_piece_bytes(size_t count, bool has_master, const cpu_adam::MomentStorage& moments);

// What a tier that moves state (NVMe) has moved so far; all zero for the
// memory tiers. The engine reports per-step NVMe GB/s from the differences.
struct StateTierIoStats {
  uint64_t bytes_read = 0;      // state read into slots (completed reads)
  uint64_t bytes_written = 0;   // state written back (completed writes, initial state included)
  uint64_t reads = 0, writes = 0;
  uint64_t read_wait_ns = 0;    // time open() waited for its piece's read
  uint64_t write_wait_ns = 0;   // time spent waiting for write-backs (synchronous close, flush, re-open)
  uint64_t prefetched_opens = 0;  // opens whose read had been started ahead (pipeline_read)
  // Reads started ahead and given up before an open used them (a new walk
  // order, a kept pending version, a rollback, a slot a demand read needed):
  // NVMe bytes read for nothing.
  uint64_t read_ahead_dropped = 0;
  size_t slots = 0;             // pinned slots (buffer_count)
  size_t peak_slots_in_use = 0; // never above `slots`
};

// How long the NVMe tier's open() and rollback() wait for a piece another
// thread holds open (Note [Piece leases]): a snapshot's copy of a piece
// takes milliseconds; this long means that thread is stuck.
inline constexpr std::chrono::seconds kPieceOpenWait{300};

class OptimizerStateTier {
 public:
  virtual ~OptimizerStateTier() = default;
  virtual Tier tier() const = 0;
  // "device memory", "pinned host memory"
  virtual std::string describe() const = 0;
  // Allocates piece `id` (count elements): moments zeroed, master from
  // `master_init` (count values) or none when it is empty. OutOfMemory names
  // the piece (`name`) and the tier.
  virtual Status add(const StateId& id, const std::string& name, size_t count, std::span<const float> master_init) = 0;
  // The piece's state, valid until close() (Note [Piece leases]: which
  // threads may hold it at once).
  virtual Result<PieceState> open(const StateId& id) = 0;
  virtual Status close(const StateId& id, bool modified) = 0;
  // Bytes of state held in this tier.
  virtual uint64_t bytes() const = 0;

  // Optional, for tiers that stream state through a few buffers (NVMe);
  // the memory tiers ignore them (defaults below).
  //
  // The order in which open() will be asked for pieces, repeated step after
  // step (every piece at most once; pieces not listed are read on demand).
  // Without it a tier assumes the order of add().
  virtual void set_order(std::span<const StateId> order) { (void)order; }
  // Hint: `id` is the next piece open() will be asked for; reading may start
  // now (e.g. at the start of a step, or before an out-of-order walk). The
  // NVMe tier continues its read-ahead from `id` in the order.
  virtual void prefetch(const StateId& id) { (void)id; }
  // Waits for every write started by add() or close(); returns the first
  // write failure not reported yet (a tier reports each failure once, from
  // the next add/open/close/flush). Call it after the last add() and at the
  // end of a step whose state must be durable (checkpoint, end of training).
  virtual Status flush() { return Status::Ok(); }
  virtual StateTierIoStats io_stats() const { return {}; }

  // Step atomicity (Note [Atomic steps] in engine.h). A versioned tier keeps
  // the state of the last committed step beside what close(modified) wrote
  // since: open() reads the newest version, commit() makes it the committed
  // one, rollback() forgets it, so a step that failed half-way leaves the
  // committed state whole. The memory tiers update in place (not versioned):
  // commit() only flushes and rollback() is refused.
  virtual bool versioned() const { return false; }
  // Waits for every write-back; on success the newest version of every piece
  // becomes the committed one. A failed write-back is returned (once) and
  // nothing is committed; after one (reported here or earlier) commit()
  // refuses until rollback().
  virtual Status commit() { return flush(); }
  // Ok when commit() would commit (after flush()): not after a lost
  // write-back, whoever it was reported to.
  virtual Status committable() const { return Status::Ok(); }
  // Every piece back to its committed version (writes and read-ahead since
  // are waited for and dropped, their errors with them). No piece may be open
  // on the calling thread; pieces open on other threads are waited for.
  virtual Status rollback() { return Unsupported(describe() + " updates state in place and cannot roll a step back"); }
  // Rollbacks so far: a reader that must see one step's state (a checkpoint
  // snapshot) checks that none happened while it read.
  virtual uint64_t rollbacks() const { return 0; }

  // Note [Pending versions in memory]
  // For updates that may be undone (Note [Early, exact updates] in
  // docs/engine.md), the pinned host tier keeps a second buffer per piece
  // once add_pending() gave it one: an update that reads open()'s state and
  // writes the new state out of place into open_pending()'s buffer
  // (cpu_adam's StateSpans::*_source) leaves the piece's state whole; then
  // keep_pending() makes the pending buffer the piece's state (the old one
  // becomes the next pending buffer: a pointer swap, no copy), or nothing is
  // done and the pending values are simply overwritten next time. The
  // pending buffer holds no state until written; the caller keeps a piece
  // only when its update wrote all of it. The device tier refuses.
  //
  // A versioned tier (NVMe, with NvmeStateTierOptions::pending_versions)
  // keeps the pending state as a version of its own (Note [Piece versions]
  // in nvme_state_tier.h): the update steps open()'s slot in place and
  // close_pending() writes it as the pending version (open_pending() is
  // not used); pending_written() says whether that write ended whole, and
  // drop_pending() forgets it.
  virtual Status add_pending(const StateId& id) {
    (void)id;
    return Unsupported(describe() + " keeps no pending versions of its pieces");
  }
  virtual Result<PieceState> open_pending(const StateId& id) {
    (void)id;
    return Unsupported(describe() + " keeps no pending versions of its pieces");
  }
  // From the thread that drives the updates, while no update of the piece
  // runs (the swap is not synchronized with open()).
  virtual Status keep_pending(const StateId& id) {
    (void)id;
    return Unsupported(describe() + " keeps no pending versions of its pieces");
  }
  // The update of an open piece written out of place ends: the memory tiers
  // hold it in the pending buffer already (the piece closes unmodified); a
  // versioned tier writes the piece as its pending version.
  virtual Status close_pending(const StateId& id) { return close(id, /*modified=*/false); }
  // Waits for the pending version's write, if any; an error names a lost
  // one (the caller redoes the update instead of keeping it). The memory
  // tiers' pending buffers are written by the kernel itself: always Ok.
  virtual Status pending_written(const StateId& id) {
    (void)id;
    return Status::Ok();
  }
  // The pending version is forgotten (its update is redone or undone). The
  // memory tiers overwrite it next time: nothing to do.
  virtual Status drop_pending(const StateId& id) {
    (void)id;
    return Status::Ok();
  }
};

// Device memory of `device` (kDevice; needs a host-addressable device, since
// the CPU kernels step it) or pinned host memory from `device` (kPinnedHost).
// Either is also counted in `host_stats` (the engine's own stats, by tier).
// `device_kernels`: the caller steps the state with device kernels (a cuda
// device, docs/device-adam.md), so device memory need not be host-addressable;
// they have no int8 moments.
Result<std::unique_ptr<OptimizerStateTier>> make_memory_state_tier(Device& device, Tier tier,
                                                                   const cpu_adam::MomentStorage& moments,
                                                                   MemoryStats& host_stats,
                                                                   bool device_kernels = false);

}  // namespace strata::offload
