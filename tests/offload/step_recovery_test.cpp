// Step atomicity (Note [Atomic steps] in engine.h), through the fault
// injector:
//  - a one-off EIO on an NVMe read or write of the optimizer state during a
//    step's update: the step() call that reaches the commit point fails
//    naming the file, the piece and the cause, every rank rolls back to the
//    last committed step, and calling step() again gives the losses of a run
//    that never failed (bit for bit), at stages 1-3, overlap on and off,
//    parameters on the device, in pinned memory or on NVMe;
//  - with two ranks and the fault on one: both roll back together;
//  - a parameter shard's write-back failing with the optimizer in memory:
//    the state holds the step, the parameters are re-derived, the run goes on
//    with the same losses;
//  - a parameter shard's read failing in a gather: the step is dropped on
//    every rank and repeated with the same losses;
//  - an error no vote can recover (a peer gone): the engine stops, and the
//    next call says so.
#include <gtest/gtest.h>

#include "engine_harness.h"

namespace strata::offload {
namespace {

using D = OffloadDevice;

TrainRun base_run(const Placement& p, int world = 1) {
  TrainRun r;
  r.world = world;
  r.steps = 6;
  apply_placement(r, p);
  return r;
}

void expect_same_losses(const Outcome& got, const Outcome& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint64_t>(got.losses[i]), std::bit_cast<uint64_t>(want.losses[i])) << "step " << i + 1;
  ASSERT_EQ(got.val.size(), 1u);
  ASSERT_EQ(want.val.size(), 1u);
  EXPECT_EQ(std::bit_cast<uint64_t>(got.val[0]), std::bit_cast<uint64_t>(want.val[0]));
}

// Placement p on `world` ranks, once without faults and once with one EIO
// on rank `rank` (a read or a write; of the optimizer state, or of the
// parameter shards with `on_params`), armed after step() call `after` with
// `clean` clean I/O pieces first. The faulty run goes past one failed call
// and must end with the fault-free run's losses; `message` gets the error.
void run_with_one_fault(const Placement& p, int world, bool reads, bool on_params, int64_t after, int rank,
                        uint64_t clean, std::string* message) {
  const Outcome straight = train(base_run(p, world));
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  FaultyEngines faults(world, reads, !reads);
  TrainRun run = base_run(p, world);
  (on_params ? run.param_engine_for_rank : run.engine_for_rank) = [&](int r) { return faults[r]; };
  // Once: a rolled-back step calls after_step for `after` again.
  run.after_step = [&](Engine& e, int64_t step) {
    if (step == after && e.rank() == rank && faults.eio() == 0) faults.counters[rank]->arm(clean, 1);
  };
  run.retries = 1;
  const Outcome o = train(run);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  for (int r = 0; r < world; ++r) EXPECT_EQ(faults.counters[r]->eio.load(), r == rank ? 1u : 0u) << "rank " << r;
  ASSERT_EQ(o.failures.size(), 1u);  // rank 0's: the others' roll back with it
  *message = o.failures[0].to_string();
  expect_same_losses(o, straight);
}

struct Case {
  Placement placement;
  bool fault_reads;  // else writes
};

class OneOffNvmeFault : public ::testing::TestWithParam<Case> {};

TEST_P(OneOffNvmeFault, RollsBackAndTheRepeatedStepsMatch) {
  const Case& c = GetParam();
  // The fault lands a few I/Os into the updates after step 2 (with overlap
  // they run while step 3 computes).
  std::string msg;
  ASSERT_NO_FATAL_FAILURE(run_with_one_fault(c.placement, 1, c.fault_reads, false, 2, 0, 2, &msg));
  EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer state of layer"), std::string::npos) << msg;  // the piece
  EXPECT_NE(msg.find("rolled back to the state after step"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strata-"), std::string::npos) << msg;  // the swap file's path
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const Placement placements[] = {
      {1, D::kNvme, D::kNone},
      {2, D::kNvme, D::kNone, false, 8192},
      {3, D::kNvme, D::kCpu, true, 4096},
      {3, D::kNvme, D::kNvme, false, 4096, 20'000, 0, 0},
      {3, D::kNvme, D::kNone, true, 4096, 1'000'000'000, 1'000'000'000, 0},
  };
  for (const Placement& p : placements)
    for (bool reads : {false, true}) v.push_back({p, reads});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Placements, OneOffNvmeFault, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Placement& p = i.param.placement;
                           return fmt::format("stage{}_param_{}_overlap{}_{}_{}", p.stage,
                                              offload_device_name(p.param), p.overlap ? 1 : 0,
                                              i.param.fault_reads ? "read" : "write", i.index);
                         });

TEST(StepRecovery, TwoRanksRollBackTogether) {
  const Placement p{2, D::kNvme, D::kNone, true, 8192};
  for (bool reads : {false, true}) {
    SCOPED_TRACE(reads ? "read fault" : "write fault");
    std::string msg;  // rank 0's: it rolled back too, naming rank 1
    ASSERT_NO_FATAL_FAILURE(run_with_one_fault(p, 2, reads, false, 3, 1, 1, &msg));
    EXPECT_NE(msg.find("failed on rank 1;"), std::string::npos) << msg;
    EXPECT_NE(msg.find("every rank rolled back"), std::string::npos) << msg;
  }
}

TEST(StepRecovery, ParameterShardWriteFailureRollsForward) {
  // The optimizer state in pinned memory is updated in place; only the
  // updated shard's write to NVMe fails: the step stands, the parameters
  // are re-derived from the master weights, the step in progress repeats.
  const Placement p{3, D::kCpu, D::kNvme, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0};
  std::string msg;
  ASSERT_NO_FATAL_FAILURE(run_with_one_fault(p, 1, false, true, 2, 0, 1, &msg));
  EXPECT_NE(msg.find("parameter shard of layer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("re-derived its parameters"), std::string::npos) << msg;
}

TEST(StepRecovery, AParameterShardReadFailureDropsTheStep) {
  // A shard read failing in a gather (forward or backward): the layer is
  // gathered from whatever the slot holds, the vote drops the step on every
  // rank, and the repeated step matches.
  const Placement p{3, D::kCpu, D::kNvme, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0};
  std::string msg;
  ASSERT_NO_FATAL_FAILURE(run_with_one_fault(p, 2, true, true, 2, 0, 3, &msg));
  EXPECT_NE(msg.find("reading the parameters failed on rank 0 (here: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("parameter shard of layer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the step was dropped on every rank"), std::string::npos) << msg;
}

TEST(StepRecovery, AnErrorOutsideTheUpdatesStopsTheEngine) {
  // Rank 1 leaves after step 3 (a crash): rank 0's step 4 fails in a
  // collective, which no vote can recover, so its engine stops and says so.
  const Placement p{2, D::kNvme, D::kNone, true, 8192};
  TrainRun run = base_run(p, 2);
  run.fail_rank = 1;
  run.fail_step = 3;
  run.retries = 1;
  const Outcome o = train(run);
  ASSERT_FALSE(o.status.ok());
  ASSERT_EQ(o.failures.size(), 1u);  // rank 0's step 4: the peer is gone
  const std::string msg = o.status.to_string();  // rank 0's retry
  EXPECT_NE(msg.find("this engine stopped after an error it could not roll back"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--resume"), std::string::npos) << msg;
}

}  // namespace
}  // namespace strata::offload
