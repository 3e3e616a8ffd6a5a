// The cuda device backend: the Device interface on CUDA streams and events.
//
// Note [cuda device]
//  - Every CUDA call goes through cuda_status(), which turns an error into a
//    Status naming the call, the CUDA error name and text, and the device.
//  - Device memory comes from the stream-ordered allocator (cudaMallocAsync)
//    on an internal allocation stream that is synchronized before the
//    pointer is handed out, so the buffer is usable on any stream.
//    DeviceBuffer's destructor synchronizes the device before cudaFreeAsync
//    (like cudaFree); Stream::free_async frees in that stream's order.
//  - DeviceOptions::cuda_memory_limit_bytes caps Strata's allocations
//    (--device-memory on a GPU), so a run can be held below the GPU's size
//    and out-of-memory paths are testable; caps().memory_bytes reports it.
//  - Streams are non-blocking (they do not synchronize with the legacy
//    default stream); events are created with timing enabled so
//    elapsed_ms works.
//  - Host functions run through cudaLaunchHostFunc; an exception thrown by
//    one becomes a sticky error of its stream. As with CUDA itself, a host
//    function must not call CUDA.
//  - Pinning: pin_host = cudaHostRegister and allocate_pinned_host =
//    cudaHostAlloc, both of exactly the requested size. The driver pins
//    without RLIMIT_MEMLOCK, so caps().pinning_counts_memlock is false.
//
// Note [cuda gates]
// Stream::wait(const Completion&) must hold a CUDA stream until host code
// completes something (an NVMe read, a CPU Adam tile, a collective) without
// parking a host thread and without a kernel spinning. Each stream owns one
// mapped pinned 32-bit flag; its k-th gate enqueues cuStreamWaitValue32(flag
// >= k), a wait done by the GPU's front end. When gate k's Completion fires,
// a then() callback marks it done and the stream releases gates in issue
// order, storing the highest released index into the flag. Where stream
// memory operations are unavailable the gate is a host function that blocks
// CUDA's callback thread until the Completion is done (correct, but it
// delays other host functions: a fallback only).
// Failures (a failed gate, a throwing host function) are numbered by the
// stream's op count at which they happened: an event or record_completion()
// issued after op n reports the first failure at or before n; host functions
// after a failure are skipped (already-launched kernels cannot be).
//
// Note [Failures across event waits]
// Stream::wait(Event&) is cudaStreamWaitEvent and nothing else on the GPU:
// the waiting stream's log links to the recording stream's log at the
// event's op number, and a failure there before the event becomes this
// stream's from the wait on (failure_up_to follows the links). An earlier
// version put a host function on the waiting stream to copy the failure
// over; CUDA runs all host functions on one thread, one at a time, so a
// long host function on another stream held the waiting stream's copies
// back (DeviceTest.CopyOnOneStreamOverlapsComputeOnAnother failed on an
// H200). Links are settled into the log, and dropped, where the stream is
// known to have passed them: its host functions (launch_host's and
// record_completion()'s), synchronize() of the stream or of an event
// recorded on it, and its destruction; a wait on an event whose work is
// already done makes no link. The bookkeeping is StreamFailureLog
// (stream_failure_log.h), plain C++ tested without a GPU.
#include "cuda/cuda_device.h"
#include "stream_failure_log.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::detail {
namespace {

Status cuda_status(cudaError_t err, std::string_view call, int ordinal) {
  if (err == cudaSuccess) return Status::Ok();
  // The runtime keeps a non-sticky error as the thread's "last error" until
  // it is read, and a later cudaGetLastError after a kernel launch (CudaOps,
  // the device Adam kernel) would report it as that launch's failure: this
  // error is reported here, so it is cleared here.
  (void)cudaGetLastError();
  std::string text = fmt::format("{} on cuda:{} failed: {} ({})", call, ordinal, cudaGetErrorName(err),
                                 cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return OutOfMemory(std::move(text));
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidDevicePointer) return InvalidArgument(std::move(text));
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return Unavailable(std::move(text));
  return IoError(std::move(text));
}

#define STRATA_CUDA(call, ordinal) STRATA_RETURN_IF_ERROR(cuda_status((call), #call, (ordinal)))

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice: return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

class CudaDevice;

using StreamWaitValue32Fn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// cuStreamWaitValue32 from the driver, or null when unavailable.
StreamWaitValue32Fn stream_wait_value32() {
  static StreamWaitValue32Fn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return StreamWaitValue32Fn{nullptr};
    }
    return reinterpret_cast<StreamWaitValue32Fn>(p);
  }();
  return fn;
}

