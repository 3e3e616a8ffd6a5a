// The cpu device under CUDA's host-function rules
// (STRATA_CPU_DEVICE_CUDA_HOST_RULES=1, Note [CUDA's host-function rules] in
// core/src/cpu_device.cpp): a Device or Stream call from a host function, or
// from a continuation that a completed stream ran, stops the process with
// the call's name, as it would misbehave on a GPU. Each case runs in a
// death-test child, which sets the variable before the device reads it (the
// device reads it once per process). The engine's run under the rules is
// the ctest apps.train_under_cuda_host_rules.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"

namespace strata {
namespace {

std::unique_ptr<Device> cpu_device_under_cuda_rules() {
  setenv("STRATA_CPU_DEVICE_CUDA_HOST_RULES", "1", 1);
  DeviceOptions options;
  options.device_memory_bytes = 1u << 20;
  return std::move(make_device("cpu", options)).value();
}

class CudaHostRules : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(CudaHostRules, AStreamCallFromAHostFunctionStopsTheProcess) {
  EXPECT_DEATH(
      {
        auto device = cpu_device_under_cuda_rules();
        auto stream = std::move(device->create_stream()).value();
        DeviceBuffer buffer = std::move(device->allocate(256)).value();
        Stream* raw = stream.get();
        void* data = buffer.data();
        (void)stream->launch_host([raw, data] { (void)raw->memset_async(data, 0, 256); });
        (void)stream->synchronize();
      },
      "Stream::memset_async was called from a host function");
}

TEST_F(CudaHostRules, ADeviceCallFromAContinuationOfRecordedWorkStopsTheProcess) {
  EXPECT_DEATH(
      {
        auto device = cpu_device_under_cuda_rules();
        auto stream = std::move(device->create_stream()).value();
        Device* raw = device.get();
        // The stream is held until the continuation is attached, so that it
        // runs where the stream completes the work, as on CUDA.
        auto gate = std::make_shared<CompletionSource>("gate");
        (void)stream->wait(gate->completion());
        Completion done = stream->record_completion();
        done.then([raw](const Status&) { (void)raw->allocate(256); });
        gate->complete(Status::Ok());
        (void)stream->synchronize();
      },
      "Device::allocate was called from a host function");
}

}  // namespace
}  // namespace strata
