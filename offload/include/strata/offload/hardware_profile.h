#pragma once
// A hardware profile: the component rates of one machine that the step-time
// model (step_time_model.h) predicts a training step from. `strata report
// --calibrate` measures one; profiles of other machines are written by hand
// from datasheets (examples/profiles/). JSON, every rate required, positive
// and within physical bounds (Note [Physical bounds of a profile's rates] in
// hardware_profile.cpp), byte counts whole; unknown and duplicate keys are
// errors (a misspelt rate must not silently become a default):
//
//   {"name": "dgx-h100", "gpus_per_node": 8, "shared_cores": false,
//    "device_memory_bytes": 80e9, "host_memory_bytes": 2e12, "nvme_bytes": 30.72e12,
//    "compute_gflops": 400000, "h2d_gb_per_s": 55, "d2h_gb_per_s": 55,
//    "collective_bus_gb_per_s": 360, "nvme_read_gb_per_s": 25, "nvme_write_gb_per_s": 12,
//    "cpu_adam_params_per_s": {"fp32": 3e9, "bf16": 2.5e9}, "device_adam_params_per_s": 150e9,
//    "notes": "...", "sources": ["datasheet ..."], "calibration": {...}}
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/moment_storage.h"

namespace strata::offload {

struct HardwareProfile {
  std::string name;
  int gpus_per_node = 1;
  // The device's compute, its copies, the collectives and the CPU optimizer
  // all run on the same host cores (the cpu device): nothing truly overlaps,
  // and ranks of one node share every rate.
  bool shared_cores = false;
  // With shared_cores: the model's compute and the CPU optimizer were given
  // separate cores (strata train --device-threads D --optimizer-threads K,
  // D + K <= the host's cores; `strata report --calibrate
  // --calibrate-device-threads D --calibrate-optimizer-threads K`), so the
  // optimizer and its NVMe traffic overlap the compute as on a GPU machine.
  // The copies and collectives still share the cores, and the engine's auto
  // rule for early updates is still the cpu device's.
  bool optimizer_on_own_cores = false;
  uint64_t device_memory_bytes = 0;  // per device
  uint64_t host_memory_bytes = 0;    // per node
  uint64_t nvme_bytes = 0;           // per node
  double compute_gflops = 0;         // per device: training FLOPs / (forward + backward time) for the model's shapes
  double h2d_gb_per_s = 0;           // per device, pinned host -> device
  double d2h_gb_per_s = 0;           // per device
  double collective_bus_gb_per_s = 0;  // per rank, nccl-tests' busbw
  double nvme_read_gb_per_s = 0;       // per node, at the profile's aio settings
  double nvme_write_gb_per_s = 0;      // per node
  double cpu_adam_params_per_s_fp32 = 0;  // per node, all cores: fp32 gradients, no parameter copy
  double cpu_adam_params_per_s_bf16 = 0;  // per node, all cores: bf16 gradients, bf16 parameter copy out
  // Per node, all cores: bf16 gradients and copy, block-wise 8-bit moments
  // (strata.optimizer_state_dtype int8). Optional in a profile: 0 (not
  // given) uses the bf16 rate.
  double cpu_adam_params_per_s_int8 = 0;
  double device_adam_params_per_s = 0;    // per device: the optimizer state kept on the device (offload none)
  // Kept as given (documentation, the calibration's raw measurements).
  nlohmann::ordered_json notes, sources, calibration;

  // CPU Adam parameters per second for a parameter dtype (fp16 counts as
  // bf16: same bytes) and moment storage (8-bit moments: their own rate).
  double cpu_adam_params_per_s(DType param_dtype, const cpu_adam::MomentStorage& moments) const {
    if (moments.blocked() && cpu_adam_params_per_s_int8 > 0) return cpu_adam_params_per_s_int8;
    return param_dtype == DType::kF32 ? cpu_adam_params_per_s_fp32 : cpu_adam_params_per_s_bf16;
  }
};

// Parses and checks a profile; errors name `source`, the key and the fix.
// The built-in profile of the cpu device when the caller gives none: round
// rates, good for ranking placements against each other (relative), not for
// predicting a step's seconds (`strata plan --fit` without --profile,
// strata.torch's fit).
HardwareProfile builtin_cpu_profile();
// "" or a note when the profile's compute rate was timed in another parameter
// dtype than `rows` (calibration.compute.dtype, which `strata report
// --calibrate --calibrate-dtype` writes): on a CPU fp32 and bf16 matmuls run
// at different rates, so the prediction's compute would be off.
std::string compute_dtype_note(const HardwareProfile& profile, DType rows);
// "" or a note when the cpu device's rows run on other thread counts than the
// profile was calibrated at (calibration.compute.device_threads and
// calibration.cpu_adam.rate_threads; 0 = every core): the compute rate and
// optimizer_on_own_cores then do not describe these rows.
std::string thread_count_note(const HardwareProfile& profile, int device_threads, int optimizer_threads);
Result<HardwareProfile> parse_hardware_profile(const nlohmann::json& json, const std::string& source);
// Reads `path` strictly (strata/core/json_file.h: bounded, regular files only,
// no duplicate keys); errors name the file (callers add their flag).
Result<HardwareProfile> load_hardware_profile(const std::string& path);
nlohmann::ordered_json hardware_profile_to_json(const HardwareProfile& profile);

}  // namespace strata::offload
