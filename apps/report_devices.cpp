// `strata report` sections of the core layer: device backends (cpu
// capacity default; cuda driver/runtime versions and devices, or the exact
// reason there are none), the pinned memory probe, and which bulk dtype
// conversion path is used (STRATA_CONVERT_PATH forces one).
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "engine_run.h"
#include "strata/core/device_registry.h"
#include "strata/core/dtype_convert.h"
#include "strata/core/pinned_pool.h"
#include "strata/core/units.h"

namespace strata::cli {
namespace {

std::string cuda_version_text(int version) {
  if (version <= 0) return "none";
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

void fill_devices(nlohmann::json& s, const std::string&) {
  for (const BackendInfo& b : list_backends()) {
    nlohmann::json j;
    j["compiled"] = b.compiled;
    j["available"] = b.available;
    j[b.available ? "detail" : "reason"] = b.reason;
    // What the CLI's commands give the cpu device without --device-memory
    // (the library's own DeviceOptions default is smaller: docs/core.md).
    if (b.name == "cpu")
      j["default_device_memory"] = format_bytes(default_cpu_device_bytes(), true) + " (a quarter of host memory)";
    if (b.name == "cuda" && b.compiled) {
      j["driver_version"] = cuda_version_text(b.driver_version);
      j["runtime_version"] = cuda_version_text(b.runtime_version);
    }
    if (b.available) {
      j["device_count"] = b.device_count;
      j["devices"] = b.devices;
    }
    s[b.name] = j;
  }
}

void fill_pinned(nlohmann::json& s, const std::string&) {
  const PinningProbe probe = probe_pinning();
  s["pinning_works"] = probe.works;
  s["memlock_limit"] = probe.memlock_limit_bytes == UINT64_MAX ? std::string("unlimited")
                                                               : format_bytes(probe.memlock_limit_bytes, true);
  s["memlock_limit_applies"] = !probe.ipc_lock_capability;  // CAP_IPC_LOCK: mlock ignores the limit
  s["probe"] = probe.detail;
  s["fallback"] = "pageable host memory, one warning (PinnedPool)";
}

void fill_dtype(nlohmann::json& s, const std::string&) {
  s["active_path"] = std::string(convert_path_name(active_convert_path()));
  std::string available;
  for (ConvertPath p : available_convert_paths())
    available += (available.empty() ? "" : ", ") + std::string(convert_path_name(p));
  s["available_paths"] = available;
  s["force_with"] = "STRATA_CONVERT_PATH=scalar|avx2|avx512|avx512bf16";
}

ReportSectionRegistration devices_section(30, "devices", fill_devices);
ReportSectionRegistration pinned_section(31, "pinned_memory", fill_pinned);
ReportSectionRegistration dtype_section(32, "dtype_conversion", fill_dtype);

}  // namespace
}  // namespace strata::cli
