#pragma once
// Note [Testing seam]
// Engines with injected faults, for tests and the `strata-testing` binary
// only. The library strata_offload_testing and this header are built from
// the source tree and never installed: a release build (the `strata` CLI,
// Strata::strata) has no way to poison a gradient, swap the NVMe I/O engine
// or SIGKILL itself at a checkpoint's commit. EngineOptions carries none of
// these; Engine befriends EngineSeam, which hands the faults to the engine
// before it is initialized (so the NVMe tiers open through the given I/O
// engines).
//
//   testing::EngineFaults f;
//   f.gradient = testing::GradientFault{.step = 4, .rank = 1, .layer = 1, .value = INFINITY};
//   auto engine = testing::create_engine(options, runner, device, comm, f);
#include <memory>

#include "strata/offload/engine.h"
#include "strata/offload/testing/engine_faults.h"

namespace strata::offload::testing {

class EngineSeam {
 public:
  // Engine::create (both overloads) with `faults`.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options, ModelRunner& runner, Device& device,
                                                comm::Communicator& comm, const EngineFaults& faults);
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options, const LayeredModel& model,
                                                Device& device, comm::Communicator& comm,
                                                const EngineFaults& faults, Stream* model_stream = nullptr);
};

inline Result<std::unique_ptr<Engine>> create_engine(const EngineOptions& options, ModelRunner& runner,
                                                     Device& device, comm::Communicator& comm,
                                                     const EngineFaults& faults) {
  return EngineSeam::create(options, runner, device, comm, faults);
}
inline Result<std::unique_ptr<Engine>> create_engine(const EngineOptions& options, const LayeredModel& model,
                                                     Device& device, comm::Communicator& comm,
                                                     const EngineFaults& faults, Stream* model_stream = nullptr) {
  return EngineSeam::create(options, model, device, comm, faults, model_stream);
}

}  // namespace strata::offload::testing