class CudaEvent final : public Event {
 public:
  CudaEvent(Device* device, int ordinal, cudaEvent_t event) : Event(device), ordinal_(ordinal), event_(event) {}
  ~CudaEvent() override {
    cudaSetDevice(ordinal_);
    cudaEventDestroy(event_);  // cannot fail for a valid event; nothing to report in a destructor
  }
  bool query() override {
    cudaSetDevice(ordinal_);
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) cudaGetLastError();  // clear; synchronize() reports it
    return true;
  }
  Status synchronize() override {
    // The record current now is the one cudaEventSynchronize waits for; a
    // record issued meanwhile by another thread must not be settled.
    std::shared_ptr<StreamFailureLog> log;
    uint64_t op = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      log = log_;
      op = op_;
    }
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaEventSynchronize(event_), ordinal_);
    if (!log) return Status::Ok();
    log->settle_up_to(op);
    return log->failure_up_to(op);
  }
  // The failure log and op number captured by the newest record.
  std::pair<std::shared_ptr<StreamFailureLog>, uint64_t> probe() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {log_, op_};
  }
  // Called by CudaStream::record: the failures this record captures.
  void set_probe(std::shared_ptr<StreamFailureLog> log, uint64_t op) {
    std::lock_guard<std::mutex> lock(mutex_);
    log_ = std::move(log);
    op_ = op;
  }
  cudaEvent_t handle() const { return event_; }
  void* native_handle() const override { return event_; }

 private:
  int ordinal_;
  cudaEvent_t event_;
  std::mutex mutex_;
  std::shared_ptr<StreamFailureLog> log_;
  uint64_t op_ = 0;
};

