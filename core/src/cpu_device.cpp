// The cpu device backend.
//
// Note [cpu device]
// A real device, not a mock: code written against it behaves as on CUDA.
//  - Memory is host memory under a capacity limit (DeviceOptions::
//    device_memory_bytes). Allocations are 256-byte aligned and counted at
//    their 256-rounded size; past the limit allocate() returns OutOfMemory
//    with requested, in use and limit.
//  - Each stream is an ordered queue drained by its own worker thread, so
//    streams run concurrently and host functions (the cpu device's
//    "kernels") on different streams overlap.
//  - Copies run on copy-engine threads (one for H2D and D2D, one for D2H,
//    like a GPU's DMA engines): the stream's worker hands the copy to the
//    engine and waits for it, keeping stream order, while other streams go
//    on. Two streams copying in the same direction share one engine.
//    (Copies of at most kInlineBytes are the stream's own: below.)
//  - Device pointers are checked: a copy or memset whose device side is not
//    inside a live allocation is an InvalidArgument naming the pointer,
//    which catches on the cpu device the bugs that fault on a GPU.
//  - Host ranges pinned through pin_host()/allocate_pinned_host() are
//    remembered. A copy whose host side is pageable completes before
//    copy_async returns, as cudaMemcpyAsync does with pageable memory, so
//    code that only overlaps with pinned memory here also does on CUDA.
//  - Events track generations: record() makes a new one, query()/
//    synchronize() look at the newest at call time, Stream::wait() at the
//    newest at the time of the wait, as in CUDA.
//  - An idle stream runs small work inline (Note [Idle streams run small
//    work inline]).
//  - With STRATA_CPU_DEVICE_CUDA_HOST_RULES=1 the device also keeps CUDA's
//    rules for host functions (Note [CUDA's host-function rules]).
//  - A host function that throws sets a sticky error on its stream,
//    reported by the next synchronize(). Stream::wait(const Completion&)
//    gates the stream on host-signalled work; a failed gate fails the
//    stream the same way (Note [Failed gates]).
#include "cpu_device.h"

