#pragma once
// Device backends by name: make_device("cpu", options) / make_device("cuda").

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/device.h"

namespace strata {

struct BackendInfo {
  std::string name;            // "cpu", "cuda"
  bool compiled = false;       // part of this build
  bool available = false;      // usable on this machine now
  std::string reason;          // why not available, or a short description
  int device_count = 0;
  int driver_version = 0;      // cuda: cudaDriverGetVersion (e.g. 13000), else 0
  int runtime_version = 0;     // cuda: cudaRuntimeGetVersion
  std::vector<std::string> devices;  // "0: NVIDIA H200 (139.8 GiB, sm_90)"
};

// Every backend known to Strata, compiled in or not, probed now.
std::vector<BackendInfo> list_backends();

// NotFound for an unknown name (lists the known ones); Unavailable with the
// reason (e.g. "cudaGetDeviceCount: no CUDA driver") when it cannot run here;
// InvalidArgument for bad options (e.g. a zero device_memory_bytes).
Result<std::unique_ptr<Device>> make_device(std::string_view backend, const DeviceOptions& options = {});

}  // namespace strata