class CudaStream final : public Stream {
 public:
  // `owned`: false for a stream another library made (Note [Borrowed
  // streams]): the destructor waits but does not destroy it.
  CudaStream(Device* device, int ordinal, cudaStream_t stream, bool owned = true)
      : Stream(device), ordinal_(ordinal), stream_(stream), owned_(owned), log_(std::make_shared<StreamFailureLog>()),
        gates_(std::make_shared<GateState>()) {}
  ~CudaStream() override {
    cudaSetDevice(ordinal_);
    // Like the cpu device: destruction waits for the work (gates included).
    const cudaError_t synced = cudaStreamSynchronize(stream_);
    if (owned_) cudaStreamDestroy(stream_);
    // Events recorded here may outlive the stream and keep its log: settled,
    // it holds no other stream's log (two streams that waited on each other
    // would otherwise keep each other's logs alive).
    log_->settle_up_to(UINT64_MAX);
    // A gate still pending (the sync failed: a sticky error, the runtime unloading at exit) may write the
    // flag later from its completion callback: then the flag is left allocated rather than freed under it.
    if (gates_->flag != nullptr && synced == cudaSuccess) cudaFreeHost(const_cast<uint32_t*>(gates_->flag));
  }
  using Stream::wait;

  Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr)
      return InvalidArgument(fmt::format("{} copy of {} bytes with a null pointer", copy_kind_name(kind), bytes));
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), stream_), ordinal_);
    return Status::Ok();
  }
  Status launch_host(HostFn fn) override {
    if (!fn) return InvalidArgument("launch_host: empty function");
    STRATA_RETURN_IF_ERROR(cuda_status(cudaSetDevice(ordinal_), "cudaSetDevice", ordinal_));
    auto* call = new HostCall{std::move(fn), log_, next_op()};
    const cudaError_t err = cudaLaunchHostFunc(stream_, &CudaStream::trampoline, call);
    if (err != cudaSuccess) {
      delete call;
      return cuda_status(err, "cudaLaunchHostFunc", ordinal_);
    }
    return Status::Ok();
  }
  Status record(Event& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
    if (cuda_event == nullptr || &event.device() != &device())
      return InvalidArgument("Stream::record: the event belongs to another device; create it on this device");
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaEventRecord(cuda_event->handle(), stream_), ordinal_);
    cuda_event->set_probe(log_, ops_issued());
    return Status::Ok();
  }
  Status synchronize() override {
    const uint64_t issued = ops_issued();
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaStreamSynchronize(stream_), ordinal_);
    log_->settle_up_to(issued);
    return log_->failure_up_to(UINT64_MAX);
  }
  Status memset_async(void* dst, int value, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaMemsetAsync(dst, value, bytes, stream_), ordinal_);
    return Status::Ok();
  }
  Status wait(Event& event) override {
    auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
    if (cuda_event == nullptr || &event.device() != &device())
      return InvalidArgument("Stream::wait: the event belongs to another device; record it on a stream of this device");
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaStreamWaitEvent(stream_, cuda_event->handle(), 0), ordinal_);
    // The waited event's failures (captured at its record) become ours (Note [Failures across event waits]).
    auto [event_log, event_op] = cuda_event->probe();
    if (!event_log) return Status::Ok();  // never recorded
    const uint64_t op = next_op();
    if (cudaEventQuery(cuda_event->handle()) == cudaSuccess) {
      // Its work is done, so its failures are final: no link to keep.
      Status st = StreamFailureLog::waited_failure(*event_log, event_op);
      if (!st.ok()) log_->fail(op, std::move(st));
      return Status::Ok();
    }
    (void)cudaGetLastError();  // cudaErrorNotReady is not an error; nothing else is reported here
    log_->link(op, std::move(event_log), event_op);
    return Status::Ok();
  }
  Status wait(const Completion& completion) override;
  Completion record_completion() override;
  Status free_async(DeviceBuffer&& buffer) override;
  bool query() override {
    cudaSetDevice(ordinal_);
    const cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) cudaGetLastError();
    return true;
  }
  cudaStream_t handle() const { return stream_; }
  void* native_handle() const override { return stream_; }

 private:
  struct HostCall {
    HostFn fn;
    std::shared_ptr<StreamFailureLog> log;
    uint64_t op;
  };
  // Per-stream gate bookkeeping, shared with pending then() callbacks.
  struct GateState {
    std::mutex mutex;
    volatile uint32_t* flag = nullptr;  // mapped pinned; the GPU waits on it
    CUdeviceptr flag_device = 0;
    uint32_t issued = 0;                // gates enqueued
    uint32_t released = 0;              // highest gate released (in order)
    std::map<uint32_t, bool> done;      // completed gates above `released`
    void complete(uint32_t gate) {
      std::lock_guard<std::mutex> lock(mutex);
      done[gate] = true;
      while (!done.empty() && done.begin()->first == released + 1) {
        done.erase(done.begin());
        ++released;
      }
      std::atomic_thread_fence(std::memory_order_release);
      *flag = released;
    }
  };
  static void CUDART_CB trampoline(void* data) {
    std::unique_ptr<HostCall> call(static_cast<HostCall*>(data));
    call->log->settle_up_to(call->op);  // the stream has passed every earlier op (Note [Failures across event waits])
    if (!call->log->failure_up_to(call->op).ok()) return;  // the stream failed before this function
    try {
      call->fn();
    } catch (const std::exception& e) {
      call->log->fail(call->op, Internal(fmt::format("host function on a cuda stream threw: {}", e.what())));
    } catch (...) {
      call->log->fail(call->op, Internal("host function on a cuda stream threw a non-std exception"));
    }
  }
  uint64_t next_op() { return ++ops_; }
  uint64_t ops_issued() const { return ops_.load(); }
  Status ensure_gate_flag();

  int ordinal_;
  cudaStream_t stream_;
  bool owned_;
  std::atomic<uint64_t> ops_{0};
  std::shared_ptr<StreamFailureLog> log_;
  std::shared_ptr<GateState> gates_;
};

