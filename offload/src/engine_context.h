#pragma once
// EngineContext: what every component of one rank's engine reads (Note [How
// the engine is built] in docs/engine.md): the options, the partition and
// the placement (set once in init), the device, the communicator, the copy
// streams, the engine's memory accounts, and three services: the per-step
// transfer counters, the step's failures (StepFailures) and the bounded
// waits that stop the engine when one expires. Private to offload/src.
//
// It holds no component's state: parameters are ParameterGathering's,
// gradients GradientReduction's, optimizer state UpdateScheduler's, the
// pending step CommitPoint's.
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "strata/comm/communicator.h"
#include "strata/core/device.h"
#include "strata/core/dtype_convert.h"
#include "strata/core/layered_model.h"
#include "strata/core/memory_stats.h"
#include "strata/core/units.h"
#include "strata/offload/engine.h"
#include "strata/offload/partition.h"
#include "strata/offload/state_placement.h"
#include "fault_hooks.h"

namespace strata::offload {
namespace engine_detail {

class GradientSpill;  // gradient_spill.h

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }
inline int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// Pinned host memory from the Device, which counts it in the engine's stats
// (Note [Accounts] in strata/core/device.h).
class HostBuffer {
 public:
  HostBuffer() = default;
  static Result<HostBuffer> create(Device& device, MemoryStats& stats, size_t bytes, const std::string& what) {
    Result<void*> p = device.allocate_pinned_host(bytes == 0 ? 64 : bytes, stats);
    if (!p.ok())
      return OutOfMemory(fmt::format("{} ({}) could not be allocated in pinned host memory: {}", what,
                                     format_bytes(bytes, true), p.status().message()));
    HostBuffer b;
    b.device_ = &device;
    b.data_ = static_cast<std::byte*>(*p);
    b.bytes_ = bytes == 0 ? 64 : bytes;
    std::memset(b.data_, 0, b.bytes_);
    return b;
  }
  HostBuffer(HostBuffer&& o) noexcept { swap(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    HostBuffer t(std::move(o));
    swap(t);
    return *this;
  }
  ~HostBuffer() {
    if (data_ != nullptr) device_->free_pinned_host(data_, bytes_);
  }
  std::byte* data() const { return data_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void swap(HostBuffer& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
  }
  Device* device_ = nullptr;
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

// Parameters from fp32 master values: rounded to the parameters' dtype, as
// every step writes them (a load and a rollback derive them the same way).
inline void master_to_params(DType param_dtype, const float* master, std::byte* params, size_t n) {
  if (param_dtype == DType::kF32) std::memcpy(params, master, n * sizeof(float));
  else if (param_dtype == DType::kBF16) convert_fp32_to_bf16(master, reinterpret_cast<bfloat16*>(params), n);
  else convert_fp32_to_fp16(master, reinterpret_cast<float16*>(params), n);
}

// The inverse: parameters (any state dtype) widened to fp32 values, exactly.
inline void params_to_fp32(DType param_dtype, const std::byte* params, float* values, size_t n) {
  if (param_dtype == DType::kF32) std::memcpy(values, params, n * sizeof(float));
  else if (param_dtype == DType::kBF16) convert_bf16_to_fp32(reinterpret_cast<const bfloat16*>(params), values, n);
  else convert_fp16_to_fp32(reinterpret_cast<const float16*>(params), values, n);
}

// Which of a step's failures (Note [Atomic steps] in engine.h): an update
// (rolled back at the commit point), a parameter read the call's passes
// used (the call is dropped), or an update of state kept in place that
// failed part-way (kTorn: no rollback can undo it; the engine stops).
enum class FailureOf : uint8_t { kUpdate, kCall, kTorn };

// The first failure of each kind since it was last taken, recorded from any
// thread (the optimizer thread, the shard reader, I/O completions) and taken
// by the driving thread at the commit point.
class StepFailures {
 public:
  void record(FailureOf of, const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    Status& slot = slot_of(of);
    if (slot.ok()) slot = s;
  }
  Status take(FailureOf of) {
    std::lock_guard<std::mutex> lock(mu_);
    Status& slot = slot_of(of);
    Status s = std::move(slot);
    slot = Status::Ok();
    return s;
  }
  // `c`, completing ok once `c` has completed; c's failure is recorded as
  // `of`, so what later work waits on never fails and every rank runs the
  // same collectives up to the commit point's vote.
  Completion absorb(const Completion& c, const std::string& label, FailureOf of = FailureOf::kUpdate) {
    auto out = std::make_shared<CompletionSource>(label);
    Completion result = out->completion();
    c.then([this, out, of, label](const Status& st) {
      // A read's error names the file and offset; the label names the layer.
      if (!st.ok()) record(of, of == FailureOf::kCall ? st.with_context(label) : st);
      out->complete(Status::Ok());
    });
    return result;
  }

 private:
  Status& slot_of(FailureOf of) { return of == FailureOf::kUpdate ? update_ : of == FailureOf::kCall ? call_ : torn_; }
  std::mutex mu_;
  Status update_, call_, torn_;
};

// Bytes one step moved per link (StepMetrics), counted by the components
// that queue the transfers; reset at begin_step.
struct TransferCounters {
  uint64_t h2d_bytes = 0, d2h_bytes = 0, gather_bytes = 0, reduce_bytes = 0;
};

struct EngineContext {
  EngineContext(const EngineOptions& o, const LayeredModel& m, Device& d, comm::Communicator& c)
      : opt(o), model(m), device(d), comm(c), world(c.world_size()), rank(c.rank()) {}

  EngineOptions opt;
  FaultHooks faults;  // a test's faults (fault_hooks.h); none unless created through the testing seam
  const LayeredModel& model;
  Device& device;
  comm::Communicator& comm;
  int world = 1, rank = 0;
  Partition part;
  // Every placement decision, made once in init() (Note [State placement]).
  StatePlacement placement;
  // What this engine holds: device (its own buffers and device optimizer
  // state, not the model's activations) and pinned host memory as the
  // Device counts them (Note [Accounts] in strata/core/device.h: every
  // allocation of those goes through device.allocate(bytes, stats)),
  // pageable host memory and NVMe bytes as the engine counts them.
  MemoryStats stats;
  std::unique_ptr<Stream> xfer;   // copies and memsets
  std::unique_ptr<Stream> frees;  // only frees: never gated
  // Zeroing of gradient buffers (Note [Gradient buffers zeroed apart]):
  // gated only by the last step's readers of a kept buffer.
  std::unique_ptr<Stream> zeroing;
  // Host-to-device copies of parameter shards kept in host memory, before
  // their gather: apart from `xfer`, whose gradient copies out wait for the
  // backward (Note [Gradient buffers zeroed apart] says why that matters).
  std::unique_ptr<Stream> shard_h2d;
  int64_t steps_begun = 0;        // steps begun (gradients are zeroed once per step, by this number)
  TransferCounters transfers;     // this step's
  StepFailures failures;
  // Note [Gradient shards on NVMe]: set in init() where the placement puts
  // gradient shards on NVMe (owned by the engine), null otherwise.
  GradientSpill* gradient_spill = nullptr;

  // The engine's health: `stopped` not ok means it refuses to go on (an
  // error it could not recover from); `recovered` says the error being
  // returned came with a completed rollback, `recovery` what it did.
  Status stopped;
  bool recovered = false;
  StepOutcomeKind recovery = StepOutcomeKind::kDropped;
  // Not ok after a load_checkpoint() that failed once it had begun to write
  // the state (Note [A failed load] in engine.h): every step, save and use
  // of a trained layer is refused with it until a load succeeds.
  Status load_failed;

  // The placement's answers every component asks.
  const LayerPlacement& where(size_t li) const { return placement.layers[li]; }
  bool stage0() const { return placement.owns_every_piece(); }
  bool opt_on_host() const { return placement.optimizer_on_host(); }  // cpu and nvme placements
  bool opt_on_nvme() const { return placement.optimizer_on_nvme(); }
  bool param_on_host() const { return placement.param_shards_off_device(); }  // stage-3 shards off the device
  bool grads_in_place() const { return placement.gradients_in_place; }
  bool split() const { return placement.split; }
  // The fused device Adam kernel steps the state on its own stream, and each
  // layer's reduced gradient is also copied D2H for the norm.
  bool device_opt() const { return placement.device_kernel; }
  size_t grad_bytes() const { return dtype_size(opt.grad_dtype); }  // per gradient element
  size_t host_n(size_t count) const { return host_part(placement.ratio, count); }
  // Owned pieces: every rank's at stage 0, this rank's otherwise; the owned
  // layout is padded space at stage 0 and the shard layout otherwise.
  int owned_rank_begin() const { return placement.owned_rank_begin(); }
  int owned_rank_end() const { return placement.owned_rank_end(); }
  size_t owned_offset(const LayerPartition& layer_part, const SubGroup& g, int r) const {
    return placement.owned_offset(layer_part, g, r);
  }
  size_t owned_elements(const LayerPartition& layer_part) const { return placement.owned_elements(layer_part); }

  std::string layer_label(size_t li) const { return fmt::format("layer {} '{}'", li, printable(part.layer(li).name, 64)); }
  std::string state_name(size_t layer, size_t group, int r) const {
    return part.describe(StateId{static_cast<uint32_t>(layer), static_cast<uint32_t>(group), r});
  }

  // `what` names the buffer in the error: a string, or a callable that
  // makes one (on the per-layer paths: formatted only when it fails).
  template <class What>
  Result<DeviceBuffer> alloc_device(size_t bytes, const What& what) {
    Result<DeviceBuffer> b = device.allocate(bytes == 0 ? 64 : bytes, stats);  // the device counts it in stats
    if (b.ok()) return b;
    std::string name;
    if constexpr (std::is_invocable_v<const What&>) name = what();
    else name = what;
    return OutOfMemory(fmt::format("{} ({}) does not fit in device memory on rank {}: {}", name,
                                   format_bytes(bytes, true), rank, b.status().message()));
  }

  // Note [Bounded waits] in engine.h: ok once `c` has completed, failed or
  // not (the caller reads c.status()), within opt.wait_timeout_s; else
  // DeadlineExceeded naming `what`, c's label, the time waited and the key
  // to raise, and the engine stops. The driving thread's waits go through it.
  Status wait_bounded(const Completion& c, std::string_view what);
  std::chrono::nanoseconds wait_bound() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(opt.wait_timeout_s));
  }
  // `c`'s Status (its failure in the context of `what`), waited for through wait_bounded.
  Status wait_status(const Completion& c, std::string_view what) {
    STRATA_RETURN_IF_ERROR(wait_bounded(c, what));
    return c.status().with_context(what);
  }
  // The destructor's wait: nothing can be freed before `c` completes, so
  // after the bound it says on stderr what it waits for and waits on.
  void wait_at_teardown(const Completion& c, std::string_view what) const;
  // The error an engine method returns: when it did not come with a
  // completed rollback, the engine stops (every later call gets it).
  Status stop_unless_recovered(Status error);
};

}  // namespace engine_detail
}  // namespace strata::offload
