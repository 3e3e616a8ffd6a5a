// The testing seam: see Note [Testing seam] in engine_seam.h.
#include "strata/offload/testing/engine_seam.h"

namespace strata::offload::testing {

Result<std::unique_ptr<Engine>> EngineSeam::create(const EngineOptions& options, ModelRunner& runner, Device& device,
                                                   comm::Communicator& comm, const EngineFaults& faults) {
  return Engine::create_with_faults(options, &runner, runner.model(), device, comm, nullptr, &faults);
}

Result<std::unique_ptr<Engine>> EngineSeam::create(const EngineOptions& options, const LayeredModel& model,
                                                   Device& device, comm::Communicator& comm,
                                                   const EngineFaults& faults, Stream* model_stream) {
  return Engine::create_with_faults(options, nullptr, model, device, comm, model_stream, &faults);
}

}  // namespace strata::offload::testing