Status CudaStream::ensure_gate_flag() {
  std::lock_guard<std::mutex> lock(gates_->mutex);
  if (gates_->flag != nullptr) return Status::Ok();
  void* host = nullptr;
  STRATA_CUDA(cudaHostAlloc(&host, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable), ordinal_);
  void* dev = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    return cuda_status(err, "cudaHostGetDevicePointer (gate flag)", ordinal_);
  }
  gates_->flag = static_cast<volatile uint32_t*>(host);
  *gates_->flag = 0;
  gates_->flag_device = reinterpret_cast<CUdeviceptr>(dev);
  return Status::Ok();
}

Status CudaStream::wait(const Completion& completion) {
  const uint64_t op = next_op();
  std::string label = completion.label();
  if (completion.done()) {
    Status st = completion.status();
    if (!st.ok()) log_->fail(op, label.empty() ? st : st.with_context(fmt::format("stream gated on '{}'", label)));
    return Status::Ok();
  }
  STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
  StreamWaitValue32Fn wait_value = stream_wait_value32();
  if (wait_value != nullptr) {
    STRATA_RETURN_IF_ERROR(ensure_gate_flag());
    uint32_t gate;
    {
      std::lock_guard<std::mutex> lock(gates_->mutex);
      gate = ++gates_->issued;
    }
    const CUresult res = wait_value(reinterpret_cast<CUstream>(stream_), gates_->flag_device, gate,
                                    CU_STREAM_WAIT_VALUE_GEQ);
    if (res == CUDA_SUCCESS) {
      completion.then([gates = gates_, log = log_, op, gate, label](const Status& st) {
        if (!st.ok()) log->fail(op, label.empty() ? st : st.with_context(fmt::format("stream gated on '{}'", label)));
        gates->complete(gate);  // after the failure is logged: events after the gate see it
      });
      return Status::Ok();
    }
    // Stream memory operations unsupported here: release the number and fall back.
    gates_->complete(gate);
  }
  auto* call = new HostCall{[completion, log = log_, op, label] {
                              Status st = completion.wait();
                              if (!st.ok())
                                log->fail(op, label.empty() ? st
                                                            : st.with_context(fmt::format("stream gated on '{}'", label)));
                            },
                            log_, op};
  const cudaError_t err = cudaLaunchHostFunc(stream_, &CudaStream::trampoline, call);
  if (err != cudaSuccess) {
    delete call;
    return cuda_status(err, "cudaLaunchHostFunc (gate)", ordinal_);
  }
  return Status::Ok();
}

