#pragma once
// SwapStore: a rank's tensors on NVMe, in one preallocated file per
// nvme_path, striped over the paths, with a checksum per extent.
//
//   <nvme_path>/strata-<job>/rank<R>/swap.bin   (0600, fallocate'd)
//   <nvme_path>/strata-<job>/rank<R>/lock       (flock; see swap_dir.h)
//
// Each file starts with an index region (header + entry table; the table is
// authoritative in the first path's file), followed by data. Data addresses
// are a striped space: stripe k lives in file k % paths at data offset
// (k / paths) * stripe_bytes, so one large tensor reads from every drive.
// Tensors get extents from a first-fit allocator with coalescing, keyed by
// stable ids chosen by the caller (names do not change between runs).
//
// Every write computes an XXH3-64 checksum of the caller's bytes while the
// write is in flight; every read is checked against it when waited on. A
// mismatch is a DataLoss status naming the tensor, its extent and both
// checksums. Verification can be switched off (the checksum is still kept).
//
// Lifetime: open() checks space on every path before creating anything,
// close() removes the files (clean shutdown) unless keep_files is set, in
// which case the index is written and a later open with open_existing
// rebuilds the store and can verify every extent.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/core/status.h"
#include "strata/nvme/extent_allocator.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_dir.h"

namespace strata::nvme {

using TensorId = uint64_t;

struct SwapStoreOptions {
  std::vector<std::string> paths;       // nvme_path(s): one swap file each
  std::string job = "default";          // folder strata-<job>
  int rank = 0;
  uint64_t capacity_bytes = 0;          // data bytes for this rank, over all paths
  uint64_t stripe_bytes = 1u << 20;     // striping unit across paths
  uint64_t index_bytes = 1u << 20;      // header + entry table at the start of each file
  bool verify_checksums = true;         // check reads against the stored checksum
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
  uint64_t verify_failures = 0;
};

namespace detail {
struct SwapOpState;
// Counters shared with in-flight handles, so a handle waited on after the
// store is gone stays safe.
struct SwapCounters {
  std::atomic<uint64_t> bytes_written{0}, bytes_read{0}, checksum_ns{0}, verify_failures{0};
  std::vector<std::string> file_paths;  // set once at open, for error messages
};
}

// Completion of one tensor read or write. wait() on a read also verifies it.
class SwapHandle {
 public:
  SwapHandle() = default;
  explicit SwapHandle(std::shared_ptr<detail::SwapOpState> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  bool done() const;  // the I/O finished (verification happens in wait)
  Status wait();

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

  // Writes `bytes` from `data` as tensor `id` (allocating or reusing its
  // extent). `data` must stay untouched until the handle is done.
  Result<SwapHandle> write(TensorId id, const void* data, uint64_t bytes);
  // Reads tensor `id` into `data`; `bytes` must equal the stored size.
  Result<SwapHandle> read(TensorId id, void* data, uint64_t bytes);
  Status write_sync(TensorId id, const void* data, uint64_t bytes);
  Status read_sync(TensorId id, void* data, uint64_t bytes);
  // Frees the tensor's extent.
  Status remove(TensorId id);

  bool contains(TensorId id) const;
  Result<uint64_t> size_of(TensorId id) const;
  Result<Extent> extent_of(TensorId id) const;  // in the striped data space
  std::vector<TensorId> ids() const;

  // Reads every tensor back and checks its checksum; the first mismatch is returned.
  Status verify_all();
  // Writes the index (header + entry table) to disk.
  Status flush();
  // Clean shutdown: removes the files, or (keep_files) flushes the index and
  // marks the folders kept. Fails while operations are in flight.
  Status close();

  SwapStats stats() const;
  const SwapStoreOptions& options() const { return options_; }
  std::vector<std::string> file_paths() const;

 private:
  struct Entry {
    TensorId id = 0;
    Extent extent;
    uint64_t bytes = 0;
    uint64_t checksum = 0;
    bool valid = false;     // a completed write's bytes are on disk
    uint32_t pending = 0;   // operations in flight
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
  std::vector<IoSegment> segments_for(const Extent& extent, uint64_t bytes, void* data) const;
  void finish_op(TensorId id, bool write_ok, uint64_t checksum, bool is_write);

  friend struct detail::SwapOpState;

  SwapStoreOptions options_;
  IoEngine& engine_;
  std::vector<PathFile> files_;
  uint64_t data_bytes_per_file_ = 0;
  uint64_t granularity_ = 4096;
  uint64_t generation_ = 0;
  bool closed_ = false;

  mutable std::mutex mu_;
  std::unordered_map<TensorId, Entry> entries_;
  std::unique_ptr<ExtentAllocator> allocator_;
  std::atomic<int64_t> pending_ops_{0};

  std::shared_ptr<detail::SwapCounters> counters_ = std::make_shared<detail::SwapCounters>();
};

}  // namespace strata::nvme
