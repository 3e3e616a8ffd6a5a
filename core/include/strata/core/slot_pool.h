#pragma once
// SlotPool: a fixed set of equal-sized pinned host buffers ("slots"), sized
// once at start-up, for stream-ordered staging (NVMe -> slot -> device and
// back). It is the host-buffer half of the engine's pipelines:
//
//   SlotPool::create(device, {slot_count, slot_bytes, alignment, name, timeout})
//     pins ONE contiguous region of slot_count x stride bytes through the
//     Device (cudaHostAlloc on cuda, so copies are asynchronous; aligned +
//     mlock and registered on the cpu device, so its copies overlap). If the
//     region cannot be pinned, create() fails; it never falls back to
//     pageable memory (a pageable staging buffer would silently serialize
//     every copy). Use PinnedPool for one-off allocations instead.
//   acquire(holder) blocks until a slot is free, up to acquire_timeout, then
//     fails with DeadlineExceeded naming the pool and who holds every slot;
//     try_acquire(holder) fails at once with ResourceExhausted.
//   Slot is a move-only handle. Destroying it returns the slot at once;
//     release_after(done) returns it only once `done` has completed (c10
//     CUDAHostAllocator's event-guarded reuse): pass the completion of the
//     last operation that reads or writes the slot, e.g.
//     stream.record_completion() after a copy, or an NVMe write's completion.
//
// Note [slot pool choices]
//  - A release whose completion FAILED still returns the slot: the failure
//    belongs to the operation (its waiters learn it through the Completion),
//    the memory itself is intact and reusable, and keeping it out would leak
//    the pool dry after a few I/O errors. The pool counts such releases
//    (SlotPoolStats::failed_releases) and remembers the last error text.
//  - The pool must outlive its slots. ~SlotPool STRATA_CHECKs that no Slot
//    handle is alive (its destructor would touch a freed pool), then waits
//    for pending release_after() completions for up to acquire_timeout (the
//    work they guard may still be using the memory), and STRATA_CHECKs,
//    naming them, if they did not complete by then.
//  - The whole region is counted as pinned host memory (Tier::kPinnedHost)
//    from create() to destruction, in stats() and in MemoryStats::process():
//    it stays page-locked whether or not a slot is in use. Slot occupancy is
//    in SlotPoolStats (in_use, peak_in_use).
//  - io_uring fixed buffers: base() and total_bytes() describe the whole
//    region, so an IoEngine can register it ONCE as one fixed buffer; a slot
//    is the range [base() + slot.offset(), + slot_bytes()) within it.
//  - Thread-safe: acquire, try_acquire, releases and stats may be called from
//    any thread. Completion callbacks that return slots take the pool lock
//    briefly and never run user code under it.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/completion.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"

namespace strata {

class Device;
class SlotPool;

struct SlotPoolOptions {
  size_t slot_count = 0;        // 1 .. 65536
  size_t slot_bytes = 0;        // > 0; each slot's stride is rounded up to `alignment`
  size_t alignment = 4096;      // power of two, 64 .. 1 GiB; 4096 suits O_DIRECT
  std::string name = "slot pool";  // for messages ("nvme staging")
  std::chrono::milliseconds acquire_timeout{30000};  // > 0
  // Not null: the device counts the region in this account too (Note
  // [Accounts] in device.h); must outlive the pool.
  MemoryStats* account = nullptr;
};

struct SlotPoolStats {
  uint64_t acquires = 0;          // slots handed out (acquire + try_acquire)
  uint64_t waits = 0;             // acquires that had to block for a free slot
  uint64_t total_wait_ns = 0;     // time spent blocked in those waits (timeouts included)
  uint64_t timeouts = 0;          // acquire() calls that gave up
  uint64_t try_failures = 0;      // try_acquire() calls that found no free slot
  uint64_t releases = 0;          // slots returned (at once or after a completion)
  uint64_t failed_releases = 0;   // returned after a completion that FAILED
  std::string last_release_error; // that completion's Status text, "" if none
  size_t in_use = 0;              // held + waiting on a release completion, now
  size_t peak_in_use = 0;         // max of in_use since creation
  size_t pending_releases = 0;    // waiting on a release completion, now
};

// A slot held by one user. Move-only; returns the slot on destruction.
class Slot {
 public:
  Slot() = default;
  Slot(Slot&& other) noexcept;
  Slot& operator=(Slot&& other) noexcept;
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  ~Slot() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }       // the pool's slot_bytes (capacity)
  size_t index() const { return index_; }       // 0 .. slot_count-1
  size_t offset() const { return offset_; }     // data() - pool.base(), for fixed-buffer I/O
  const std::string& holder() const { return holder_; }
  explicit operator bool() const { return pool_ != nullptr; }