Completion CudaStream::record_completion() {
  auto source = std::make_shared<CompletionSource>("cuda stream work");
  Completion done = source->completion();
  const uint64_t op = ops_issued();
  // Not through trampoline: this must run even after a failure, to report it.
  struct Call {
    std::shared_ptr<CompletionSource> source;
    std::shared_ptr<StreamFailureLog> log;
    uint64_t op;
  };
  auto* call = new Call{source, log_, op};
  const cudaError_t set = cudaSetDevice(ordinal_);
  const cudaError_t err = set != cudaSuccess ? set
                                             : cudaLaunchHostFunc(
                                                   stream_,
                                                   [](void* data) {
                                                     std::unique_ptr<Call> c(static_cast<Call*>(data));
                                                     c->log->settle_up_to(c->op);
                                                     c->source->complete(c->log->failure_up_to(c->op));
                                                   },
                                                   call);
  if (err != cudaSuccess) {
    delete call;
    source->complete(cuda_status(err, "cudaLaunchHostFunc (record_completion)", ordinal_));
  }
  return done;
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, cudaStream_t alloc_stream, const cudaDeviceProp& prop, uint64_t limit_bytes)
      : ordinal_(ordinal), alloc_stream_(alloc_stream),
        limit_bytes_(limit_bytes != 0 ? std::min<uint64_t>(limit_bytes, prop.totalGlobalMem) : prop.totalGlobalMem) {
    caps_.backend = "cuda";
    caps_.name = prop.name;
    caps_.ordinal = ordinal;
    caps_.memory_bytes = limit_bytes_;
    caps_.allocation_alignment = 256;
    caps_.copy_engines = prop.asyncEngineCount;
    caps_.async_copies = true;
    caps_.host_functions = true;
    caps_.host_addressable = false;
    caps_.pinning_counts_memlock = false;
  }
  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(alloc_stream_);
    cudaStreamDestroy(alloc_stream_);
  }

  const DeviceCaps& caps() const override { return caps_; }

  Result<DeviceBuffer> allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    {
      // Reserve under the cap first, so concurrent allocations cannot both pass it.
      std::lock_guard<std::mutex> lock(cap_mutex_);
      if (bytes > limit_bytes_ || reserved_bytes_ > limit_bytes_ - bytes)
        return OutOfMemory(fmt::format(
            "cuda:{} out of memory under its cap: requested {} ({} bytes), in use by Strata {}, limit {}; raise "
            "--device-memory (strata.device_memory), free buffers, or offload more state",
            ordinal_, format_bytes(bytes, true), bytes, format_bytes(reserved_bytes_, true),
            format_bytes(limit_bytes_, true)));
      reserved_bytes_ += bytes;
    }
    struct Unreserve {
      CudaDevice* device;
      uint64_t bytes;
      ~Unreserve() {
        if (device == nullptr) return;
        std::lock_guard<std::mutex> lock(device->cap_mutex_);
        device->reserved_bytes_ -= bytes;
      }
    } unreserve{this, bytes};
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    void* data = nullptr;
    const cudaError_t err = cudaMallocAsync(&data, bytes, alloc_stream_);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return OutOfMemory(fmt::format(
          "cuda:{} out of memory: requested {} ({} bytes), in use by Strata {}, free {}, limit {}; free buffers, "
          "lower the batch or offload more state",
          ordinal_, format_bytes(bytes, true), bytes, format_bytes(memory_in_use_bytes(), true),
          format_bytes(free_bytes, true), format_bytes(total_bytes, true)));
    }
    STRATA_RETURN_IF_ERROR(cuda_status(err, "cudaMallocAsync", ordinal_));
    STRATA_CUDA(cudaStreamSynchronize(alloc_stream_), ordinal_);
    count_allocation(Tier::kDevice, data, bytes);
    unreserve.device = nullptr;  // the reservation now belongs to the buffer
    return wrap_buffer(data, bytes);
  }

  Result<std::unique_ptr<Stream>> create_stream() override {
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    cudaStream_t stream = nullptr;
    STRATA_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), ordinal_);
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(this, ordinal_, stream));
  }
  Result<std::unique_ptr<Stream>> borrow_stream(void* native_handle) {
    return std::unique_ptr<Stream>(
        std::make_unique<CudaStream>(this, ordinal_, static_cast<cudaStream_t>(native_handle), /*owned=*/false));
  }
  Result<std::unique_ptr<Event>> create_event() override {
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    cudaEvent_t event = nullptr;
    STRATA_CUDA(cudaEventCreateWithFlags(&event, cudaEventDefault), ordinal_);
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(this, ordinal_, event));
  }
  Status synchronize() override {
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaDeviceSynchronize(), ordinal_);
    return Status::Ok();
  }
  // Synchronous: the data is in place when these return. cudaMemcpy and
  // cudaMemset alone do not promise that (a pageable host-to-device copy, a
  // device-to-device copy and a memset may return before the device has
  // finished), so they run on the allocation stream, which is then synchronized.
  Status copy(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (bytes == 0) return Status::Ok();
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), alloc_stream_), ordinal_);
    STRATA_CUDA(cudaStreamSynchronize(alloc_stream_), ordinal_);
    return Status::Ok();
  }
  Status memset(void* dst, int value, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaMemsetAsync(dst, value, bytes, alloc_stream_), ordinal_);
    STRATA_CUDA(cudaStreamSynchronize(alloc_stream_), ordinal_);
    return Status::Ok();
  }
  Result<double> elapsed_ms(Event& start, Event& end) override {
    auto* s = dynamic_cast<CudaEvent*>(&start);
    auto* e = dynamic_cast<CudaEvent*>(&end);
    if (s == nullptr || e == nullptr || &start.device() != this || &end.device() != this)
      return InvalidArgument("elapsed_ms: both events must belong to this cuda device");
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    float ms = 0;
    const cudaError_t err = cudaEventElapsedTime(&ms, s->handle(), e->handle());
    if (err == cudaErrorNotReady) return FailedPrecondition("elapsed_ms: an event has not completed yet; synchronize() it first");
    STRATA_RETURN_IF_ERROR(cuda_status(err, "cudaEventElapsedTime", ordinal_));
    return static_cast<double>(ms);
  }
  Status pin_host(void* ptr, size_t bytes) override {
    if (ptr == nullptr || bytes == 0) return InvalidArgument("pin_host: null pointer or zero bytes");
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault), ordinal_);
    return Status::Ok();
  }
  Status unpin_host(void* ptr, size_t bytes) override {
    (void)bytes;
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaHostUnregister(ptr), ordinal_);
    return Status::Ok();
  }
  Result<void*> allocate_pinned_host(size_t bytes) override {
    if (bytes == 0) return InvalidArgument("allocate_pinned_host: zero bytes");
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    void* data = nullptr;
    STRATA_CUDA(cudaHostAlloc(&data, bytes, cudaHostAllocDefault), ordinal_);
    count_allocation(Tier::kPinnedHost, data, bytes);
    return data;
  }
  void free_pinned_host(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    count_free(Tier::kPinnedHost, ptr, bytes);
    cudaSetDevice(ordinal_);
    cudaFreeHost(ptr);
  }

  // Stream::free_async: the memory returns to the pool in stream order, and
  // it is counted free and leaves the cap's reservation when the free runs
  // (Note [Accounts]), from a host function that makes no CUDA call.
  Status free_on_stream(void* data, size_t bytes, cudaStream_t stream) {
    STRATA_CUDA(cudaSetDevice(ordinal_), ordinal_);
    STRATA_CUDA(cudaFreeAsync(data, stream), ordinal_);
    struct FreeRan {
      CudaDevice* device;
      void* data;
      size_t bytes;
    };
    auto* ran = new FreeRan{this, data, bytes};
    const cudaError_t err = cudaLaunchHostFunc(
        stream,
        [](void* arg) {
          std::unique_ptr<FreeRan> ran(static_cast<FreeRan*>(arg));
          ran->device->release_freed(ran->data, ran->bytes);
        },
        ran);
    if (err != cudaSuccess) {
      // The free is queued; count it now rather than never.
      delete ran;
      release_freed(data, bytes);
      return cuda_status(err, "cudaLaunchHostFunc (free_async accounting)", ordinal_);
    }
    return Status::Ok();
  }
  void release_freed(void* data, size_t bytes) {
    count_free(Tier::kDevice, data, bytes);
    std::lock_guard<std::mutex> lock(cap_mutex_);
    reserved_bytes_ -= bytes;
  }

 protected:
  void free_device_memory(void* data, size_t bytes, bool synchronize_first) override {
    cudaSetDevice(ordinal_);
    if (synchronize_first) cudaDeviceSynchronize();  // like cudaFree: no in-flight work may still use it
    cudaFreeAsync(data, alloc_stream_);
    cudaStreamSynchronize(alloc_stream_);
    count_free(Tier::kDevice, data, bytes);
    std::lock_guard<std::mutex> lock(cap_mutex_);
    reserved_bytes_ -= bytes;
  }

 private:
  DeviceCaps caps_;
  int ordinal_;
  cudaStream_t alloc_stream_;
  const uint64_t limit_bytes_;  // DeviceOptions::cuda_memory_limit_bytes or the GPU's memory
  std::mutex cap_mutex_;
  uint64_t reserved_bytes_ = 0;  // allocated or being allocated, against limit_bytes_
};

