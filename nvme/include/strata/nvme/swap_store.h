#pragma once
// SwapStore: a rank's tensors on NVMe, in one preallocated file per
// nvme_path, striped over the paths, checksummed per block, written by
// shadow writes.
//
//   <nvme_path>/strata-<job>/rank<R>/swap.bin   (0600, fallocate'd)
//   <nvme_path>/strata-<job>/rank<R>/lock       (flock; see swap_dir.h)
//
// Each file starts with an index region (header + tensor table; the table is
// authoritative in the first path's file), followed by data. Data addresses
// are a striped space: stripe k lives in file k % paths at data offset
// (k / paths) * stripe_bytes, so one large tensor reads from every drive.
// A tensor is a list of runs (tensor bytes -> data address); a whole write
// makes one run, range writes may split it. Space comes from a first-fit
// allocator with coalescing, keyed by stable ids chosen by the caller.
//
// Note [Swap completion rules] (see docs/nvme.md)
//  - Every read and write returns a SwapHandle whose completion() is a
//    strata::Completion: it completes once, with ok or the operation's
//    error, and only after checksum verification. Errors name the tensor,
//    the byte range, the file and offset (I/O) or the block, extent and
//    both checksums (DataLoss).
//  - Checksums: one XXH3-64 per checksum block (checksum_block_bytes of the
//    tensor, the last one shorter). They are computed and checked on the
//    store's verify threads, never on the thread that waits and never on an
//    I/O engine worker. A read completes DataLoss or ok after its blocks
//    were checked (unless verify_checksums is off).
//  - Shadow writes: a write (whole or range) goes to a fresh extent; the
//    tensor's index entry flips to it only after the write completed and,
//    with verify_writes, was read back and matched the checksums of the
//    caller's bytes. A failed or torn write leaves the previous version
//    intact and readable; the fresh extent is freed. Data replaced by a flip
//    is freed at once and reused by later writes. Capacity must therefore
//    hold the stored tensors plus one shadow extent per in-flight write.
//  - Range I/O (read_range / write_range) addresses part of a stored tensor
//    (a sub-group tile). The offset must be a multiple of
//    checksum_block_bytes and the length too, unless the range ends at the
//    tensor's end (blocks are the unit of verification and copy-on-write).
//    Buffers need no alignment: pieces whose buffer, offset and length are
//    4 KiB-aligned go O_DIRECT, others go through the page cache.
//  - Concurrency: operations on different tensors, and reads of the same
//    bytes, may be in flight together; a write may not overlap any other
//    in-flight operation on the same tensor (FailedPrecondition naming
//    both ranges). Callbacks (then) run on a verify thread or an engine
//    worker with no store lock held: they may start new swap operations,
//    but must not block waiting for one (the verify threads are few) and
//    must not destroy the store.
//
// Lifetime: open() checks space on every path before creating anything,
// close() removes the files (clean shutdown) unless keep_files is set, in
// which case the index is written and a later open with open_existing
// rebuilds the store and can verify every tensor. The index is versioned
// (format 2: per-block checksums and runs); an index of another format is
// refused with a clear error.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/status.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/extent_allocator.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_dir.h"

namespace strata::nvme {

class VerifyPool;
using TensorId = uint64_t;

struct SwapStoreOptions {
  std::vector<std::string> paths;       // nvme_path(s): one swap file each
  std::string job = "default";          // folder strata-<job>
  int rank = 0;
  uint64_t capacity_bytes = 0;          // data bytes for this rank, over all paths
  uint64_t stripe_bytes = 1u << 20;     // striping unit across paths
  uint64_t index_bytes = 0;             // header + tensor table at the start of each file;
                                        //   0: 1 MiB + 8 B per checksum block of capacity
  uint64_t checksum_block_bytes = 64u << 10;  // one XXH3 per block; unit of range I/O (4 KiB multiple)
  bool verify_checksums = true;         // check reads against the stored checksums
  bool verify_writes = true;            // read each write back and check it before the index flips
                                        //   (catches torn and lost writes; costs one read per write)
  uint32_t verify_threads = 2;          // checksum threads
  bool keep_files = false;              // close() keeps files and index for a later reopen
  bool open_existing = false;           // reopen kept files instead of creating new ones
  bool verify_on_open = true;           // with open_existing: read back and check every tensor

