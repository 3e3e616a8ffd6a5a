// Step atomicity (Note [Atomic steps] in engine.h), through the fault
// injector:
//  - a one-off EIO on an NVMe read or write of the optimizer state during a
//    step's update: the step() call that reaches the commit point fails
//    naming the file, the piece, the cause and the steps undone (two with
//    overlap on: the failed update's and the one in progress), every rank
//    rolls back to the last committed step, and calling step() again gives
//    the losses of a run that never failed (bit for bit), at stages 1-3,
//    overlap on and off, parameters on the device, in pinned memory or on
//    NVMe;
//  - with two ranks and the fault on one: both roll back together;
//  - a parameter shard's write-back failing with the optimizer in memory:
//    the state holds the step, the parameters are re-derived, the run goes on
//    with the same losses;
//  - a parameter shard's read failing in a gather: the step is dropped on
//    every rank and repeated with the same losses;
//  - an error no vote can recover (a peer gone): the engine stops, and the
//    next call says so;
//  - an in-place (cpu, none) update failing part-way: never committed, the
//    engine stops naming the layer, the piece and why it cannot roll back;
//  - a failed prefetch: its buffer handed back, its error the layer's acquire's;
//  - a hung NVMe read: the bounded wait (strata.wait_timeout_s) ends in an
//    error naming what it waited for, and teardown does not hang.
#include <gtest/gtest.h>

#include <regex>

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
  // Which steps were undone: with overlap the failed update's step ran under
  // the next one, which is undone with it.
  const std::regex undone(c.placement.overlap ? "after step ([0-9]+) .*: steps ([0-9]+) and ([0-9]+) are undone"
                                              : "after step ([0-9]+) .*: step ([0-9]+) is undone");
  std::smatch found;
  ASSERT_TRUE(std::regex_search(msg, found, undone)) << msg;
  EXPECT_EQ(std::stoi(found[2].str()), std::stoi(found[1].str()) + 1) << msg;
  if (c.placement.overlap) EXPECT_EQ(std::stoi(found[3].str()), std::stoi(found[1].str()) + 2) << msg;
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

TEST(StepRecovery, AnInPlaceUpdateFailingPartWayStopsTheEngine) {
  // Optimizer state in pinned host memory (cpu) or device memory (none) is
  // updated in place: a kernel failing after it wrote part of a layer's
  // state leaves step t beside step t-1 with no copy of t-1. It is never
  // committed (nor reported as a rolled-back or dropped step): every rank
  // stops, naming the layer and the piece and why it cannot roll back.
  for (const Placement& p : {Placement{1, D::kCpu, D::kNone}, Placement{2, D::kNone, D::kNone, false, 8192},
                             Placement{3, D::kCpu, D::kCpu, true, 4096}}) {
    SCOPED_TRACE(p.name());
    TrainRun run = base_run(p, 2);
    run.faults.update = testing::UpdateFault{3, 1, 1};
    run.retries = 1;
    const Outcome o = train(run);
    ASSERT_FALSE(o.status.ok()) << "the run went on after a torn update";
    ASSERT_EQ(o.failures.size(), 1u);  // rank 0's: the step that reached the commit point of step 3
    const std::string first = o.failures[0].to_string();
    EXPECT_NE(first.find("step 3: the update failed part-way on rank 1"), std::string::npos) << first;
    EXPECT_NE(first.find("can neither be committed nor rolled back"), std::string::npos) << first;
    EXPECT_EQ(first.find("rolled back to the state after"), std::string::npos) << first;
    const std::string last = o.status.to_string();  // the retry: the engine stopped
    EXPECT_NE(last.find("this engine stopped"), std::string::npos) << last;
  }
}

TEST(StepRecovery, AnInPlaceUpdateFailureNamesTheLayerAndPiece) {
  // The rank where the kernel failed says which piece, where it lives and why.
  const Placement p{1, D::kCpu, D::kNone};
  TrainRun run = base_run(p, 1);
  run.faults.update = testing::UpdateFault{2, 0, 2};
  run.retries = 1;
  const Outcome o = train(run);
  ASSERT_FALSE(o.status.ok());
  ASSERT_EQ(o.failures.size(), 1u);
  const std::string msg = o.failures[0].to_string();
  EXPECT_NE(msg.find("optimizer step of layer 2 '"), std::string::npos) << msg;
  EXPECT_NE(msg.find("group 0 rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("injected kernel failure"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pinned host memory, updated in place"), std::string::npos) << msg;
  const std::string stopped = o.status.to_string();
  EXPECT_NE(stopped.find("this engine stopped"), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("--resume"), std::string::npos) << stopped;
}

