#pragma once
#include <cmath>
#include <memory>
#include <vector>

#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/layered_model.h"
#include "strata/core/memory_stats.h"
#include "strata/model/rng.h"
#include "strata/offload/resident_provider.h"

namespace strata::model::testing {

template <typename T>
std::vector<T> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed, 7);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(scale * rng.normal());
  return v;
}

// |a - b| <= atol + rtol * |b|
inline bool close(double a, double b, double rtol, double atol) { return std::abs(a - b) <= atol + rtol * std::abs(b); }

// A cpu device and one stream on it, for an executor. Declare it before
// the executor (it must outlive it).
struct CpuRig {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
};
inline CpuRig cpu_rig(uint64_t capacity_bytes = uint64_t{1} << 30) {
  DeviceOptions o;
  o.device_memory_bytes = capacity_bytes;
  CpuRig rig;
  rig.device = make_device("cpu", o).value();
  rig.stream = rig.device->create_stream().value();
  return rig;
}

// Every layer resident in host memory (the stage-0 provider of offload/).
inline std::unique_ptr<offload::ResidentProvider> resident(const LayeredModel& model) {
  static MemoryStats stats;
  return offload::ResidentProvider::create(model, stats).value();
}

}  // namespace strata::model::testing