#include <sys/mman.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::detail {
namespace {

constexpr size_t kDeviceAlignment = 256;
// Note [Idle streams run small work inline]
// Handing an item to a stream's worker costs two thread switches (its
// wake-up, then the waiter's), tens of microseconds on a busy host: more
// than a small memset or copy. So when nothing is queued or running on a
// stream, a memset or copy of at most kInlineBytes, or a free, runs on the
// calling thread, and record_completion() returns a completed Completion;
// a gate on a Completion that already succeeded is never queued. Stream
// order is kept (the stream has no earlier work; later items wait for the
// inline one), and a GPU could have finished the same work as soon, so code
// still behaves as on CUDA. A small copy on a busy stream runs on the
// stream's worker itself, not handed on to a copy engine; larger copies go
// through the copy engines.
constexpr size_t kInlineBytes = 64 * 1024;
constexpr size_t kPageBytes = 4096;

size_t round_up(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

using Clock = std::chrono::steady_clock;

// The worker thread currently running a stream's queue, to catch host
// functions that would deadlock by synchronizing their own device.
thread_local const void* tls_current_worker_device = nullptr;

// Note [CUDA's host-function rules]
// CUDA runs the host functions of every stream (cudaLaunchHostFunc) on one
// callback thread, one at a time, and a host function must not call CUDA;
// code that completes a Completion from a host function (the cuda stream's
// record_completion) runs that Completion's then() continuations there too.
// The cpu device gives each stream its own worker, so code that breaks these
// rules runs fine here and hangs on a GPU. With the environment variable
// STRATA_CPU_DEVICE_CUDA_HOST_RULES=1 the cpu device keeps them: host
// functions and completions recorded on a stream run one at a time under one
// process-wide lock, record_completion() always goes through the queue, and
// a Device or Stream call made from inside one (a continuation included)
// stops the process with the call's name. A debugging aid for the cuda
// backend's callers (tests/core/cuda_host_rules_test.cpp runs the engine
// under it); off by default because it serializes the cpu device's kernels.
bool cuda_host_rules() {
  static const bool on = [] {
    const char* v = std::getenv("STRATA_CPU_DEVICE_CUDA_HOST_RULES");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return on;
}
std::mutex& host_function_lock() {
  static std::mutex lock;
  return lock;
}
thread_local bool tls_in_host_function = false;

// Under CUDA's rules, a Device or Stream call from a host function is a bug.
void check_not_in_host_function(std::string_view call) {
  STRATA_CHECK(!tls_in_host_function,
               fmt::format("{} was called from a host function or a continuation it ran "
                           "(STRATA_CPU_DEVICE_CUDA_HOST_RULES): CUDA forbids CUDA calls there; do this work on "
                           "another thread",
                           call));
}

// One copy engine: a thread that runs copies handed to it, in order.
class CopyEngine {
 public:
  CopyEngine() : thread_([this] { run(); }) {}
  ~CopyEngine() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Runs the copy on the engine thread; returns when it is done.
  void copy(void* dst, const void* src, size_t bytes) {
    Job job{dst, src, bytes};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(&job);
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return job.done; });
  }

 private:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
    bool done = false;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      Job* job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      std::memcpy(job->dst, job->src, job->bytes);
      lock.lock();
      job->done = true;
      done_cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job*> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

class CpuDevice;

// The state of an event lives in a shared block that queued stream work
// holds too, so destroying an Event with records still pending is safe (as
// cudaEventDestroy is). Waiters are woken while the mutex is held, so no
// thread touches the state after a waiter could have seen it complete.
// Each generation completes with the recording stream's Status at that
// point (Note [Failed gates] below); failures are kept for the most recent
// kFailedGenerationsKept generations, which covers any waiter that looked
// at the newest generation when it started to wait.
struct EventState {
  static constexpr uint64_t kFailedGenerationsKept = 1024;
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;
  std::set<uint64_t> pending;
  std::map<uint64_t, Status> failed;  // generation -> the stream's error at the record
  uint64_t timestamp_generation = 0;
  Clock::time_point timestamp{};

  void complete(uint64_t generation, const Status& stream_status) {
    std::lock_guard<std::mutex> lock(mutex);
    pending.erase(generation);
    if (!stream_status.ok()) {
      failed.emplace(generation, stream_status);
      while (!failed.empty() && failed.begin()->first + kFailedGenerationsKept < recorded) failed.erase(failed.begin());
    }
    if (generation > timestamp_generation) {
      timestamp_generation = generation;
      timestamp = Clock::now();
    }
    cv.notify_all();
  }
  // Waits for `generation`; returns the Status its work completed with.
  Status wait_generation(uint64_t generation) {
    if (generation == 0) return Status::Ok();
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return pending.count(generation) == 0; });
    auto it = failed.find(generation);
    return it == failed.end() ? Status::Ok() : it->second;
  }
};

class CpuEvent final : public Event {
 public:
  explicit CpuEvent(Device* device) : Event(device), state_(std::make_shared<EventState>()) {}

  // Called by record() at issue time: a new generation.
  uint64_t begin_record() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    const uint64_t generation = ++state_->recorded;
    state_->pending.insert(generation);
    return generation;
  }
  uint64_t newest_generation() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->recorded;
  }
  const std::shared_ptr<EventState>& state() const { return state_; }

  bool query() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->recorded == 0 || state_->pending.count(state_->recorded) == 0;
  }
  Status synchronize() override {
    check_not_in_host_function("Event::synchronize");
    return state_->wait_generation(newest_generation());
  }
  // Completion time of the newest record, if it has completed.
  Result<Clock::time_point> completed_at() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->recorded == 0) return FailedPrecondition("event was never recorded; record() it on a stream first");
    if (state_->pending.count(state_->recorded) != 0 || state_->timestamp_generation != state_->recorded)
      return FailedPrecondition("event has not completed yet; synchronize() it first");
    return state_->timestamp;
  }

 private:
  std::shared_ptr<EventState> state_;
};

