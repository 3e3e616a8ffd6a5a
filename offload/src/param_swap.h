#pragma once
// Stage-3 parameter shards on NVMe (offload_param.device "nvme"): each
// non-cached layer's shard (this rank's pieces, the declared 16-bit or fp32
// dtype) is one checksummed SwapStore tensor; a gather reads it into one of
// `buffer_count` pinned slots, copies it H2D and returns the slot when the
// copy is done; the optimizer's update is stepped into a slot too and
// written back from it (a shadow write: an I/O error leaves the previous
// shard).
// Private to the engine.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/config.h"
#include "strata/core/device.h"
#include "strata/core/memory_stats.h"
#include "strata/core/slot_pool.h"
#include "strata/core/status.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_store.h"

namespace strata::offload {

struct ParamSwapOptions {
  std::string path;            // offload_param.nvme_path
  std::string job;             // swap folder strata-<job>
  int rank = 0;
  size_t buffer_count = 5;     // offload_param.buffer_count
  uint64_t slot_bytes = 0;     // >= the largest shard (offload_param.buffer_size elements)
  uint64_t capacity_bytes = 0; // every shard
  AioConfig aio;
  bool verify_checksums = true;
  // Test hook: this engine (must outlive the swap) instead of one from `aio`.
  nvme::IoEngine* io_engine = nullptr;
};

class ParamSwap {
 public:
  static Result<std::unique_ptr<ParamSwap>> create(const ParamSwapOptions& options, Device& device,
                                                   MemoryStats& stats);
  ~ParamSwap();
  ParamSwap(const ParamSwap&) = delete;
  ParamSwap& operator=(const ParamSwap&) = delete;

  // The initial shard, `fill`ed into a slot (`bytes` of it) and written
  // synchronously from there (start-up).
  Status put(uint32_t layer, uint64_t bytes, const std::string& name, const std::function<void(std::span<std::byte>)>& fill);
  // Starts reading layer's shard into a slot; `done` completes when it is there.
  struct Read {
    Slot slot;
    Completion done;
  };
  Result<Read> read(uint32_t layer, uint64_t bytes, const std::string& name);
  // A free slot for the caller to fill (an update's staging, Note [Update
  // staging] in state_placement.h); blocks up to the pool's timeout.
  Result<Slot> staging_slot(const std::string& holder) { return pool_->acquire(holder); }
  // Starts writing `data` (bytes) as layer's shard; completes when durable
  // and the index names the new version.
  Result<Completion> write(uint32_t layer, const void* data, uint64_t bytes, const std::string& name);
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t bytes_written() const { return bytes_written_; }
  std::string describe() const { return description_; }

 private:
  ParamSwap(Device& device, MemoryStats& stats) : device_(device), stats_(stats) {}
  Device& device_;
  MemoryStats& stats_;
  std::unique_ptr<nvme::IoEngine> owned_engine_;
  nvme::IoEngine* engine_ = nullptr;
  bool registered_ = false;
  std::unique_ptr<SlotPool> pool_;
  std::unique_ptr<nvme::SwapStore> store_;
  uint64_t nvme_bytes_ = 0;
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0};
  std::string description_;
};

}  // namespace strata::offload