  Status validate() const;
};

struct SwapStats {
  uint64_t tensors = 0;
  uint64_t bytes_used = 0;          // reserved by extents
  uint64_t bytes_free = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t checksum_ns = 0;         // time spent hashing (writes and verified reads)
  uint64_t verify_failures = 0;     // reads whose blocks did not match
  uint64_t write_verify_failures = 0;  // writes whose read-back did not match (previous version kept)
  uint64_t flips = 0;               // writes that completed and replaced the previous version
  uint64_t bytes_read_back = 0;     // verify_writes read-back traffic
};

// Where a part of a tensor lives: tensor bytes [tensor_offset, +length) at
// data address data_offset (striped space; the reservation is length
// rounded up to the allocator's granularity).
struct SwapRun {
  uint64_t tensor_offset = 0;
  uint64_t length = 0;
  uint64_t data_offset = 0;
  bool operator==(const SwapRun&) const = default;
};

namespace detail {
struct SwapOpState;
// Counters shared with in-flight handles, so a handle waited on after the
// store is gone stays safe.
struct SwapCounters {
  std::atomic<uint64_t> bytes_written{0}, bytes_read{0}, checksum_ns{0}, verify_failures{0},
      write_verify_failures{0}, flips{0}, bytes_read_back{0};
};
}  // namespace detail

// Completion of one tensor read or write (Note [Swap completion rules]).
class SwapHandle {
 public:
  SwapHandle() = default;
  explicit SwapHandle(std::shared_ptr<detail::SwapOpState> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  // Completes after the I/O and its verification; a stream can wait on it
  // (Stream::wait(handle.completion())), host code can then() onto it.
  Completion completion() const;
  bool done() const { return completion().done(); }    // never blocks
  Status wait() const { return completion().wait(); }  // never hashes on this thread

 private:
  std::shared_ptr<detail::SwapOpState> state_;
};

class SwapStore {
 public:
  // Takes the folder locks, checks free space on every path, then creates
  // and preallocates the files (or reopens kept ones). `engine` must outlive
  // the store.
  static Result<std::unique_ptr<SwapStore>> open(const SwapStoreOptions& options, IoEngine& engine);
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Writes `bytes` from `data` as tensor `id` (a new tensor, or a new
  // version of the whole tensor, any size), to a fresh extent (shadow
  // write). `data` must stay untouched until the handle is done.
  Result<SwapHandle> write(TensorId id, const void* data, uint64_t bytes);
  // Reads tensor `id` into `data`; `bytes` must equal the stored size.
  Result<SwapHandle> read(TensorId id, void* data, uint64_t bytes);
  // Part of a stored tensor: bytes [offset, offset + size) (rules in Note
  // [Swap completion rules]); past the end is InvalidArgument naming the
  // tensor, offset, length and size. A range write is a shadow write of
  // its blocks (copy-on-write at block granularity).
  Result<SwapHandle> read_range(TensorId id, uint64_t offset, std::span<std::byte> dst);
  Result<SwapHandle> write_range(TensorId id, uint64_t offset, std::span<const std::byte> src);
  Status write_sync(TensorId id, const void* data, uint64_t bytes);
  Status read_sync(TensorId id, void* data, uint64_t bytes);
  // Frees the tensor's extent.
  Status remove(TensorId id);

  bool contains(TensorId id) const;
  Result<uint64_t> size_of(TensorId id) const;
  // In the striped data space; FailedPrecondition when range writes split
  // the tensor over several runs (use runs_of).
  Result<Extent> extent_of(TensorId id) const;
  Result<std::vector<SwapRun>> runs_of(TensorId id) const;
  uint64_t checksum_block_bytes() const { return block_; }
  std::vector<TensorId> ids() const;

  // Reads every tensor back and checks its checksum; the first mismatch is returned.
  Status verify_all();  // on the verify threads; blocks the caller until done
  // Writes the index (header + entry table) to disk.
  Status flush();
  // Clean shutdown: removes the files, or (keep_files) flushes the index and
  // marks the folders kept. Fails while operations are in flight.
  Status close();

  SwapStats stats() const;
  const SwapStoreOptions& options() const { return options_; }
  std::vector<std::string> file_paths() const;

 private:
  struct InFlight {
    uint64_t serial = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    bool is_write = false;
  };
  struct Entry {
    TensorId id = 0;
    uint64_t bytes = 0;
    std::vector<SwapRun> runs;     // tile [0, bytes) in order
    std::vector<uint64_t> sums;    // one per checksum block
    bool valid = false;            // a completed write's bytes are on disk
    std::vector<InFlight> inflight;
  };
  struct PathFile {
    std::string folder;
    std::string file_path;
    FileId file = 0;
    bool opened = false;  // `file` is open in the engine
    SwapFolderLock lock;
  };

  SwapStore(const SwapStoreOptions& options, IoEngine& engine);
  Status create_files();
  // Undoes a failed open: created files are removed, reopened ones kept.
  void abandon();
  Status reopen_files();
  Status write_headers(bool with_index);
  Status read_index();
  void set_block(uint64_t block);  // checksum block and the chunk derived from it
  std::string name() const;  // "swap store of job 'j' rank 0 (<folder>, ...)"
  uint64_t index_capacity() const;
  uint64_t record_bytes(const Entry& e) const;
  // I/O segments for `bytes` at data address `address`, striped over the files.
  std::vector<IoSegment> segments_for(const Extent& extent, uint64_t bytes, void* data) const;
  // Segments for tensor bytes [offset, +length) through `runs`.
  std::vector<IoSegment> segments_for_runs(const std::vector<SwapRun>& runs, uint64_t offset, uint64_t length,
                                           std::byte* data) const;
  // "<file> offset <n>" for a data address, for messages.
  std::string locate(uint64_t address) const;

  // The operation machinery (swap_ops.cpp).
  Result<SwapHandle> start_read(TensorId id, uint64_t offset, uint64_t length, std::byte* dst, bool whole,
                                bool verify);
  Result<SwapHandle> start_write(TensorId id, uint64_t offset, uint64_t length, const std::byte* src, bool whole);
  Status check_range(const char* what, const Entry& e, uint64_t offset, uint64_t length) const;
  Status check_overlap(const char* what, const Entry& e, uint64_t offset, uint64_t length, bool is_write) const;
  void io_done(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk, const Status& st);
  void verify_chunk(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk);
  void arrive(const std::shared_ptr<detail::SwapOpState>& op);
  void chunk_written(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk);
  void read_back(const std::shared_ptr<detail::SwapOpState>& op, size_t chunk, size_t slot);
  void release_scratch(const std::shared_ptr<detail::SwapOpState>& op, size_t slot);
  void finish(const std::shared_ptr<detail::SwapOpState>& op, Status status);
  // Replaces tensor bytes [offset, +length) of `e` by a run at `address`;
  // frees the replaced data. Called under mu_.
  void replace_runs(Entry& e, uint64_t offset, uint64_t length, uint64_t address);

  friend struct detail::SwapOpState;

  SwapStoreOptions options_;
  IoEngine& engine_;
  std::vector<PathFile> files_;
  uint64_t data_bytes_per_file_ = 0;
  uint64_t granularity_ = 4096;
  uint64_t block_ = 64u << 10;   // checksum block
  uint64_t chunk_ = 8u << 20;    // I/O and verification chunk, a multiple of block_
  uint64_t generation_ = 0;
  bool closed_ = false;

  mutable std::mutex mu_;
  std::unordered_map<TensorId, Entry> entries_;
  std::unique_ptr<ExtentAllocator> allocator_;
  uint64_t table_bytes_ = 0;        // on-disk bytes of the valid entries' records
  uint64_t table_reserved_ = 0;     // growth reserved by in-flight writes
  uint64_t next_serial_ = 1;
  std::atomic<int64_t> pending_ops_{0};

  std::shared_ptr<detail::SwapCounters> counters_ = std::make_shared<detail::SwapCounters>();
  std::mutex scratch_mu_;
  std::vector<AlignedBuffer> scratch_free_;  // verify_writes read-back buffers (chunk_ bytes each)
  std::unique_ptr<VerifyPool> pool_;  // last member: joined first, before the state it uses goes
};

}  // namespace strata::nvme