class CpuStream final : public Stream {
 public:
  CpuStream(CpuDevice* device);
  ~CpuStream() override;

  Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  Status launch_host(HostFn fn) override;
  Status record(Event& event) override;
  Status synchronize() override;
  Status memset_async(void* dst, int value, size_t bytes) override;
  Status wait(Event& event) override;
  Status wait(const Completion& completion) override;
  Completion record_completion() override;
  Status free_async(DeviceBuffer&& buffer) override;
  bool query() override;

 private:
  // One queued item. `fn` gets the stream's sticky error as it stands when
  // the item runs and returns the item's own Status (non-ok makes the stream
  // fail). Work items are skipped once the stream has failed; bookkeeping
  // items (event records, completions, frees) always run so that nothing
  // waiting on the stream hangs and no memory leaks.
  struct Op {
    std::function<Status(const Status& stream_error)> fn;
    bool runs_after_failure = false;
    bool host_function = false;  // on CUDA, run by the callback thread (Note [CUDA's host-function rules])
  };
  // Enqueues `op`; returns its sequence number (1-based).
  uint64_t enqueue(Op op);
  // Runs `op` on the calling thread when the stream is idle (Note [Idle
  // streams run small work inline]); false (nothing done) otherwise.
  bool run_inline_if_idle(Op& op);
  uint64_t enqueue_work(std::function<void()> fn, bool host_function = false);
  void wait_for(uint64_t sequence);
  void run();

  CpuDevice* cpu_device_;
  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Op> queue_;
  uint64_t issued_ = 0;
  uint64_t completed_ = 0;
  bool running_inline_ = false;  // the worker starts nothing while an inline item runs
  bool stop_ = false;
  Status sticky_error_;
  std::thread thread_;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(uint64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {
    caps_.backend = "cpu";
    caps_.name = fmt::format("cpu (host memory, {} cap)", format_bytes(capacity_bytes, true));
    caps_.ordinal = 0;
    caps_.memory_bytes = capacity_bytes;
    caps_.allocation_alignment = kDeviceAlignment;
    caps_.copy_engines = 2;
    caps_.async_copies = true;
    caps_.host_functions = true;
    caps_.host_addressable = true;
    caps_.pinning_counts_memlock = true;
  }
  ~CpuDevice() override {
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_CHECK(streams_.empty(), "cpu device destroyed while streams are alive; destroy streams first");
    STRATA_CHECK(allocations_.empty(),
                 fmt::format("cpu device destroyed with {} live buffer(s); free DeviceBuffers first",
                             allocations_.size()));
  }

  const DeviceCaps& caps() const override { return caps_; }

  Result<DeviceBuffer> allocate(size_t bytes) override {
    check_not_in_host_function("Device::allocate");
    if (bytes == 0) return DeviceBuffer();
    const size_t footprint = round_up(bytes, kDeviceAlignment);
    std::lock_guard<std::mutex> lock(mutex_);
    if (footprint > capacity_bytes_ - in_use_bytes_ || footprint < bytes) {
      return OutOfMemory(fmt::format(
          "cpu device out of memory: requested {} ({} bytes), in use {}, limit {}; raise --device-memory "
          "(device_memory_bytes) or free buffers first",
          format_bytes(bytes, true), bytes, format_bytes(in_use_bytes_, true), format_bytes(capacity_bytes_, true)));
    }
    void* data = std::aligned_alloc(kDeviceAlignment, footprint);
    if (data == nullptr)
      return OutOfMemory(fmt::format("cpu device: host allocation of {} failed (the machine is out of memory)",
                                     format_bytes(footprint, true)));
    in_use_bytes_ += footprint;
    allocations_.emplace(reinterpret_cast<uintptr_t>(data), Allocation{bytes, footprint});
    count_allocation(Tier::kDevice, data, footprint);
    return wrap_buffer(data, bytes);
  }

  Result<std::unique_ptr<Stream>> create_stream() override {
    check_not_in_host_function("Device::create_stream");
    auto stream = std::make_unique<CpuStream>(this);
    return std::unique_ptr<Stream>(std::move(stream));
  }
  Result<std::unique_ptr<Event>> create_event() override {
    check_not_in_host_function("Device::create_event");
    return std::unique_ptr<Event>(std::make_unique<CpuEvent>(this));
  }

  Status synchronize() override {
    check_not_in_host_function("Device::synchronize");
    STRATA_CHECK(tls_current_worker_device != this,
                 "a host function synchronized (or freed a DeviceBuffer of) its own device: this deadlocks; "
                 "free with Stream::free_async instead");
    std::vector<CpuStream*> streams;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      streams.assign(streams_.begin(), streams_.end());
    }
    Status first;
    for (CpuStream* s : streams) {
      Status st = s->synchronize();
      if (first.ok() && !st.ok()) first = std::move(st);
    }
    return first;
  }

