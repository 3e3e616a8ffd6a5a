#pragma once
// Internal: the state of one swap read or write, shared by the caller's
// SwapHandle, the engine callbacks and the verify tasks. See
// Note [Swap operation lifecycle] in swap_ops.cpp.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "strata/core/completion.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/swap_store.h"

namespace strata::nvme::detail {

struct SwapOpState {
  uint64_t serial = 0;
  TensorId id = 0;
  bool is_write = false;
  bool whole = false;        // the whole tensor (a whole write may change its size)
  bool verify = true;        // reads: check blocks; writes: read back before the flip
  uint64_t offset = 0;       // tensor bytes [offset, +length)
  uint64_t length = 0;
  std::byte* data = nullptr; // the caller's buffer (read: destination, write: source)
  std::vector<SwapRun> runs; // reads: where the range lives (snapshot)
  Extent fresh;              // writes: the shadow extent
  // Per block of the range: reads, the stored checksums; writes, the
  // checksums of the caller's bytes (filled by the hashing tasks).
  std::vector<uint64_t> sums;
  uint64_t table_delta = 0;  // writes: index growth reserved for the flip

  std::shared_ptr<SwapCounters> counters;
  std::atomic<int64_t> remaining{0};

  std::mutex mu;
  Status io_status;                  // first I/O error
  std::vector<Status> chunk_status;  // verification result per chunk (first by position wins)

  // Writes: per chunk, the two things that must arrive before it can be
  // read back (its write request and its hashing task).
  std::unique_ptr<std::atomic<int>[]> chunk_left;
  // verify_writes read-back: up to kReadBackDepth chunk-sized scratch
  // buffers per write; chunks that are written and hashed wait in `ready`
  // for one (guarded by mu).
  std::vector<AlignedBuffer> scratch;
  std::vector<size_t> scratch_free;
  std::vector<size_t> ready;

  CompletionSource source;
  Completion completion;  // source's, kept: a completed source hands out no more

  void record_io(const Status& st) {
    if (st.ok()) return;
    std::lock_guard<std::mutex> lock(mu);
    if (io_status.ok()) io_status = st;
  }
  std::string what() const {
    return whole ? fmt::format("tensor {} ({} bytes)", id, length)
                 : fmt::format("tensor {} range [{}, +{})", id, offset, length);
  }
};

}  // namespace strata::nvme::detail
