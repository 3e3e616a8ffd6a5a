#pragma once
// The Device interface: accelerator memory, ordered streams, events and
// copies, in the style of ggml-backend (small header of handles, plain
// capability struct, optional methods with a synchronizing fallback).
//
// Backends: "cpu" (a real device whose memory is host memory under a
// capacity limit, streams are worker threads, copies run on copy-engine
// threads) and "cuda" (CUDA streams/events, cudaMallocAsync, pinned host
// memory through cudaHostRegister/cudaHostAlloc). Create one with
// make_device() from device_registry.h. See docs/core.md.
//
// Lifetimes: a Device must outlive its streams, events and buffers.
// Pointers to device memory are plain `void*`: on the cpu device they are
// host-addressable (host functions may read them), on cuda they are not.
//
// Semantics follow CUDA so code that is correct on the cpu device is
// correct on cuda:
//  - work on one stream runs in issue order; streams run concurrently;
//  - record(event) captures the work issued so far on that stream; the
//    event completes when that work has; query() of a never-recorded
//    event is true; wait(event) makes later work on the stream wait for
//    the work captured by the most recent record() at the time of wait();
//  - copies to/from PAGEABLE host memory are synchronous with respect to
//    the host (as cudaMemcpyAsync is); only pinned memory copies overlap.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "strata/core/completion.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"

namespace strata {

class Device;
class Stream;
class Event;

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice };
std::string_view copy_kind_name(CopyKind kind);  // "H2D", "D2H", "D2D"

// What a device can do; a plain struct.
struct DeviceCaps {
  std::string backend;             // "cpu" | "cuda"
  std::string name;                // "cpu (host memory, 1.00 GiB cap)", "NVIDIA H100 80GB HBM3"
  int ordinal = 0;                 // device index within the backend
  uint64_t memory_bytes = 0;       // capacity of the device tier
  size_t allocation_alignment = 256;
  int copy_engines = 0;            // independent copy queues (overlap H2D with D2H)
  bool async_copies = false;       // copy_async returns before the copy has run
  bool host_functions = true;      // launch_host is supported
  bool host_addressable = false;   // device pointers may be dereferenced by host code
  bool pinning_counts_memlock = false;  // pinning is bounded by RLIMIT_MEMLOCK (mlock)
};

// Options for make_device(). Unused fields are ignored by a backend.
struct DeviceOptions {
  uint64_t device_memory_bytes = uint64_t{1} << 30;  // cpu: capacity (--device-memory)
  // cuda: a cap on Strata's own allocations (--device-memory), so a run can
  // be held to less than the GPU's memory; 0 = the GPU's memory.
  uint64_t cuda_memory_limit_bytes = 0;
  int ordinal = 0;                                   // cuda: which GPU
};

using HostFn = std::function<void()>;

// Move-only owner of device memory; frees on destruction. Freeing
// synchronizes the device first (like cudaFree), so no in-flight work can
// still use it; Stream::free_async frees in stream order instead.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size_bytes() const { return size_bytes_; }
  Device* device() const { return device_; }
  explicit operator bool() const { return data_ != nullptr; }
  // Frees now (synchronizing the device).
  void reset();
  // Gives up ownership without freeing; used by Stream::free_async.
  void* release();

 private:
  friend class Device;
  DeviceBuffer(Device* device, void* data, size_t size_bytes)
      : device_(device), data_(data), size_bytes_(size_bytes) {}
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

// A marker in a stream. Created by Device::create_event().
class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Device& device() const { return *device_; }
  // True when the work captured by the last record() has completed (or
  // the event was never recorded). Never blocks.
  virtual bool query() = 0;
  // Blocks the host until the captured work has completed; returns the
  // Status of that work (the error of a failed gate or host function before
  // the record, see Stream::wait(const Completion&)), never a silent success.
  virtual Status synchronize() = 0;
  // The backend's own handle for interop (cudaEvent_t on cuda), nullptr on cpu.
  virtual void* native_handle() const { return nullptr; }

 protected:
  explicit Event(Device* device) : device_(device) {}

 private:
  Device* device_;
};

