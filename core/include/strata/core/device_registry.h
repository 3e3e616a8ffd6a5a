#pragma once
// Device backends by name: make_device("cpu", options) / make_device("cuda"),
// and the one DeviceKind the whole project uses to name them (the config's
// "strata.device", `strata train --device`, the model's executor).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/device.h"

namespace strata {

// What to run on. kAuto is a request, never a device: resolve_device_kind()
// turns it into kCuda when a GPU is usable here, else kCpu.
enum class DeviceKind : uint8_t { kAuto, kCpu, kCuda };

std::string_view device_kind_name(DeviceKind kind);  // "auto" | "cpu" | "cuda"
// "auto" | "cpu" | "cuda"; anything else is InvalidArgument naming `what`
// (e.g. "--device") and the choices.
Result<DeviceKind> parse_device_kind(std::string_view name, std::string_view what = "device");

struct DeviceChoice {
  DeviceKind kind = DeviceKind::kCpu;  // never kAuto
  bool automatic = false;              // resolved from kAuto
  std::string reason;                  // why this one: "auto: cuda (NVIDIA H200, ...)" / "auto: cpu (cuda: ...)"
};
// kCpu and kCuda are returned as they are (a cuda that cannot run fails
// later, at make_device, with the reason); kAuto picks cuda when the cuda
// backend is compiled and available, else cpu, and says why.
DeviceChoice resolve_device_kind(DeviceKind requested);

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
// The same by kind; kAuto is resolved first (resolve_device_kind).
Result<std::unique_ptr<Device>> make_device(DeviceKind kind, const DeviceOptions& options = {});

}  // namespace strata