Status CudaStream::free_async(DeviceBuffer&& buffer) {
  if (!buffer) return Status::Ok();
  if (buffer.device() != &device()) return InvalidArgument("Stream::free_async: the buffer belongs to another device");
  const size_t bytes = buffer.size_bytes();
  void* data = buffer.release();
  return static_cast<CudaDevice&>(device()).free_on_stream(data, bytes, stream_);
}

}  // namespace

BackendInfo probe_cuda() {
  BackendInfo info;
  info.name = "cuda";
  info.compiled = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  cudaDriverGetVersion(&info.driver_version);  // 0 when no driver is installed
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    info.reason = fmt::format("cudaGetDeviceCount failed: {} ({})", cudaGetErrorName(err), cudaGetErrorString(err));
    return info;
  }
  if (count <= 0) {
    info.reason = "cudaGetDeviceCount found no CUDA devices";
    return info;
  }
  info.available = true;
  info.device_count = count;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      cudaGetLastError();
      info.devices.push_back(fmt::format("{}: (cudaGetDeviceProperties failed)", i));
      continue;
    }
    info.devices.push_back(fmt::format("{}: {} ({}, sm_{}{}, {} copy engines)", i, prop.name,
                                       format_bytes(prop.totalGlobalMem, true), prop.major, prop.minor,
                                       prop.asyncEngineCount));
  }
  info.reason = fmt::format("{} device(s)", count);
  return info;
}

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options) {
  int count = 0;
  STRATA_CUDA(cudaGetDeviceCount(&count), options.ordinal);
  if (options.ordinal < 0 || options.ordinal >= count)
    return InvalidArgument(fmt::format("cuda device ordinal {} out of range: this machine has {} device(s)",
                                       options.ordinal, count));
  STRATA_CUDA(cudaSetDevice(options.ordinal), options.ordinal);
  cudaDeviceProp prop{};
  STRATA_CUDA(cudaGetDeviceProperties(&prop, options.ordinal), options.ordinal);
  // allocate() synchronizes the allocation stream. By default the pool may
  // hand it memory freed on another stream (free_async) by making it wait
  // for that stream, which may be parked on a host completion that only the
  // allocating thread would complete: no such cross-stream dependencies.
  cudaMemPool_t pool = nullptr;
  STRATA_CUDA(cudaDeviceGetDefaultMemPool(&pool, options.ordinal), options.ordinal);
  int allow_internal_dependencies = 0;
  STRATA_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &allow_internal_dependencies),
              options.ordinal);
  cudaStream_t alloc_stream = nullptr;
  STRATA_CUDA(cudaStreamCreateWithFlags(&alloc_stream, cudaStreamNonBlocking), options.ordinal);
  return std::unique_ptr<Device>(
      std::make_unique<CudaDevice>(options.ordinal, alloc_stream, prop, options.cuda_memory_limit_bytes));
}

Result<std::unique_ptr<Stream>> borrow_cuda_stream(Device& device, void* native_handle) {
  auto* cuda = dynamic_cast<CudaDevice*>(&device);
  if (cuda == nullptr)
    return InvalidArgument(fmt::format("borrow_cuda_stream: the {} device is not a cuda device", device.caps().backend));
  return cuda->borrow_stream(native_handle);
}

}  // namespace strata::detail