// An ordered queue of work. Created by Device::create_stream(). Destroying
// a stream waits for its work to finish.
class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Device& device() const { return *device_; }

  // --- required -----------------------------------------------------
  // Copies `bytes` bytes; the host side must stay valid until the copy ran
  // (pinned memory: until an event after it completes).
  virtual Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  // Runs `fn` on the host in stream order (the cpu device runs compute this
  // way). `fn` must not call into the device API of this stream.
  virtual Status launch_host(HostFn fn) = 0;
  virtual Status record(Event& event) = 0;
  // Blocks until all work issued so far has run. Returns the first error
  // of asynchronous work (a sticky error, as in CUDA).
  virtual Status synchronize() = 0;

  // --- optional, with synchronizing fallbacks --------------------------
  // Fallback: synchronize(), then Device::memset.
  virtual Status memset_async(void* dst, int value, size_t bytes);
  // Later work waits for `event`. Fallback: event.synchronize() on the host.
  virtual Status wait(Event& event);
  // Later work waits for a host-signalled `completion` (an NVMe read, a CPU
  // Adam tile, a collective: see strata/core/completion.h). If it fails, the
  // stream fails with its Status: later work is skipped, and synchronize(),
  // events recorded after the gate and record_completion() report that Status.
  // cpu: the stream worker waits on the shared state; cuda: a stream memory
  // wait on a host-written flag (no host thread parked, no kernel spinning),
  // or a host-function gate where stream memory operations are unsupported.
  // Fallback: completion.wait() on the host, then returns its Status.
  virtual Status wait(const Completion& completion);
  // A Completion that completes, with the stream's Status, once the work
  // issued so far has run: how host code (the comm queue, the NVMe writer, a
  // slot pool) chains onto stream work without blocking. Fallback:
  // synchronize(), then an already-complete Completion with its Status.
  virtual Completion record_completion();
  // Frees `buffer` once the work issued so far has run. Fallback:
  // synchronize(), then free.
  virtual Status free_async(DeviceBuffer&& buffer);
  // True when all issued work has run. Fallback: synchronize(), then true.
  virtual bool query();
  // The backend's own handle for interop, e.g. to launch CUDA kernels or
  // NCCL collectives in this stream's order: cudaStream_t on cuda, nullptr on cpu.
  virtual void* native_handle() const { return nullptr; }

 protected:
  explicit Stream(Device* device) : device_(device) {}
  // For backends: frees memory whose uses are already ordered before now.
  static void release_device_memory(Device& device, void* data, size_t bytes);

 private:
  Device* device_;
};

class Device {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual const DeviceCaps& caps() const = 0;

  // Device memory; fails with OutOfMemory naming requested, in use and limit.
  // Zero bytes gives an empty buffer.
  virtual Result<DeviceBuffer> allocate(size_t bytes) = 0;
  virtual Result<std::unique_ptr<Stream>> create_stream() = 0;
  virtual Result<std::unique_ptr<Event>> create_event() = 0;
  // Waits for all work on all streams of this device.
  virtual Status synchronize() = 0;
  // Synchronous copy and memset (the fallbacks of the stream versions).
  virtual Status copy(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  virtual Status memset(void* dst, int value, size_t bytes) = 0;
  // Milliseconds between two completed events (cudaEventElapsedTime).
  virtual Result<double> elapsed_ms(Event& start, Event& end) = 0;

  // Host pinning. pin_host page-locks existing memory in place, exactly
  // `bytes` (cudaHostRegister / mlock); allocate_pinned_host allocates
  // page-locked memory of exactly `bytes` (cudaHostAlloc / aligned + mlock).
  // Failure here is not fatal to callers: PinnedPool falls back to pageable.
  virtual Status pin_host(void* ptr, size_t bytes) = 0;
  virtual Status unpin_host(void* ptr, size_t bytes) = 0;
  virtual Result<void*> allocate_pinned_host(size_t bytes) = 0;
  virtual void free_pinned_host(void* ptr, size_t bytes) = 0;

  // Bytes of device memory in use (Tier::kDevice of memory_stats()).
  uint64_t memory_in_use_bytes() const { return stats_.get(Tier::kDevice).current_bytes; }
  const MemoryStats& memory_stats() const { return stats_; }

  // Note [Accounts]
  // allocate() and allocate_pinned_host() for one client of a shared device
  // (the offload engine beside the model): the device itself counts the
  // memory in `account` as well (Tier::kDevice, Tier::kPinnedHost), with the
  // bytes it counts in memory_stats() (cpu: a device allocation's 256-byte
  // footprint) at the moments it counts them there (a Stream::free_async
  // when the free runs), so a client's numbers are the device's accounting
  // of its allocations, not counters kept beside them. Free as usual (the
  // buffer's destructor, free_async, free_pinned_host). `account` must
  // outlive the allocation.
  Result<DeviceBuffer> allocate(size_t bytes, MemoryStats& account);
  Result<void*> allocate_pinned_host(size_t bytes, MemoryStats& account);

 protected:
  Device() = default;
  DeviceBuffer wrap_buffer(void* data, size_t bytes) { return DeviceBuffer(this, data, bytes); }
  // Backends count every allocate() and allocate_pinned_host() and every free
  // through these: `bytes` what the device counts for it (the same number
  // at the free). Device memory goes into memory_stats(); both tiers into
  // the allocation's account, if it has one (Note [Accounts]).
  void count_allocation(Tier tier, const void* data, uint64_t bytes);
  void count_free(Tier tier, const void* data, uint64_t bytes);
  // Releases memory from allocate(); called by DeviceBuffer. `synchronize`
  // is false when the caller already ordered the free after all uses.
  virtual void free_device_memory(void* data, size_t bytes, bool synchronize) = 0;
  MemoryStats stats_;

 private:
  friend class DeviceBuffer;
  friend class Stream;
  struct Counted {
    uint64_t bytes = 0;
    MemoryStats* account = nullptr;
  };
  std::mutex counted_mutex_;
  std::unordered_map<const void*, Counted> counted_[2];  // [0] device memory, [1] pinned host memory
  std::unordered_map<const void*, Counted>& counted_of(Tier tier) { return counted_[tier == Tier::kDevice ? 0 : 1]; }
};

}  // namespace strata