  Status copy(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    check_not_in_host_function("Device::copy");
    STRATA_RETURN_IF_ERROR(check_copy(dst, src, bytes, kind));
    if (bytes > 0) engine_for(kind).copy(dst, src, bytes);
    return Status::Ok();
  }
  Status memset(void* dst, int value, size_t bytes) override {
    check_not_in_host_function("Device::memset");
    STRATA_RETURN_IF_ERROR(check_device_range(dst, bytes, "memset destination"));
    if (bytes > 0) std::memset(dst, value, bytes);
    return Status::Ok();
  }
  Result<double> elapsed_ms(Event& start, Event& end) override {
    auto* s = dynamic_cast<CpuEvent*>(&start);
    auto* e = dynamic_cast<CpuEvent*>(&end);
    if (s == nullptr || e == nullptr || &start.device() != this || &end.device() != this)
      return InvalidArgument("elapsed_ms: both events must belong to this cpu device");
    STRATA_ASSIGN_OR_RETURN(Clock::time_point t0, s->completed_at());
    STRATA_ASSIGN_OR_RETURN(Clock::time_point t1, e->completed_at());
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  }

  Status pin_host(void* ptr, size_t bytes) override {
    check_not_in_host_function("Device::pin_host");
    if (ptr == nullptr || bytes == 0) return InvalidArgument("pin_host: null pointer or zero bytes");
    if (mlock(ptr, bytes) != 0) {
      return ErrnoStatus(errno, fmt::format("mlock({} at {}) (RLIMIT_MEMLOCK too low? raise `ulimit -l`)",
                                            format_bytes(bytes, true), ptr));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_.emplace(reinterpret_cast<uintptr_t>(ptr), bytes);
    return Status::Ok();
  }
  Status unpin_host(void* ptr, size_t bytes) override {
    check_not_in_host_function("Device::unpin_host");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pinned_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == pinned_.end() || it->second != bytes)
        return InvalidArgument(fmt::format("unpin_host: {} ({} bytes) was not pinned by pin_host", ptr, bytes));
      pinned_.erase(it);
    }
    if (munlock(ptr, bytes) != 0) return ErrnoStatus(errno, fmt::format("munlock({} bytes at {})", bytes, ptr));
    return Status::Ok();
  }
  Result<void*> allocate_pinned_host(size_t bytes) override {
    check_not_in_host_function("Device::allocate_pinned_host");
    if (bytes == 0) return InvalidArgument("allocate_pinned_host: zero bytes");
    void* data = std::aligned_alloc(kPageBytes, round_up(bytes, kPageBytes));
    if (data == nullptr) return OutOfMemory(fmt::format("host allocation of {} failed", format_bytes(bytes, true)));
    Status st = pin_host(data, bytes);
    if (!st.ok()) {
      std::free(data);
      return st;
    }
    count_allocation(Tier::kPinnedHost, data, bytes);
    return data;
  }
  void free_pinned_host(void* ptr, size_t bytes) override {
    if (ptr == nullptr) return;
    count_free(Tier::kPinnedHost, ptr, bytes);
    unpin_host(ptr, bytes).ignore();  // munlock of our own mapping cannot fail in practice
    std::free(ptr);
  }

  // --- used by CpuStream ---
  void add_stream(CpuStream* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    streams_.insert(s);
  }
  void remove_stream(CpuStream* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    streams_.erase(s);
  }
  CopyEngine& engine_for(CopyKind kind) { return kind == CopyKind::kDeviceToHost ? d2h_engine_ : h2d_engine_; }

  Status check_device_range(const void* ptr, size_t bytes, std::string_view role) {
    if (bytes == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mutex_);
    if (range_in(allocations_, ptr, bytes)) return Status::Ok();
    return InvalidArgument(fmt::format(
        "cpu device: {} {} (+{} bytes) is not inside a live device allocation; pass memory from "
        "Device::allocate() (a host pointer here would fault on a GPU)",
        role, ptr, bytes));
  }
  bool host_range_pinned(const void* ptr, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    return range_in(pinned_, ptr, bytes);
  }
  Status check_copy(void* dst, const void* src, size_t bytes, CopyKind kind) {
    if (bytes == 0) return Status::Ok();
    if (dst == nullptr || src == nullptr)
      return InvalidArgument(fmt::format("{} copy of {} bytes with a null pointer", copy_kind_name(kind), bytes));
    if (kind != CopyKind::kHostToDevice) STRATA_RETURN_IF_ERROR(check_device_range(src, bytes, "copy source"));
    if (kind != CopyKind::kDeviceToHost) STRATA_RETURN_IF_ERROR(check_device_range(dst, bytes, "copy destination"));
    return Status::Ok();
  }
  void note_worker(bool entering) { tls_current_worker_device = entering ? this : nullptr; }

 protected:
  void free_device_memory(void* data, size_t bytes, bool synchronize_first) override {
    check_not_in_host_function("~DeviceBuffer (Device::free_device_memory)");
    (void)bytes;
    if (synchronize_first) synchronize().ignore();  // errors stay sticky on their streams
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = allocations_.find(reinterpret_cast<uintptr_t>(data));
    STRATA_CHECK(it != allocations_.end(), "cpu device: freeing memory it did not allocate (double free?)");
    in_use_bytes_ -= it->second.footprint_bytes;
    count_free(Tier::kDevice, data, it->second.footprint_bytes);
    allocations_.erase(it);
    std::free(data);
  }

 private:
  struct Allocation {
    size_t bytes;            // as requested: copies must stay inside these
    size_t footprint_bytes;  // rounded to 256: what counts against the capacity
  };
  static size_t range_bytes(size_t bytes) { return bytes; }
  static size_t range_bytes(const Allocation& a) { return a.bytes; }
  template <typename Ranges>
  static bool range_in(const Ranges& ranges, const void* ptr, size_t bytes) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    auto it = ranges.upper_bound(p);
    if (it == ranges.begin()) return false;
    --it;
    return p >= it->first && p + bytes >= p && p + bytes <= it->first + range_bytes(it->second);
  }

  DeviceCaps caps_;
  const uint64_t capacity_bytes_;
  std::mutex mutex_;
  uint64_t in_use_bytes_ = 0;
  std::map<uintptr_t, Allocation> allocations_;
  std::map<uintptr_t, size_t> pinned_;       // start -> bytes
  std::set<CpuStream*> streams_;
  CopyEngine h2d_engine_;  // H2D and D2D
  CopyEngine d2h_engine_;
};

