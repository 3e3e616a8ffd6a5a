// The nccl backend needs a GPU: without one (no driver, or zero devices)
// every test here skips cleanly. With one, world size 1 is a real NCCL run.
#include <gtest/gtest.h>

#include "conformance.h"
#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"

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

// Queues, a host-signalled gate held device-side, a stream gated on a
// collective, and comm buffers counted by the Device the communicator uses.
TEST(NcclComm, GatesQueuesAndDeviceCountedBuffersOnOneGpu) {
  if (!nccl_compiled()) GTEST_SKIP() << "nccl backend not in this build: " << nccl_version();
  Result<int> devices = cuda_device_count();
  if (!devices.ok() || *devices == 0) {
    GTEST_SKIP() << "no usable GPU: " << (devices.ok() ? std::string("0 devices") : devices.status().to_string());
  }
  auto device = make_device("cuda");
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  NcclOptions opts;
  opts.rank = 0;
  opts.world_size = 1;
  opts.device = 0;
  opts.cuda_device = device->get();
  opts.common.timeout = std::chrono::seconds(60);
  auto comm = create_nccl_communicator(opts);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  Communicator& c = **comm;
  const uint64_t before = (*device)->memory_in_use_bytes();
  constexpr size_t kCount = 1 << 18;
  auto grads = c.allocate_buffer(kCount * sizeof(double));
  auto params = c.allocate_buffer(kCount * sizeof(float));
  ASSERT_TRUE(grads.ok() && params.ok());
  EXPECT_GE((*device)->memory_in_use_bytes(), before + kCount * (sizeof(double) + sizeof(float)));
  std::vector<double> host(kCount, 1.5);
  ASSERT_TRUE(c.upload(grads->data(), host.data(), kCount * sizeof(double)).ok());

  CompletionSource gate("gradients ready");
  ASSERT_TRUE(c.wait(gate.completion(), CommQueue::kReduce).ok());
  auto reduce = c.all_reduce(grads->data(), grads->data(), kCount, DType::kF64, ReduceOp::kSum);
  auto gather = c.all_gather(params->data(), params->data(), kCount, DType::kF32, CommQueue::kGather);
  ASSERT_TRUE(reduce.ok() && gather.ok());
  EXPECT_TRUE(gather->wait().ok());  // not stuck behind the held reduce queue
  EXPECT_FALSE(reduce->done());
  auto stream = (*device)->create_stream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->wait(reduce->completion()).ok());
  gate.complete(Status::Ok());
  EXPECT_TRUE(reduce->wait().ok());
  EXPECT_TRUE((*stream)->synchronize().ok());
  ASSERT_TRUE(c.download(host.data(), grads->data(), kCount * sizeof(double)).ok());
  EXPECT_EQ(host[kCount - 1], 1.5);  // world 1: the sum is the input

  // A failed gate: this rank still takes part, its collective fails with it.
  CompletionSource bad("nvme read of 'g.swp'");
  ASSERT_TRUE(c.wait(bad.completion(), CommQueue::kGather).ok());
  auto late = c.all_gather(params->data(), params->data(), kCount, DType::kF32, CommQueue::kGather);
  ASSERT_TRUE(late.ok());
  bad.complete(IoError("pread 'g.swp': EIO (injected)"));
  Status s = late->wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("EIO (injected)"), std::string::npos) << s.message();
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
