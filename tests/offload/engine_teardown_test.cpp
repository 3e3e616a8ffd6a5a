// The engine's destructor with work still in flight: a stage-3 parameter
// shard's write-back to NVMe that fails (EIO) and completes late, after the
// engine has started to go away. Its continuation (the failure recorded for
// the commit point) must find every member it touches alive: the destructor
// waits for it before any member is destroyed. Under AddressSanitizer
// (-DSTRATA_SANITIZE=address) a continuation reaching a destroyed or freed
// member is reported (use after free, or the leak of a Status written into
// a destroyed one) and fails the test.
#include <gtest/gtest.h>

#include "engine_harness.h"

namespace strata::offload {
namespace {

// I/O in 4 KiB pieces, each completing up to 50 ms late; once armed, one
// read or write piece (`reads`) fails with EIO at once. A tensor's I/O is
// several pieces, so it fails when its last piece comes back: late.
struct LateFaults {
  std::shared_ptr<nvme::FaultCounters> counters;
  std::unique_ptr<nvme::IoEngine> io;
  explicit LateFaults(bool reads) {
    nvme::FaultPlan plan;
    plan.eio_probability = 1.0;
    plan.fault_reads = reads;
    plan.fault_writes = !reads;
    plan.latency_probability = 1.0;
    plan.latency_us_max = 50'000;
    nvme::IoEngineConfig ec = nvme::io_engine_config(AioConfig{}).value();
    ec.options.block_size = 4096;
    io = nvme::make_fault_injecting_engine(ec.options, plan, &counters).value();
    counters->disarm();
  }
};

TEST(EngineTeardown, AParameterWriteBackFailingDuringDestructionFindsTheEngineAlive) {
  LateFaults faults(/*reads=*/false);
  std::shared_ptr<nvme::FaultCounters>& counters = faults.counters;

  TrainRun r;
  r.world = 1;
  r.steps = 3;
  // Stage 3, every layer's shard on NVMe, updates overlapped with the next step.
  apply_placement(r, Placement{3, OffloadDevice::kCpu, OffloadDevice::kNvme, true, 1'000'000'000, 1'000'000'000,
                               1'000'000'000, 0});
  r.param_engine_for_rank = [&](int) { return faults.io.get(); };
  r.on_step = [&](Engine& e, int, int64_t step) -> Status {
    if (step == r.steps - 1) {
      // Everything so far written and committed: the next writes are the
      // last step's write-backs, queued when its step() returns.
      STRATA_RETURN_IF_ERROR(e.synchronize());
      counters->arm(/*clean_pieces=*/0, /*max_hard_errors=*/1);
    }
    return Status::Ok();
  };
  // After the last step() the rank leaves at once: the engine is destroyed
  // with that step's updates queued and their write-backs failing late.
  r.fail_rank = 0;
  r.fail_step = r.steps;
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_NE(o.status.message().find("rank 0 crashed"), std::string::npos) << o.status.to_string();
  ASSERT_EQ(o.losses.size(), 3u);
  // A write-back did fail, during the destruction.
  EXPECT_EQ(counters->eio.load(), 1u);
}

// Gradient shards on NVMe (Note [Gradient shards on NVMe]): the last step's
// overlapped updates read their gradients back while the engine goes away,
// each read late and one failing. The optimizer threads run what is queued
// before the gradient store and its slots are destroyed (an update's read
// slot is returned only once its read ended).
TEST(EngineTeardown, GradientReadBacksFailingDuringDestructionFindTheStoreAlive) {
  LateFaults faults(/*reads=*/true);
  std::shared_ptr<nvme::FaultCounters>& counters = faults.counters;

  TrainRun r;
  r.world = 1;
  r.steps = 3;
  apply_placement(r, Placement{2, OffloadDevice::kNvme, OffloadDevice::kNone, true, 8192});
  r.opt.gradient_shards = GradientShardsMode::kNvme;
  r.gradient_engine_for_rank = [&](int) { return faults.io.get(); };
  r.on_step = [&](Engine& e, int, int64_t step) -> Status {
    if (step == r.steps - 1) {
      STRATA_RETURN_IF_ERROR(e.synchronize());
      counters->arm(/*clean_pieces=*/2, /*max_hard_errors=*/1);
    }
    return Status::Ok();
  };
  r.fail_rank = 0;
  r.fail_step = r.steps;
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_NE(o.status.message().find("rank 0 crashed"), std::string::npos) << o.status.to_string();
  ASSERT_EQ(o.losses.size(), 3u);
  EXPECT_EQ(counters->eio.load(), 1u);
}

// An init that fails part-way (here: the NVMe optimizer tier's folder cannot
// be created) destroys the half-built engine: the destructor waits only on
// the layers its components set up (it used to index the per-layer state of
// every layer in the partition and crashed on the first) and create returns
// the error naming the folder.
TEST(EngineTeardown, AnInitThatFailsPartWayReturnsItsErrorAndTearsDownCleanly) {
  for (const OffloadDevice param : {OffloadDevice::kNone, OffloadDevice::kNvme}) {
    TrainRun r;
    r.steps = 1;
    apply_placement(r, Placement{3, OffloadDevice::kNvme, param, true});
    r.opt.nvme.path = ::testing::TempDir() + "/no-such-folder/below";
    const Outcome o = train(r);
    ASSERT_FALSE(o.status.ok()) << offload_device_name(param);
    EXPECT_NE(o.status.message().find("no-such-folder"), std::string::npos) << o.status.to_string();
    EXPECT_TRUE(o.losses.empty());
  }
}

}  // namespace
}  // namespace strata::offload