TEST(StepRecovery, AFailedPrefetchSurfacesAtTheLayersAcquire) {
  // Stage 3, every layer partitioned, shards in pinned memory: in step 2,
  // layer 2's gather issued by a prefetch fails after its buffer was
  // allocated and counted and its shard's H2D copies were queued. The
  // buffer goes back once those copies are done, and the failure is the
  // error of layer 2's acquire (not swallowed, and not hidden by an
  // on-demand gather that happens to succeed). Shards on the device are
  // gathered at world 2 (at world 1 they are acquired in place: no gather).
  const std::pair<Placement, int> cases[] = {
      {Placement{3, D::kCpu, D::kCpu, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0}, 1},
      {Placement{3, D::kNone, D::kNone, true, 4096, 1'000'000'000, 1'000'000'000, 0}, 2}};
  for (const auto& [p, world] : cases) {
    SCOPED_TRACE(fmt::format("{} world {}", p.name(), world));
    TrainRun run = base_run(p, world);
    run.faults.gather = testing::GatherFault{2, 0, 2};
    const Outcome o = train(run);
    ASSERT_FALSE(o.status.ok()) << "a failed prefetch was swallowed";
    const std::string msg = o.status.to_string();
    EXPECT_NE(msg.find("acquire of layer 2 '"), std::string::npos) << msg;
    EXPECT_NE(msg.find("prefetching: gathering the parameters of layer 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("injected gather failure"), std::string::npos) << msg;
    EXPECT_EQ(o.losses.size(), 1u);
  }
}

TEST(StepRecovery, AHungNvmeReadEndsInAnErrorNamingTheWait) {
  // Optimizer state on NVMe, overlap off (the step waits for its updates):
  // one read of step 2's update hangs 2.5 s, the bound is 0.5 s (far above a
  // step of this model, under sanitizers too). The step
  // fails with DeadlineExceeded naming what it waited for, the layer, the
  // time and the key to raise; the engine stops; destroying it waits for
  // the hung read (it cannot free the slot the read writes), says so on
  // stderr, and returns once the read ends.
  const Placement p{1, D::kNvme, D::kNone, false};
  nvme::FaultPlan plan;
  plan.hang_ms = 2500;
  plan.fault_writes = false;
  std::shared_ptr<nvme::FaultCounters> counters;
  std::unique_ptr<nvme::IoEngine> io =
      nvme::make_fault_injecting_engine(nvme::io_engine_config(AioConfig{}).value().options, plan, &counters).value();
  counters->disarm();
  TrainRun run = base_run(p, 1);
  run.opt.wait_timeout_s = 0.5;
  run.engine_for_rank = [&](int) { return io.get(); };
  run.after_step = [&](Engine&, int64_t step) {
    if (step == 1) counters->arm(0, 1);
  };
  run.retries = 1;
  ::testing::internal::CaptureStderr();
  const Outcome o = train(run);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(counters->hung.load(), 1u);
  ASSERT_FALSE(o.status.ok());
  ASSERT_EQ(o.failures.size(), 1u);
  EXPECT_EQ(o.failures[0].code(), StatusCode::kDeadlineExceeded) << o.failures[0].to_string();
  const std::string msg = o.failures[0].to_string();
  EXPECT_NE(msg.find("the update of layer "), std::string::npos) << msg;
  EXPECT_NE(msg.find("did not complete in 0.5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strata.wait_timeout_s = 0.5 s"), std::string::npos) << msg;
  EXPECT_NE(msg.find("raise strata.wait_timeout_s"), std::string::npos) << msg;
  const std::string stopped = o.status.to_string();  // the retry
  EXPECT_NE(stopped.find("this engine stopped"), std::string::npos) << stopped;
  EXPECT_NE(err.find("destroying the engine on rank 0"), std::string::npos) << err;
  EXPECT_NE(err.find("still waiting"), std::string::npos) << err;
}

TEST(StepRecovery, TheWaitBoundIsRangeChecked) {
  for (double bad : {0.0, -1.0, 1e9}) {
    EngineOptions o;
    o.wait_timeout_s = bad;
    const Status st = check_placement(o);
    ASSERT_FALSE(st.ok()) << bad;
    EXPECT_NE(st.message().find("strata.wait_timeout_s"), std::string::npos) << st.message();
  }
  EXPECT_TRUE(check_placement(EngineOptions{}).ok());
  // The config key reaches the options, and a bad value is refused naming it.
  Config cfg;
  cfg.source = "ds.json";
  EXPECT_EQ(engine_options_from_config(cfg).value().wait_timeout_s, 600.0);
  cfg.strata.wait_timeout_s = 12.5;
  EXPECT_EQ(engine_options_from_config(cfg).value().wait_timeout_s, 12.5);
  cfg.strata.wait_timeout_s = 0;
  const Result<EngineOptions> r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ds.json: strata.wait_timeout_s 0 is out of range"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace strata::offload
