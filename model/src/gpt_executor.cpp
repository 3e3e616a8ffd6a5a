#include "strata/model/gpt_executor.h"

#include <sys/sysinfo.h>

#include <unordered_map>

#include <fmt/format.h>

#include "cpu_backend.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#include "executor_impl.h"

#if STRATA_HAVE_CUDA
#include "cuda/cuda_executor.h"
#endif

namespace strata::model {
namespace detail {

// Device memory from a core strata::Device (the cpu backend: host memory
// under a capacity, with per-tier stats).
class CoreDeviceAllocator final : public DeviceAllocator {
 public:
  explicit CoreDeviceAllocator(std::unique_ptr<Device> device) : device_(std::move(device)) {}
  ~CoreDeviceAllocator() override { buffers_.clear(); }
  Result<void*> allocate(size_t bytes, std::string_view what) override {
    Result<DeviceBuffer> buf = device_->allocate(bytes);
    if (!buf.ok())
      return buf.status().with_context(fmt::format("allocating {} for {} on the {} device (lower --batch or --seq, or "
                                                   "raise --device-memory)",
                                                   format_bytes(bytes, true), what, device_->caps().backend));
    void* p = buf->data();
    buffers_.emplace(p, std::move(buf).value());
    return p;
  }
  void free(void* ptr, size_t) override { buffers_.erase(ptr); }
  uint64_t current_bytes() const override { return device_->memory_stats().get(Tier::kDevice).current_bytes; }
  uint64_t peak_bytes() const override { return device_->memory_stats().get(Tier::kDevice).peak_bytes; }
  uint64_t capacity_bytes() const override { return device_->caps().memory_bytes; }

 private:
  std::unique_ptr<Device> device_;
  std::unordered_map<void*, DeviceBuffer> buffers_;
};

uint64_t default_cpu_device_bytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return uint64_t{4} << 30;
  return static_cast<uint64_t>(info.totalram) * info.mem_unit / 4;
}

}  // namespace detail

Result<DeviceKind> parse_device_kind(std::string_view name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name == "cuda") return DeviceKind::kCuda;
  return InvalidArgument(fmt::format("--device '{}' is not a device; use cpu or cuda", name));
}

std::string_view device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCpu ? "cpu" : "cuda"; }

bool cuda_device_available(std::string* why) {
#if STRATA_HAVE_CUDA
  return detail::cuda_probe(why);
#else
  if (why != nullptr) *why = "this build has no CUDA (the CUDA Toolkit was not found at configure time)";
  return false;
#endif
}

Result<std::unique_ptr<GptExecutor>> GptExecutor::create(const GptModel& model, DeviceKind device, int batch,
                                                         int seq_len, uint64_t device_capacity_bytes) {
  const GptConfig& cfg = model.config();
  if (batch < 1 || batch > 65536)
    return InvalidArgument(fmt::format("--batch {} is invalid; use 1..65536", batch));
  if (seq_len < 1 || seq_len > cfg.max_seq_len)
    return InvalidArgument(fmt::format("--seq {} is invalid for preset '{}': use 1..{} (or raise --max-seq)", seq_len,
                                       cfg.preset, cfg.max_seq_len));
  if (device == DeviceKind::kCuda) {
#if STRATA_HAVE_CUDA
    return detail::make_cuda_executor(model, batch, seq_len, device_capacity_bytes);
#else
    return Unsupported("--device cuda: this build has no CUDA; rebuild with the CUDA Toolkit or use --device cpu");
#endif
  }
  DeviceOptions options;
  options.device_memory_bytes = device_capacity_bytes != 0 ? device_capacity_bytes : detail::default_cpu_device_bytes();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> cpu, make_device("cpu", options));
  auto alloc = std::make_unique<detail::CoreDeviceAllocator>(std::move(cpu));
  auto impl = std::make_unique<detail::ExecutorImpl<detail::CpuOps<float>>>(
      model, device, batch, seq_len, std::make_unique<detail::CpuOps<float>>(), std::move(alloc));
  STRATA_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<GptExecutor>(std::move(impl));
}

}  // namespace strata::model
