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

}  // namespace strata
