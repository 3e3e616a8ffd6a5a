// Block-wise 8-bit optimizer moments in the engine (strata.optimizer_state_dtype
// int8; cpu_adam::MomentStorage, Note [Runs in 8-bit blocks]):
//  - every stage and placement (optimizer on the device, in pinned memory or
//    on NVMe; parameters anywhere; several sub-group sizes; overlap on/off)
//    gives bit-identical losses at world sizes 1 and 2;
//  - int8 training tracks fp32 training, and moves about half the NVMe bytes;
//  - checkpoints cross moment storages: int8 -> fp32 -> int8 (at other world
//    sizes) continues bit for bit, and fp32 -> int8 loads (rounded);
//  - what cannot hold int8 state is refused naming the key.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "engine_harness.h"
#include "scratch_folders.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using cpu_adam::MomentStorage;

fs::path fresh_dir(const std::string& name) { return testing_scratch::fresh_scratch_folder("int8-", name); }

TrainRun int8_run(int world) {
  TrainRun r;
  r.world = world;
  r.opt.moments = MomentStorage::int8();
  return r;
}

class Int8Parity : public ::testing::TestWithParam<int> {};

TEST_P(Int8Parity, EveryPlacementMatchesStageZeroBitForBit) {
  const int world = GetParam();
  const TrainRun base = int8_run(world);
  const Outcome ref = train(base);
  ASSERT_TRUE(ref.status.ok()) << ref.status.to_string();
  ASSERT_EQ(ref.losses.size(), 30u);
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 1.0);  // it learns
  for (const Placement& p : matrix()) {
    if (p.ratio < 1.0) continue;  // refused with int8 (below)
    TrainRun r = base;
    apply_placement(r, p);
    expect_same_losses(ref, train(r), fmt::format("int8 world {} {}", world, p.name()));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, Int8Parity, ::testing::Values(1, 2),
                         [](const auto& info) { return fmt::format("world{}", info.param); });

TEST(EngineInt8Moments, TracksFp32AndMovesHalfTheNvmeBytes) {
  TrainRun fp32 = int8_run(1);
  fp32.opt.moments = MomentStorage::fp32();
  apply_placement(fp32, Placement{3, OffloadDevice::kNvme, OffloadDevice::kNone});
  TrainRun int8 = fp32;
  int8.opt.moments = MomentStorage::int8();
  const Outcome a = train(fp32), b = train(int8);
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();
  ASSERT_TRUE(b.status.ok()) << b.status.to_string();
  ASSERT_EQ(a.losses.size(), b.losses.size());
  bool differs = false;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_LE(std::abs(b.losses[i] - a.losses[i]), 0.02 * std::abs(a.losses[i])) << "step " << i + 1;
    differs = differs || a.losses[i] != b.losses[i];
  }
  EXPECT_TRUE(differs) << "int8 moments gave fp32's losses exactly: were they used?";
  EXPECT_LE(std::abs(b.val[0] - a.val[0]), 0.01 * a.val[0]);
  // Master 4 B + moments 2 x (1 B + 4 B per 256) against 12 B, per element
  // (each moment part 4 KiB-aligned on NVMe: a little more for small pieces).
  // Summed over the run (the first report of an overlapped run has no
  // committed updates yet: Note [A step's NVMe bytes]).
  auto total = [](const Outcome& o, uint64_t StepMetrics::*bytes) {
    uint64_t sum = 0;
    for (const StepMetrics& m : o.metrics) sum += m.*bytes;
    return static_cast<double>(sum);
  };
  ASSERT_GT(total(a, &StepMetrics::nvme_read_bytes), 0);
  const double read_ratio = total(b, &StepMetrics::nvme_read_bytes) / total(a, &StepMetrics::nvme_read_bytes);
  const double write_ratio = total(b, &StepMetrics::nvme_write_bytes) / total(a, &StepMetrics::nvme_write_bytes);
  // Each piece is written once per step (and once at the start); reads are
  // not as exact: a read started ahead may be dropped for a slot and read
  // again on demand, as the pipeline's timing goes.
  EXPECT_GT(write_ratio, 0.45);
  EXPECT_LT(write_ratio, 0.60);  // 0.556 here: the small pieces pay the 4 KiB alignment of each part
  EXPECT_GT(read_ratio, 0.35);
  EXPECT_LT(read_ratio, 0.75);
  std::fprintf(stderr, "NVMe bytes int8 / fp32: read %.3f write %.3f\n", read_ratio, write_ratio);
  // The plan counts the smaller state: it still bounds the measured peaks.
  EXPECT_LT(b.predicted[0].nvme, a.predicted[0].nvme);
  EXPECT_GE(b.predicted[0].nvme, b.measured[0].nvme);
  EXPECT_GE(b.predicted[0].pinned, b.measured[0].pinned);
}

