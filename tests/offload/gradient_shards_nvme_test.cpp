// Gradient shards on NVMe (Note [Gradient shards on NVMe] in
// offload/src/gradient_spill.h):
//  - losses bit-identical to pinned shards at stages 1-3, one and two ranks,
//    with the optimizer state (and stage-3 parameters) on NVMe;
//  - the plan: pinned gradient memory is the slots only, equal to what the
//    engine holds, and the gradient bytes show up in the step's NVMe bytes;
//  - with the optimizer state in host memory and stage-3 parameters on NVMe
//    they use the parameters' folder (the same checks, and early updates);
//  - strata.gradient_shards auto puts them on NVMe only where the pinned
//    plan does not fit strata.host_memory_budget; nvme with neither folder
//    on NVMe (or a ratio < 1) is refused naming the keys;
//  - a failed gradient write or read-back drops the step on every rank and
//    the repeated step gives the fault-free losses.
#include <gtest/gtest.h>

#include "engine_harness.h"
#include "strata/core/spec_model.h"
#include "strata/offload/state_placement.h"

namespace strata::offload {
namespace {

using D = OffloadDevice;

TrainRun run_of(const Placement& p, int world, GradientShardsMode mode) {
  TrainRun r;
  r.world = world;
  r.steps = 5;
  apply_placement(r, p);
  r.opt.gradient_shards = mode;
  return r;
}

void expect_bit_identical(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.to_string();
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint64_t>(got.losses[i]), std::bit_cast<uint64_t>(want.losses[i]))
        << what << ": step " << i + 1;
  EXPECT_EQ(got.val, want.val) << what;
}

struct Case {
  Placement placement;
  int world;
};

class GradientShardsOnNvme : public ::testing::TestWithParam<Case> {};

TEST_P(GradientShardsOnNvme, SameLossesAsPinnedAndThePlanIsWhatTheEngineHolds) {
  const Case& c = GetParam();
  const Outcome pinned = train(run_of(c.placement, c.world, GradientShardsMode::kPinned));
  ASSERT_TRUE(pinned.status.ok()) << pinned.status.to_string();
  const Outcome on_nvme = train(run_of(c.placement, c.world, GradientShardsMode::kNvme));
  ASSERT_NO_FATAL_FAILURE(expect_bit_identical(on_nvme, pinned, c.placement.name()));
  for (int r = 0; r < c.world; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const EngineMemory& want = on_nvme.predicted[r];
    const EngineMemory& got = on_nvme.measured[r];
    EXPECT_EQ(got.pinned, want.pinned);
    EXPECT_EQ(got.nvme, want.nvme);
    // The gradient shards are no longer in pinned memory (their slots are)...
    EXPECT_LT(want.pinned_grads, pinned.predicted[r].pinned_grads);
    EXPECT_LT(want.pinned, pinned.predicted[r].pinned);
    // ... but on NVMe beside the state.
    EXPECT_GT(want.nvme, pinned.predicted[r].nvme);
  }
  // Each step writes every owned gradient byte under its backward and reads
  // it back in its update. A step's report carries its backward's writes and
  // the reads of the updates committed during it (Note [A step's NVMe bytes]):
  // with overlap on those of the previous step, none in the first report.
  // Exact per step, against the pinned run's state I/O of the same steps.
  ASSERT_EQ(on_nvme.metrics.size(), pinned.metrics.size());
  const uint64_t gradient_bytes = on_nvme.predicted[0].nvme - pinned.predicted[0].nvme;
  ASSERT_GT(gradient_bytes, 0u);
  for (size_t s = 0; s < on_nvme.metrics.size(); ++s) {
    SCOPED_TRACE(fmt::format("step {}", s + 1));
    const int64_t written = static_cast<int64_t>(on_nvme.metrics[s].nvme_write_bytes) -
                            static_cast<int64_t>(pinned.metrics[s].nvme_write_bytes);
    const int64_t read = static_cast<int64_t>(on_nvme.metrics[s].nvme_read_bytes) -
                         static_cast<int64_t>(pinned.metrics[s].nvme_read_bytes);
    EXPECT_EQ(written, static_cast<int64_t>(gradient_bytes));
    EXPECT_EQ(read, c.placement.overlap && s == 0 ? 0 : static_cast<int64_t>(gradient_bytes));
    if (c.placement.optimizer == D::kNvme) {
      // The state's own write-backs: none reported before the first commit point.
      EXPECT_EQ(pinned.metrics[s].nvme_write_bytes > 0, !(c.placement.overlap && s == 0));
    } else {
      // The state in host memory: the gradients are the updates' only NVMe bytes.
      EXPECT_EQ(pinned.metrics[s].nvme_write_bytes, 0u);
      EXPECT_EQ(pinned.metrics[s].nvme_read_bytes, 0u);
    }
  }
}

std::vector<Case> cases() {
  return {
      {{1, D::kNvme, D::kNone, true, 4096}, 1},
      {{2, D::kNvme, D::kNone, false, 8192}, 2},
      {{3, D::kNvme, D::kCpu, true, 4096}, 1},
      {{3, D::kNvme, D::kNvme, false, 4096, 20'000, 0, 0}, 2},
      {{3, D::kNvme, D::kNone, true, 4096, 1'000'000'000, 1'000'000'000, 0}, 1},
      // The state in pinned host memory, the shards in the parameters' folder.
      {{3, D::kCpu, D::kNvme, true, 4096}, 1},
      {{3, D::kCpu, D::kNvme, false, 4096, 20'000, 0, 0}, 2},
  };
}

INSTANTIATE_TEST_SUITE_P(Placements, GradientShardsOnNvme, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Placement& p = i.param.placement;
                           return fmt::format("stage{}_opt_{}_param_{}_world{}_{}", p.stage,
                                              offload_device_name(p.optimizer), offload_device_name(p.param),
                                              i.param.world, i.index);
                         });

// One EIO on rank `rank`'s gradient I/O (a write under the backward, or a
// read-back in the update), armed after step `after`: the step fails on
// every rank, rolls back, and the repeated steps match the fault-free run.
void one_fault(bool reads, int world, int rank, std::string* message) {
  const Placement p{2, D::kNvme, D::kNone, true, 8192};
  const Outcome straight = train(run_of(p, world, GradientShardsMode::kNvme));
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  FaultyEngines faults(world, reads, !reads);
  TrainRun run = run_of(p, world, GradientShardsMode::kNvme);
  run.gradient_engine_for_rank = [&](int r) { return faults[r]; };
  run.after_step = [&](Engine& e, int64_t step) {
    if (step == 2 && e.rank() == rank && faults.eio() == 0) faults.counters[rank]->arm(1, 1);
  };
  run.retries = 1;
  const Outcome o = train(run);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  EXPECT_EQ(faults.eio(), 1u);
  ASSERT_EQ(o.failures.size(), 1u);
  *message = o.failures[0].to_string();
  ASSERT_NO_FATAL_FAILURE(expect_bit_identical(o, straight, reads ? "read fault" : "write fault"));
}

TEST(GradientShardsOnNvmeFaults, AFailedWriteDropsTheStepAndTheRepeatMatches) {
  std::string msg;
  ASSERT_NO_FATAL_FAILURE(one_fault(/*reads=*/false, 1, 0, &msg));
  EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gradient"), std::string::npos) << msg;
}

TEST(GradientShardsOnNvmeFaults, AFailedReadBackDropsTheStepOnBothRanks) {
  std::string msg;
  ASSERT_NO_FATAL_FAILURE(one_fault(/*reads=*/true, 2, 1, &msg));
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
}

// The decision (StatePlacement): auto goes to NVMe only where the pinned
// plan does not fit the host budget and NVMe shrinks it; nvme needs the
// optimizer state there.
SpecModel two_layers() {
  std::vector<LayerDescription> layers;
  layers.push_back({"a", {{"a.weight", {64 * 1024}, DType::kBF16, true, std::nullopt, 1.0}}});
  layers.push_back({"b", {{"b.weight", {64 * 1024}, DType::kBF16, true, std::nullopt, 1.0}}});
  return SpecModel::create(std::move(layers)).value();
}

Result<StatePlacement> place(const EngineOptions& o) {
  const SpecModel model = two_layers();
  const Partition part = Partition::create(model.layers(), 1, o.sub_group_size).value();
  return StatePlacement::compute(o, model.layers(), part, 0, PlannedDevice::cpu());
}

TEST(GradientShardsDecision, AutoGoesToNvmeOnlyWhenThePinnedPlanDoesNotFit) {
  EngineOptions o;
  o.stage = 2;
  o.offload_optimizer = D::kNvme;
  o.nvme.path = "/unused";
  o.sub_group_size = 16 * 1024;
  const SpecModel model = two_layers();
  const Partition part = Partition::create(model.layers(), 1, o.sub_group_size).value();
  // No budget: pinned (the NVMe way costs a write and a read per step).
  StatePlacement p = place(o).value();
  EXPECT_EQ(p.gradient_slot_count, 0u);
  EXPECT_TRUE(p.layers[0].pinned_gradient_shard);
  const uint64_t pinned_plan = plan_engine_memory(o, part, p).pinned;
  // A budget the pinned plan fits: still pinned.
  o.host_memory_budget = pinned_plan;
  p = place(o).value();
  EXPECT_EQ(p.gradient_slot_count, 0u);
  EXPECT_NE(p.gradient_shards_why.find("fit"), std::string::npos) << p.gradient_shards_why;
  // One byte less: on NVMe, and the plan drops to the slots.
  o.host_memory_budget = pinned_plan - 1;
  p = place(o).value();
  EXPECT_EQ(p.gradient_slot_count, 4u);  // offload_optimizer.buffer_count
  EXPECT_FALSE(p.layers[0].pinned_gradient_shard);
  EXPECT_TRUE(p.layers[0].gradient_shard_on_nvme && p.layers[1].gradient_shard_on_nvme);
  EXPECT_EQ(p.gradient_slot_bytes, 16u * 1024 * 4);  // a sub-group's fp32 gradient
  EXPECT_EQ(p.gradient_nvme_bytes, 2u * 64 * 1024 * 4);
  const EngineMemory m = plan_engine_memory(o, part, p);
  EXPECT_EQ(m.pinned_grads, 4u * 16 * 1024 * 4);
  EXPECT_LT(m.pinned, pinned_plan);
  // Sub-groups as large as the model: the slots would hold more than the
  // shards, so auto keeps them pinned.
  o.sub_group_size = 1'000'000'000;
  p = place(o).value();
  EXPECT_EQ(p.gradient_slot_count, 0u);
  EXPECT_NE(p.gradient_shards_why.find("slots"), std::string::npos) << p.gradient_shards_why;
  // pinned: never.
  o.gradient_shards = GradientShardsMode::kPinned;
  EXPECT_EQ(place(o).value().gradient_slot_count, 0u);
}

TEST(GradientShardsDecision, NvmeWithoutAFolderOnNvmeIsRefusedNamingTheKeys) {
  EngineOptions o;
  o.stage = 2;
  o.offload_optimizer = D::kCpu;
  o.gradient_shards = GradientShardsMode::kNvme;
  const Result<StatePlacement> p = place(o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(p.status().message().find("strata.gradient_shards nvme"), std::string::npos) << p.status().to_string();
  EXPECT_NE(p.status().message().find("offload_optimizer.device nvme"), std::string::npos) << p.status().to_string();
  EXPECT_NE(p.status().message().find("offload_param.device nvme"), std::string::npos) << p.status().to_string();
  // auto: quietly pinned, saying why.
  o.gradient_shards = GradientShardsMode::kAuto;
  o.host_memory_budget = 1;
  const StatePlacement q = place(o).value();
  EXPECT_EQ(q.gradient_slot_count, 0u);
  EXPECT_NE(q.gradient_shards_why.find("are on NVMe"), std::string::npos) << q.gradient_shards_why;
  // The state on the device: nothing to spill, refused too.
  o.offload_optimizer = D::kNone;
  o.gradient_shards = GradientShardsMode::kNvme;
  const Result<StatePlacement> d = place(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("offload_optimizer.device none"), std::string::npos) << d.status().to_string();
}

// With the state in host memory and the parameters on NVMe, the shards use
// the parameters' folder and slot count (offload_param.buffer_count); a
// ratio < 1 (a device part stepped from the device's gradient) is refused.
TEST(GradientShardsDecision, WithTheStateInHostMemoryTheyGoToTheParametersFolder) {
  EngineOptions o;
  o.stage = 3;
  o.offload_optimizer = D::kCpu;
  o.offload_param = D::kNvme;
  o.nvme_param.path = "/unused";
  o.nvme_param.buffer_count = 3;
  o.nvme.buffer_count = 7;
  o.sub_group_size = 16 * 1024;
  o.gradient_shards = GradientShardsMode::kNvme;
  const StatePlacement p = place(o).value();
  EXPECT_EQ(p.gradient_folder, StatePlacement::GradientFolder::kParameterShards);
  EXPECT_EQ(p.gradient_slot_count, 3u);
  EXPECT_TRUE(p.layers[0].gradient_shard_on_nvme && !p.layers[0].pinned_gradient_shard);
  // The optimizer state on NVMe too: its folder and slots.
  o.offload_optimizer = D::kNvme;
  o.nvme.path = "/unused-too";
  const StatePlacement q = place(o).value();
  EXPECT_EQ(q.gradient_folder, StatePlacement::GradientFolder::kOptimizerState);
  EXPECT_EQ(q.gradient_slot_count, 7u);
  // ratio < 1: refused, naming it.
  o.offload_optimizer = D::kCpu;
  o.offload_param = D::kNone;
  o.ratio = 0.5;
  const Result<StatePlacement> r = place(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ratio"), std::string::npos) << r.status().to_string();
}

// Early updates read each layer's gradient back from NVMe before stepping
// it under the backward; with the state in host memory the losses equal
// the pinned-shard run without early updates, clipping included.
TEST(GradientShardsOnNvmeEarly, StateInHostMemoryParametersOnNvmeSameLosses) {
  const Placement p{3, D::kCpu, D::kNvme, true, 4096};
  TrainRun base = run_of(p, 1, GradientShardsMode::kPinned);
  base.opt.speculative_optimizer = SpeculationMode::kOff;
  const Outcome want = train(base);
  ASSERT_TRUE(want.status.ok()) << want.status.to_string();
  TrainRun early = run_of(p, 1, GradientShardsMode::kNvme);
  early.opt.speculative_optimizer = SpeculationMode::kOn;
  const Outcome got = train(early);
  ASSERT_NO_FATAL_FAILURE(expect_bit_identical(got, want, "early updates, gradient shards on NVMe"));
  // (How many layers ran early depends on the threads' timing here;
  // EarlyUpdates.TheyStartWhileTheBackwardStillRunsWithTheGradientsOnNvme
  // holds the backward until one has started.)
}

}  // namespace
}  // namespace strata::offload
