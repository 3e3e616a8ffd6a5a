// The nccl backend needs a GPU: without one (no driver, or zero devices)
// every test here skips cleanly. With one, world size 1 is a real NCCL run.
#include <gtest/gtest.h>

#include "conformance.h"
#include "strata/comm/backends.h"

namespace strata::comm {
namespace {

TEST(NcclComm, ConformanceOnOneGpu) {
  if (!nccl_compiled()) GTEST_SKIP() << "nccl backend not in this build: " << nccl_version();
  Result<int> devices = cuda_device_count();
  if (!devices.ok() || *devices == 0) {
    GTEST_SKIP() << "no usable GPU: " << (devices.ok() ? std::string("0 devices") : devices.status().to_string());
  }
  NcclOptions opts;
  opts.rank = 0;
  opts.world_size = 1;
  opts.common.timeout = std::chrono::seconds(60);
  auto comm = create_nccl_communicator(opts);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  testing::ConformanceOptions copts;
  copts.check_avg_16bit = false;
  for (const std::string& f : testing::run_conformance(**comm, copts)) ADD_FAILURE() << f;
}

TEST(NcclComm, CreationWithoutGpuIsAClearError) {
  Result<int> devices = cuda_device_count();
  if (devices.ok() && *devices > 0) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  auto comm = create_nccl_communicator({});
  ASSERT_FALSE(comm.ok());
  EXPECT_TRUE(comm.status().code() == StatusCode::kUnsupported || comm.status().code() == StatusCode::kIoError)
      << comm.status().to_string();
}

}  // namespace
}  // namespace strata::comm
