// Backend registry: which device backends exist, whether they can run
// here and why not, and construction by name.
#include "strata/core/device_registry.h"

#include <fmt/format.h>

#include "cpu_device.h"
#include "strata/core/units.h"
#if defined(STRATA_HAVE_CUDA)
#include "cuda/cuda_device.h"
#endif

namespace strata {

namespace {

BackendInfo cpu_info() {
  BackendInfo info;
  info.name = "cpu";
  info.compiled = true;
  info.available = true;
  info.device_count = 1;
  info.reason = fmt::format("host memory under a capacity limit (default {}, --device-memory)",
                            format_bytes(DeviceOptions{}.device_memory_bytes, true));
  info.devices.push_back("0: cpu");
  return info;
}

BackendInfo cuda_info() {
#if defined(STRATA_HAVE_CUDA)
  return detail::probe_cuda();
#else
  BackendInfo info;
  info.name = "cuda";
  info.compiled = false;
  info.available = false;
  info.reason = "this build has no CUDA (CUDA Toolkit not found at configure time, or -DSTRATA_ENABLE_CUDA=OFF)";
  return info;
#endif
}

}  // namespace

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto: return "auto";
    case DeviceKind::kCpu: return "cpu";
    case DeviceKind::kCuda: return "cuda";
  }
  return "?";
}

Result<DeviceKind> parse_device_kind(std::string_view name, std::string_view what) {
  for (DeviceKind k : {DeviceKind::kAuto, DeviceKind::kCpu, DeviceKind::kCuda})
    if (name == device_kind_name(k)) return k;
  return InvalidArgument(fmt::format("{} '{}' is not a device; use cpu, cuda or auto", what, name));
}

DeviceChoice resolve_device_kind(DeviceKind requested) {
  if (requested != DeviceKind::kAuto) return {requested, false, "requested"};
  const BackendInfo cuda = cuda_info();
  if (cuda.available) {
    const std::string first = cuda.devices.empty() ? std::string("a GPU") : cuda.devices.front();
    return {DeviceKind::kCuda, true, fmt::format("auto: cuda ({})", first)};
  }
  return {DeviceKind::kCpu, true, fmt::format("auto: cpu (cuda: {})", cuda.reason)};
}

std::vector<BackendInfo> list_backends() { return {cpu_info(), cuda_info()}; }

Result<std::unique_ptr<Device>> make_device(std::string_view backend, const DeviceOptions& options) {
  if (backend == "cpu") return detail::make_cpu_device(options);
  if (backend == "cuda") {
    BackendInfo info = cuda_info();
    if (!info.available) return Unavailable(fmt::format("device backend 'cuda' is not available: {}", info.reason));
#if defined(STRATA_HAVE_CUDA)
    return detail::make_cuda_device(options);
#endif
  }
  return NotFound(fmt::format("unknown device backend '{}' (known: cpu, cuda)", backend));
}

Result<std::unique_ptr<Device>> make_device(DeviceKind kind, const DeviceOptions& options) {
  return make_device(device_kind_name(resolve_device_kind(kind).kind), options);
}

}  // namespace strata