CpuStream::CpuStream(CpuDevice* device) : Stream(device), cpu_device_(device) {
  device->add_stream(this);
  thread_ = std::thread([this] { run(); });
}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();  // drains the queue first
  cpu_device_->remove_stream(this);
}

// Note [Failed gates]
// A stream fails (sticky, as in CUDA) when a host function throws, when a
// Completion it waits on fails, or when an event it waits on was recorded
// after a failure on its own stream. From then on its work items are
// skipped (no copy or kernel runs on data that never arrived), while event
// records and record_completion() still complete, carrying the failure, so
// every waiter downstream learns the original Status instead of hanging or
// seeing a silent success.
void CpuStream::run() {
  cpu_device_->note_worker(true);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return (stop_ && queue_.empty()) || (!queue_.empty() && !running_inline_); });
    if (queue_.empty()) break;
    Op op = std::move(queue_.front());
    queue_.pop_front();
    const Status stream_error = sticky_error_;
    lock.unlock();
    Status outcome;
    std::unique_lock<std::mutex> host_rules;  // held while a host function runs under CUDA's rules
    if (stream_error.ok() || op.runs_after_failure) {
      if (op.host_function && cuda_host_rules()) {
        host_rules = std::unique_lock<std::mutex>(host_function_lock());
        tls_in_host_function = true;
      }
      try {
        outcome = op.fn(stream_error);
      } catch (const std::exception& e) {
        outcome = Internal(fmt::format("host function on a cpu stream threw: {}", e.what()));
      } catch (...) {
        outcome = Internal("host function on a cpu stream threw a non-std exception");
      }
    }
    // Captured state (buffers, completions) is dropped before progress is
    // reported; under the rules, still inside the host function, as a cuda
    // HostCall's is in its trampoline (a DeviceBuffer freed there would
    // synchronize the device from CUDA's callback thread).
    op = Op();
    tls_in_host_function = false;
    if (host_rules.owns_lock()) host_rules.unlock();
    lock.lock();
    if (!outcome.ok() && sticky_error_.ok()) sticky_error_ = std::move(outcome);
    ++completed_;
    done_cv_.notify_all();
  }
  cpu_device_->note_worker(false);
}