  // Returns the slot now (the memory must no longer be in use by any
  // queued work). No-op on an empty handle.
  void reset();
  // Returns the slot once `done` has completed, ok or not (see Note [slot
  // pool choices]); the handle is empty afterwards. Never blocks.
  void release_after(Completion done);

 private:
  friend class SlotPool;
  SlotPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t index_ = 0;
  size_t offset_ = 0;
  std::string holder_;
};

class SlotPool {
 public:
  // InvalidArgument naming the field for bad options; OutOfMemory (with an
  // RLIMIT_MEMLOCK hint where pinning is mlock) when the region cannot be
  // pinned. `device` must outlive the pool.
  static Result<std::unique_ptr<SlotPool>> create(Device& device, SlotPoolOptions options);
  ~SlotPool();  // see Note [slot pool choices]
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // Blocks up to options().acquire_timeout for a free slot. `holder` says who
  // takes it ("read chunk 7"), for the timeout message.
  Result<Slot> acquire(std::string_view holder);
  // Same, after checking that `bytes` fit in a slot (InvalidArgument if not).
  Result<Slot> acquire(std::string_view holder, size_t bytes);
  // ResourceExhausted at once when no slot is free.
  Result<Slot> try_acquire(std::string_view holder);
  Result<Slot> try_acquire(std::string_view holder, size_t bytes);
  // InvalidArgument naming the pool when `bytes` exceed slot_bytes().
  Status check_fits(size_t bytes) const;

  // The pinned region, for one-time registration (io_uring fixed buffers).
  void* base() const { return base_; }
  size_t total_bytes() const { return stride_ * options_.slot_count; }
  size_t slot_count() const { return options_.slot_count; }
  size_t slot_bytes() const { return options_.slot_bytes; }
  size_t slot_stride() const { return stride_; }  // slot i starts at base() + i * slot_stride()
  const std::string& name() const { return options_.name; }
  const SlotPoolOptions& options() const { return options_; }
  Device& device() const { return device_; }

  size_t free_slots() const;
  SlotPoolStats stats() const;
  // Kind kPinnedHost: the whole region while the pool lives.
  const MemoryStats& memory_stats() const { return memory_stats_; }

 private:
  friend class Slot;
  enum class SlotState : uint8_t { kFree, kHeld, kReleasing };
  struct SlotInfo {
    SlotState state = SlotState::kFree;
    std::string holder;
    std::string release_label;  // the guarding completion's label while kReleasing
  };
  SlotPool(Device& device, SlotPoolOptions options, void* allocation, size_t allocation_bytes, void* base,
           size_t stride);
  Result<Slot> take_locked(size_t index, std::string_view holder);
  Slot make_slot(size_t index, std::string_view holder);
  void give_back(size_t index);                       // from Slot::reset
  void begin_release(size_t index, const Completion& done);  // from Slot::release_after
  void finish_release(size_t index, const Status& status);  // the completion's callback
  void return_locked(size_t index);
  std::string describe_locked() const;  // "3 x 8.00 MiB; [0] held by 'a', [1] ..."
  Result<Slot> acquire_impl(std::string_view holder, bool block);

  Device& device_;
  SlotPoolOptions options_;
  void* allocation_;          // as returned by the device (freed with free_pinned_host)
  size_t allocation_bytes_;
  void* base_;                // aligned start of slot 0
  size_t stride_;

  mutable std::mutex mutex_;
  std::condition_variable freed_cv_;  // a slot became free (or a release finished)
  std::vector<SlotInfo> slots_;
  std::vector<size_t> free_list_;     // LIFO: the most recently returned slot is warmest in cache
  size_t handles_alive_ = 0;          // kHeld slots (Slot handles that own one)
  SlotPoolStats stats_;
  MemoryStats memory_stats_;
};

}  // namespace strata