// int8 -> fp32 -> int8: the fp32 run holds the decoded moments exactly and
// encoding them again gives the same codes and scales, at any world size
// (the blocks sit on the layer's grid, not the ranks'), so the last run
// continues exactly as a run resumed from the int8 checkpoint directly.
TEST(EngineInt8Moments, CheckpointsCrossMomentStoragesAndWorldSizes) {
  const fs::path saved = fresh_dir("saved"), through_fp32 = fresh_dir("through-fp32");
  TrainRun first = int8_run(2);
  first.steps = 4;
  apply_placement(first, Placement{2, OffloadDevice::kCpu, OffloadDevice::kNone});
  first.on_step = [saved](Engine& e, int, int64_t step) -> Status {
    if (step != 4) return Status::Ok();
    CheckpointSaveOptions o;
    o.dir = saved.string();
    return e.save_checkpoint(o).status();
  };
  first.on_end = [](Engine& e, int) { return e.wait_checkpoint().status(); };
  ASSERT_TRUE(train(first).status.ok());

  // Direct: int8 at world 2 from the int8 checkpoint.
  TrainRun direct = int8_run(2);
  direct.steps = 8;
  apply_placement(direct, Placement{3, OffloadDevice::kNvme, OffloadDevice::kNone, true, 4096});
  direct.on_start = [saved](Engine& e, int) { return e.load_checkpoint(saved.string()).status(); };
  const Outcome straight = train(direct);
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  ASSERT_EQ(straight.losses.size(), 4u);

  // Through an fp32 run at world 1 that loads and saves again at once.
  TrainRun middle = int8_run(1);
  middle.opt.moments = MomentStorage::fp32();
  middle.steps = 4;
  apply_placement(middle, Placement{1, OffloadDevice::kCpu, OffloadDevice::kNone});
  middle.on_start = [saved, through_fp32](Engine& e, int) -> Status {
    STRATA_RETURN_IF_ERROR(e.load_checkpoint(saved.string()).status());
    CheckpointSaveOptions o;
    o.dir = through_fp32.string();
    STRATA_RETURN_IF_ERROR(e.save_checkpoint(o).status());
    return e.wait_checkpoint().status();
  };
  ASSERT_TRUE(train(middle).status.ok());
  TrainRun again = direct;
  again.on_start = [through_fp32](Engine& e, int) { return e.load_checkpoint(through_fp32.string()).status(); };
  const Outcome cont = train(again);
  expect_same_losses(straight, cont, "int8 -> fp32 (world 1) -> int8 (world 2)");

  // fp32 continuing from the int8 checkpoint: the decoded moments, then fp32
  // steps: close to the int8 continuation, not equal.
  TrainRun in_fp32 = direct;
  in_fp32.opt.moments = MomentStorage::fp32();
  const Outcome f = train(in_fp32);
  ASSERT_TRUE(f.status.ok()) << f.status.to_string();
  ASSERT_EQ(f.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_LE(std::abs(f.losses[i] - straight.losses[i]), 0.02 * straight.losses[i]);

  // An fp32 checkpoint loads into an int8 run (its moments rounded).
  const fs::path fp32_saved = fresh_dir("fp32-saved");
  TrainRun fp32_first = first;
  fp32_first.opt.moments = MomentStorage::fp32();
  fp32_first.on_step = [fp32_saved](Engine& e, int, int64_t step) -> Status {
    if (step != 4) return Status::Ok();
    CheckpointSaveOptions o;
    o.dir = fp32_saved.string();
    return e.save_checkpoint(o).status();
  };
  ASSERT_TRUE(train(fp32_first).status.ok());
  TrainRun into_int8 = direct;
  into_int8.on_start = [fp32_saved](Engine& e, int) { return e.load_checkpoint(fp32_saved.string()).status(); };
  const Outcome rounded = train(into_int8);
  ASSERT_TRUE(rounded.status.ok()) << rounded.status.to_string();
  EXPECT_EQ(rounded.losses.size(), 4u);
}

TEST(EngineInt8Moments, PartialOffloadIsRefusedNamingTheRatio) {
  TrainRun r = int8_run(1);
  r.steps = 1;
  apply_placement(r, Placement{3, OffloadDevice::kCpu, OffloadDevice::kNone, true, 1'000'000'000, 1'000'000'000,
                               1'000'000'000, 0, 0.5});
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.status.code(), StatusCode::kUnsupported) << o.status.to_string();
  EXPECT_NE(o.status.message().find("ratio"), std::string::npos) << o.status.to_string();
  EXPECT_NE(o.status.message().find("int8"), std::string::npos) << o.status.to_string();
}

}  // namespace
}  // namespace strata::offload
