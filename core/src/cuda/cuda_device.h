#pragma once
// Internal: the cuda backend (cuda_device.cpp). Only compiled with STRATA_HAVE_CUDA.
#include <memory>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"

namespace strata::detail {

// Probes the driver: available iff cudaGetDeviceCount succeeds with > 0.
BackendInfo probe_cuda();
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options);

}  // namespace strata::detail
