#pragma once
// Internal: the cuda backend (cuda_device.cpp). Only compiled with STRATA_HAVE_CUDA.
#include <memory>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"

namespace strata::detail {

// Probes the driver: available iff cudaGetDeviceCount succeeds with > 0.
BackendInfo probe_cuda();
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options);
// Note [Borrowed streams]: `device` must be a cuda device; `native_handle` a
// cudaStream_t of its GPU (null: the legacy default stream).
Result<std::unique_ptr<Stream>> borrow_cuda_stream(Device& device, void* native_handle);

}  // namespace strata::detail