uint64_t CpuStream::enqueue(Op op) {
  uint64_t sequence;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(op));
    sequence = ++issued_;
  }
  work_cv_.notify_one();
  return sequence;
}

bool CpuStream::run_inline_if_idle(Op& op) {
  Status stream_error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_ != issued_ || running_inline_) return false;  // earlier work queued or running
    ++issued_;
    running_inline_ = true;
    stream_error = sticky_error_;
  }
  // As run() does (the ops that come here do not throw).
  const Status outcome = stream_error.ok() || op.runs_after_failure ? op.fn(stream_error) : Status::Ok();
  op = Op();
  bool queued_meanwhile;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!outcome.ok() && sticky_error_.ok()) sticky_error_ = outcome;
    ++completed_;
    running_inline_ = false;
    queued_meanwhile = !queue_.empty();
  }
  done_cv_.notify_all();
  if (queued_meanwhile) work_cv_.notify_one();  // (waking an idle worker for nothing would cost the switch saved)
  return true;
}

uint64_t CpuStream::enqueue_work(std::function<void()> fn, bool host_function) {
  return enqueue(Op{[fn = std::move(fn)](const Status&) {
                      fn();
                      return Status::Ok();
                    },
                    false, host_function});
}

void CpuStream::wait_for(uint64_t sequence) {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return completed_ >= sequence; });
}

Status CpuStream::copy_async(void* dst, const void* src, size_t bytes, CopyKind kind) {
  check_not_in_host_function("Stream::copy_async");
  STRATA_RETURN_IF_ERROR(cpu_device_->check_copy(dst, src, bytes, kind));
  if (bytes == 0) return Status::Ok();
  uint64_t sequence;
  if (bytes <= kInlineBytes) {
    Op small{[dst, src, bytes](const Status&) {
               std::memcpy(dst, src, bytes);
               return Status::Ok();
             },
             false};
    if (run_inline_if_idle(small)) return Status::Ok();
    sequence = enqueue(std::move(small));
  } else {
    CopyEngine* engine = &cpu_device_->engine_for(kind);
    sequence = enqueue_work([engine, dst, src, bytes] { engine->copy(dst, src, bytes); });
  }
  const void* host_side = kind == CopyKind::kHostToDevice ? src : kind == CopyKind::kDeviceToHost ? dst : nullptr;
  if (host_side != nullptr && !cpu_device_->host_range_pinned(host_side, bytes)) wait_for(sequence);
  return Status::Ok();
}

Status CpuStream::launch_host(HostFn fn) {
  check_not_in_host_function("Stream::launch_host");
  if (!fn) return InvalidArgument("launch_host: empty function");
  enqueue_work(std::move(fn), /*host_function=*/true);
  return Status::Ok();
}

Status CpuStream::record(Event& event) {
  check_not_in_host_function("Stream::record");
  auto* cpu_event = dynamic_cast<CpuEvent*>(&event);
  if (cpu_event == nullptr || &event.device() != &device())
    return InvalidArgument("Stream::record: the event belongs to another device; create it on this device");
  const uint64_t generation = cpu_event->begin_record();
  enqueue(Op{[state = cpu_event->state(), generation](const Status& stream_error) {
                state->complete(generation, stream_error);
                return Status::Ok();
              },
              true});
  return Status::Ok();
}

