#pragma once
// The NVMe tier of optimizer state (offload_optimizer.device "nvme"): every
// piece's fp32 master weights and moments live in a SwapStore (one
// checksummed extent per piece) and are streamed through `buffer_count`
// pinned slots.
//
//   auto tier = make_nvme_state_tier(options, device, stats);
//   tier->add(id, name, count, master);   // per piece: written through a slot
//   tier->flush();                        // initial writes done (errors here)
//   for each step, pieces in order: s = tier->open(id); step s; tier->close(id, true);
//
// Note [NVMe piece layout]
// A piece is one extent, [master | exp_avg | exp_avg_sq], each part padded
// to kNvmeStateAlign bytes (the master only when the piece has one), so
// every part starts 4 KiB-aligned in its slot (SIMD-friendly) and the whole
// extent is O_DIRECT-sized. nvme_piece_bytes() gives its size; a slot must
// hold the largest piece.
//
// Note [NVMe tier pipeline]
// Slots are held by open pieces, by reads started ahead (pipeline_read) and
// by write-backs in flight (pipeline_write: close() starts the shadow write
// and the slot returns to the pool when it completes). With pipeline_read,
// every open()/close()/prefetch()/flush()/rollback() tops up reads of the
// next pieces of the order (set_order, else the order of add(), cyclically:
// after the last piece come the first ones of the next step), at most
// buffer_count pieces ahead, only into free slots, and never past a piece
// whose write-back is still in flight. open() of a piece already being read
// just waits for it; any other piece is read on demand: into a free slot,
// else after a write-back frees one, else by dropping the read-ahead piece
// farthest in the order. So buffer_count >= 3 reads piece i+1 while i is
// stepped and i-1 written; 1 works, without overlap. Reads start only from
// calls (no thread of its own). A piece with a pending version (below) is
// not read ahead until keep_pending() says which version is the newest; it
// keeps its place in the window. Without early updates the engine opens
// pieces in the order of add() (layer, sub-group, rank: the order it steps
// them) and sets no order; with them it sets the walks of Note [Read-ahead
// at the step's end] (docs/engine.md). The next step's first pieces, whose
// write-backs were started early in this step, are read ahead by the first
// call after those writes are done: the last close() of the step when they
// finished by then, else the flush() at the commit point (engine.h, Note
// [Atomic steps]), which waits for every write-back: in the next step, just
// before its updates are queued (with overlap off, at the end of the step).
//
// Note [Piece versions]
// Every piece has two versions in the store (two tensors): the committed
// one (the state after the last committed step) and, once close(modified)
// has written the piece, a pending one. open() and read-ahead read the
// newest; a write-back never goes over the committed version (the first of
// a step goes to the other one, a second one of the same step over the
// pending one). commit() waits for the write-backs and makes every pending
// version the committed one; rollback() drops the pending ones (and any
// read-ahead of them), so a step that fails half-way leaves the state of
// the last committed step readable (Note [Atomic steps] in engine.h). The
// cost is NVMe space: two versions of the state, counted as kNvme bytes
// when the second is first written; the swap file is preallocated for
// three (two versions and one for pieces of uneven sizes) plus the slots.
//
// With pending_versions (early updates, Note [Early, exact updates] in
// docs/engine.md) a piece has a third version: the early update of the
// next step reads the newest version into its slot, steps it there and
// close_pending() writes it as the piece's *pending* version, beside the
// committed one (the step before, still needed if that step is rolled back)
// and the newest (that step's, not committed yet). keep_pending() makes it
// the newest once the step keeps the update; a redo, a skip or a rollback
// forgets it. A failed pending write is no lost step: pending_written()
// reports it and the update is redone. The swap file then holds four
// versions' worth.
//
// Note [NVMe tier errors]
//  - A read's I/O error names the file, offset and length (IoEngine), the
//    piece (the name given to add()) and the tensor; a checksum mismatch is
//    DataLoss naming the piece and block. EAGAIN, EINTR and short transfers
//    are retried inside the IoEngine and never seen here.
//  - Writes are SwapStore shadow writes: a failed write-back leaves the
//    previous version readable; the failure (naming file, offset and piece)
//    is returned by close() when synchronous, else by the next
//    add/open/close/flush call, once. A failed initial write (add) leaves
//    the piece without state: its open() fails with that error.
//  - Calls are serialized by a mutex: the engine calls from its optimizer
//    thread (updates, checkpoint snapshots) and its driving thread (commit,
//    rollback, gather_state(), re-derived parameters), sometimes at once. A
//    piece is lent to one thread at a time (Note [Piece leases] in
//    state_tier.h): open() of a piece another thread holds open waits for
//    its close(), and so do a demand read whose slots are all held by other
//    threads' open pieces and rollback(). bytes(), io_stats() and
//    rollbacks() never wait: they read counters published at the end of
//    every other call, so the driving thread can report a step while the
//    optimizer thread waits in open().
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"
#include "strata/offload/state_tier.h"

namespace strata::offload {

inline constexpr uint64_t kNvmeStateAlign = 4096;

// Bytes of one piece on NVMe and in a slot (Note [NVMe piece layout]); 0 for
// an empty piece (it takes no slot and no extent).
uint64_t nvme_piece_bytes(size_t count, bool has_master, const cpu_adam::MomentStorage& moments);

struct NvmeStateTierOptions {
  std::vector<std::string> nvme_paths;  // offload_optimizer.nvme_path (several paths stripe)
  // The run: the swap folder is <nvme_path>/strata-<job>/rank<rank>/ (swap_dir.h:
  // locked while the tier lives, removed by its destructor, refused while
  // another live process holds it, never reached through a symbolic link).
  std::string job;
  int rank = 0;
  // Bytes of state to be added (the sum of nvme_piece_bytes over the pieces);
  // the swap file holds three times that (four with pending_versions; Note [Piece versions]) and
  // (buffer_count + 1) slots of shadow space; free space on the paths is
  // checked up front.
  uint64_t capacity_bytes = 0;
  AioConfig aio;                 // the config's aio section (engine chosen as `strata report` says)
  size_t buffer_count = 4;       // offload_optimizer.buffer_count: pinned slots
  uint64_t slot_bytes = 0;       // per slot, >= nvme_piece_bytes of the largest piece (rounded up to 4 KiB)
  cpu_adam::MomentStorage moments;  // strata.optimizer_state_dtype
  bool pipeline_read = true;     // offload_optimizer.pipeline_read
  bool pipeline_write = true;    // offload_optimizer.pipeline_write
  bool verify_checksums = true;  // check every read against the stored block checksums
  bool verify_writes = false;    // read each write back before it replaces the previous version
  // strata.wait_timeout_s: flush(), commit() and rollback() wait at most this
  // long for each write-back in flight, then fail with DeadlineExceeded
  // naming the piece (the write stays in flight); 0: unbounded.
  double wait_timeout_s = 0;
  // Pieces may hold a third, pending version (Note [Piece versions]):
  // add_pending() is accepted and the swap file sized for it.
  bool pending_versions = false;
};

// The tier. `device` pins the slots (and must outlive the tier); `stats`
// counts the slots as kPinnedHost from creation and each piece's extent as
// kNvme from its add(). Fails with InvalidArgument naming the option, or
// with the swap store's error (folder locked by a live run, not enough free
// space, a link in the folder).
Result<std::unique_ptr<OptimizerStateTier>> make_nvme_state_tier(const NvmeStateTierOptions& options, Device& device,
                                                                 MemoryStats& stats);

}  // namespace strata::offload
