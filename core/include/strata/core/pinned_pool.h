#pragma once
// Pinned host memory pool. Buffers are pinned at their exact size (rounded
// only to the alignment, 4096 by default so they suit O_DIRECT; no
// power-of-two size classes), bounded by a host budget and, where pinning
// is mlock, by RLIMIT_MEMLOCK (unless the process holds CAP_IPC_LOCK, as
// the kernel does). When pinning is refused (budget, rlimit, or
// the pin call fails) the pool hands out pageable memory instead, warns
// ONCE, and records the tier of every buffer. Freed buffers are cached by
// exact size and reused, so steady-state training allocates nothing.
// Thread-safe.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "strata/core/memory_stats.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"

namespace strata {

class Device;
class PinnedPool;

enum class PinMethod : uint8_t {
  kRegister,  // aligned allocation, then pin in place (cudaHostRegister / mlock)
  kAllocate,  // the device allocates pinned memory (cudaHostAlloc / aligned + mlock)
};

struct PinnedPoolOptions {
  // Most bytes pinned at once, cached blocks included; 0 = no budget of our
  // own (the RLIMIT_MEMLOCK bound still applies where pinning is mlock and
  // the process lacks CAP_IPC_LOCK).
  uint64_t budget_bytes = 0;
  size_t alignment_bytes = 4096;      // power of two, >= 64
  PinMethod method = PinMethod::kRegister;
  bool allow_pageable_fallback = true;  // false: refusal is an OutOfMemory error
  bool cache_freed = true;              // keep freed blocks for reuse
  // Receives the one fallback warning; default prints to stderr.
  std::function<void(std::string_view)> warn;
};

// Move-only; returns its block to the pool on destruction. The pool must
// outlive its buffers.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size_bytes() const { return size_bytes_; }          // as requested
  size_t footprint_bytes() const { return footprint_bytes_; }  // rounded to alignment
  Tier tier() const { return tier_; }                        // kPinnedHost or kPageableHost
  bool pinned() const { return tier_ == Tier::kPinnedHost; }
  explicit operator bool() const { return data_ != nullptr; }
  void reset();

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
  size_t footprint_bytes_ = 0;
  Tier tier_ = Tier::kPinnedHost;
};

class PinnedPool {
 public:
  // `device` pins through the device (cudaHostRegister on cuda); nullptr
  // pins with mlock. InvalidArgument for a bad alignment.
  static Result<std::unique_ptr<PinnedPool>> create(Device* device, PinnedPoolOptions options = {});
  ~PinnedPool();  // releases cached blocks; STRATA_CHECKs no buffer is live
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Zero bytes gives an empty buffer.
  Result<PinnedBuffer> allocate(size_t bytes);
  // Releases all cached (free) blocks; returns the bytes released.
  uint64_t trim();

  // kPinnedHost and kPageableHost bytes handed out (cached blocks are not
  // "current"); cached_bytes() counts those separately.
  const MemoryStats& stats() const { return stats_; }
  uint64_t pinned_bytes() const;   // pinned now, cached blocks included
  uint64_t cached_bytes() const;
  uint64_t fallback_count() const;  // allocations served pageable because pinning was refused
  // The bound on pinned bytes: min(budget, RLIMIT_MEMLOCK where it applies); 0 = none.
  uint64_t pinned_limit_bytes() const { return pinned_limit_bytes_; }
  const PinnedPoolOptions& options() const { return options_; }

 private:
  friend class PinnedBuffer;
  PinnedPool(Device* device, PinnedPoolOptions options, uint64_t limit_bytes);
  struct Block {
    void* data;
    size_t footprint_bytes;
    Tier tier;
  };
  void give_back(void* data, size_t size_bytes, size_t footprint_bytes, Tier tier);
  Status pin_new_block(size_t footprint_bytes, void** data);  // budget + pin; no fallback
  void release_block(const Block& block);
  uint64_t evict_cached_locked(uint64_t want_bytes);

  Device* device_;
  PinnedPoolOptions options_;
  uint64_t pinned_limit_bytes_;
  mutable std::mutex mutex_;
  std::multimap<size_t, Block> cached_;  // footprint -> free pinned block
  uint64_t pinned_bytes_ = 0;            // live + cached pinned footprint
  uint64_t cached_bytes_ = 0;
  uint64_t fallback_count_ = 0;
  uint64_t live_buffers_ = 0;
  bool warned_ = false;
  MemoryStats stats_;
};

// Probe: can this process pin `bytes` now (mlock), and the RLIMIT_MEMLOCK
// soft limit (UINT64_MAX when unlimited), which mlock ignores when the
// process holds CAP_IPC_LOCK. For `strata report`.
struct PinningProbe {
  bool works = false;
  uint64_t memlock_limit_bytes = 0;
  bool ipc_lock_capability = false;  // true: the limit above is not applied
  std::string detail;  // "mlock(2.00 MiB) ok" or the errno text
};
PinningProbe probe_pinning(size_t bytes = size_t{2} << 20);

}  // namespace strata