Status CpuStream::wait(Event& event) {
  check_not_in_host_function("Stream::wait(Event&)");
  auto* cpu_event = dynamic_cast<CpuEvent*>(&event);
  if (cpu_event == nullptr || &event.device() != &device())
    return InvalidArgument("Stream::wait: the event belongs to another device; record it on a stream of this device");
  const uint64_t generation = cpu_event->newest_generation();
  if (generation == 0) return Status::Ok();  // never recorded: nothing to wait for (as in CUDA)
  enqueue(Op{[state = cpu_event->state(), generation](const Status&) {
                Status st = state->wait_generation(generation);
                if (st.ok()) return st;
                return st.with_context("stream waited on an event recorded after a failure");
              },
              false});
  return Status::Ok();
}

Status CpuStream::wait(const Completion& completion) {
  check_not_in_host_function("Stream::wait(const Completion&)");
  if (completion.done() && completion.status().ok()) return Status::Ok();  // nothing to wait for
  // The stream's own worker waits in order: no thread is parked per gate.
  enqueue(Op{[completion](const Status&) {
                Status st = completion.wait();
                if (st.ok()) return st;
                const std::string label = completion.label();
                return label.empty() ? st : st.with_context(fmt::format("stream gated on '{}'", label));
              },
              false});
  return Status::Ok();
}

Completion CpuStream::record_completion() {
  check_not_in_host_function("Stream::record_completion");
  if (!cuda_host_rules()) {  // on CUDA it is always a host function, whose continuations run on the callback thread
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_ == issued_ && !running_inline_) return Completion::ready(sticky_error_, "cpu stream work");
  }
  auto source = std::make_shared<CompletionSource>("cpu stream work");
  Completion done = source->completion();
  enqueue(Op{[source](const Status& stream_error) {
                source->complete(stream_error);
                return Status::Ok();
              },
              true, /*host_function=*/true});
  return done;
}

Status CpuStream::synchronize() {
  check_not_in_host_function("Stream::synchronize");
  STRATA_CHECK(tls_current_worker_device != cpu_device_,
               "a host function synchronized a stream of its own device: this deadlocks");
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = issued_;
  done_cv_.wait(lock, [&] { return completed_ >= target; });
  return sticky_error_;
}

bool CpuStream::query() {
  check_not_in_host_function("Stream::query");
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= issued_;
}

Status CpuStream::memset_async(void* dst, int value, size_t bytes) {
  check_not_in_host_function("Stream::memset_async");
  STRATA_RETURN_IF_ERROR(cpu_device_->check_device_range(dst, bytes, "memset destination"));
  if (bytes == 0) return Status::Ok();
  Op op{[dst, value, bytes](const Status&) {
          std::memset(dst, value, bytes);
          return Status::Ok();
        },
        false};
  if (bytes <= kInlineBytes && run_inline_if_idle(op)) return Status::Ok();
  enqueue(std::move(op));
  return Status::Ok();
}

Status CpuStream::free_async(DeviceBuffer&& buffer) {
  check_not_in_host_function("Stream::free_async");
  if (!buffer) return Status::Ok();
  if (buffer.device() != &device()) return InvalidArgument("Stream::free_async: the buffer belongs to another device");
  const size_t bytes = buffer.size_bytes();
  void* data = buffer.release();
  Device* dev = &device();
  Op op{[dev, data, bytes](const Status&) {
          release_device_memory(*dev, data, bytes);
          return Status::Ok();
        },
        true};
  if (!run_inline_if_idle(op)) enqueue(std::move(op));
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Device>> make_cpu_device(const DeviceOptions& options) {
  if (options.device_memory_bytes == 0)
    return InvalidArgument("cpu device: device_memory_bytes (--device-memory) must be > 0, e.g. 256MiB");
  return std::unique_ptr<Device>(std::make_unique<CpuDevice>(options.device_memory_bytes));
}

}  // namespace strata::detail
