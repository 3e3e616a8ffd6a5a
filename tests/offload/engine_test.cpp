// The ZeRO engine (offload/engine.h) driving the GPT on local ranks:
//  - the parity matrix: for each world size, every stage x optimizer
//    placement x parameter placement x overlap setting gives bit-identical
//    losses to stage 0 (fp32, bf16, fp16; clipping on, accumulation 2), and
//    across world sizes with the same global batch losses agree to 1e-5;
//  - fp16 overflow on one rank: the step is skipped on every rank, the scale
//    halves, and every piece of state is bit-identical to the step before;
//  - fp32 overflow stops with the step number;
//  - memory: stage 3 + cpu offload on 4 ranks holds under 1/3 of stage 0's
//    device bytes per rank;
//  - the partition and the block sums on their own, and bad options.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/offload/engine.h"
#include "engine_harness.h"
#include "strata/offload/grad_norm.h"
#include "strata/offload/partition.h"

namespace strata::offload {
namespace {

class ParityMatrix : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(ParityMatrix, EveryPlacementMatchesStageZeroBitForBit) {
  const auto [world, dtype] = GetParam();
  TrainRun base;
  base.world = world;
  base.gpt = small_gpt(dtype);
  base.opt.grad_dtype = dtype;
  base.opt.fp16.enabled = dtype == DType::kF16;
  const Outcome ref = train(base);
  ASSERT_TRUE(ref.status.ok()) << ref.status.to_string();
  ASSERT_EQ(ref.losses.size(), 30u);
  // It learns: the last loss is well below the first.
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 1.0);
  for (const Placement& p : matrix()) {
    TrainRun r = base;
    apply_placement(r, p);
    expect_same_losses(ref, train(r), fmt::format("world {} {} {}", world, dtype_name(dtype), p.name()));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ParityMatrix,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)),
                         [](const auto& info) {
                           return fmt::format("world{}_{}", std::get<0>(info.param),
                                              dtype_name(std::get<1>(info.param)));
                         });

TEST(EngineAcrossWorlds, SameGlobalBatchAgreesWithinOneInTenThousandThousand) {
  std::vector<Outcome> outs;
  for (int world : {1, 2, 4}) {
    TrainRun r;
    r.world = world;
    r.steps = 100;
    r.opt.hyper.lr = 1e-3;
    r.opt.stage = world == 1 ? 0 : 3;
    r.opt.offload_optimizer = OffloadDevice::kCpu;
    outs.push_back(train(r));
    ASSERT_TRUE(outs.back().status.ok()) << outs.back().status.to_string();
  }
  for (size_t w = 1; w < outs.size(); ++w)
    for (size_t i = 0; i < outs[0].losses.size(); ++i)
      EXPECT_LE(std::abs(outs[w].losses[i] - outs[0].losses[i]) / std::abs(outs[0].losses[i]), 1e-5)
          << "world " << (w == 1 ? 2 : 4) << " step " << i + 1;
}

// An Inf gradient on rank 1 at step 4 (fp16, hysteresis 1): every rank
// skips the step, the scale halves, and every state stays bit-identical.
TEST(EngineFp16, OverflowOnOneRankSkipsTheStepEverywhereAndChangesNothing) {
  TrainRun r;
  r.world = 2;
  r.steps = 6;
  r.gpt = small_gpt(DType::kF16);
  r.opt.grad_dtype = DType::kF16;
  r.opt.stage = 2;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  r.opt.fp16.enabled = true;
  r.opt.fp16.hysteresis = 1;
  r.faults.gradient = testing::GradientFault{.step = 4, .rank = 1, .layer = 1,
                                             .value = std::numeric_limits<float>::infinity()};
  using K = Engine::StateKind;
  std::mutex mu;
  std::map<int64_t, std::vector<std::vector<float>>> snapshots;  // rank 0, per step
  r.after_step = [&](Engine& e, int64_t step) {
    std::vector<std::vector<float>> all;
    for (size_t li = 0; li < e.partition().layer_count(); ++li)
      for (K k : {K::kMaster, K::kExpAvg, K::kExpAvgSq}) all.push_back(e.gather_state(li, k).value());
    if (e.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      snapshots[step] = std::move(all);
    }
  };
  const Outcome o = train(r);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  ASSERT_EQ(o.metrics.size(), 6u);
  EXPECT_FALSE(o.metrics[2].skipped);
  EXPECT_TRUE(o.metrics[3].skipped);
  EXPECT_FALSE(o.metrics[4].skipped);
  EXPECT_EQ(o.metrics[3].step, o.metrics[2].step) << "a skipped step is not counted";
  EXPECT_EQ(o.metrics[3].loss_scale, 65536.0);
  EXPECT_EQ(o.metrics[4].loss_scale, 32768.0) << "the scale halves after the overflow";
  ASSERT_EQ(snapshots[3].size(), snapshots[4].size());
  for (size_t i = 0; i < snapshots[3].size(); ++i)
    EXPECT_EQ(0, std::memcmp(snapshots[3][i].data(), snapshots[4][i].data(), snapshots[3][i].size() * 4))
        << "state " << i << " changed in the skipped step";
  EXPECT_NE(0, std::memcmp(snapshots[4][0].data(), snapshots[5][0].data(), snapshots[4][0].size() * 4))
      << "training goes on after the skipped step";
}

TEST(EngineFp32, NonFiniteGradientStopsWithTheStepNumber) {
  TrainRun r;
  r.world = 2;
  r.steps = 5;
  r.opt.stage = 1;
  r.faults.gradient = testing::GradientFault{.step = 3, .rank = 0, .value = std::numeric_limits<float>::quiet_NaN()};
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.status.code(), StatusCode::kDataLoss);
  EXPECT_NE(o.status.message().find("step 3"), std::string::npos) << o.status.message();
}

// Parameters dominate this model's device memory (wide layers, one short
// sequence), so the ZeRO ledger shows: stage 3 + cpu offload on 4 ranks
// keeps a shard, one or two gathered layers and one layer's gradient.
TEST(EngineMemory, Stage3CpuOffloadOnFourRanksHoldsUnderAThirdOfStageZero) {
  TrainRun base;
  base.world = 4;
  base.global_batch = 4;
  base.seq_len = 8;
  base.steps = 2;
  base.gpt.n_embd = 128;
  base.gpt.n_layer = 4;
  base.gpt.n_head = 4;
  base.opt.grad_accum = 1;
  const Outcome s0 = train(base);
  ASSERT_TRUE(s0.status.ok()) << s0.status.to_string();
  TrainRun r = base;
  r.opt.stage = 3;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  r.opt.offload_param = OffloadDevice::kCpu;
  r.opt.persistence_threshold = 0;
  r.opt.max_reuse_distance = 0;
  r.opt.prefetch_bucket_size = 0;
  // About two blocks' worth of gathered parameters and of unreduced gradients.
  r.opt.max_live_parameters = 2 * 12 * 128 * 128 + 2 * kShardAlign * 4;
  r.opt.reduce_bucket_size = 2 * 12 * 128 * 128 + 2 * kShardAlign * 4;
  const Outcome s3 = train(r);
  ASSERT_TRUE(s3.status.ok()) << s3.status.to_string();
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_LT(s3.peak_device[rank] * 3, s0.peak_device[rank])
        << "rank " << rank << ": stage 3 " << s3.peak_device[rank] << " B vs stage 0 " << s0.peak_device[rank] << " B";
  EXPECT_EQ(s0.losses, s3.losses);
}

// A rank that fails mid-run ends every other rank with an error naming it,
// at once (its departure), not after the watchdog and never as a hang.
TEST(EngineRanks, ARankThatFailsEndsEveryRankWithAnErrorNamingIt) {
  TrainRun r;
  r.world = 3;
  r.steps = 6;
  r.opt.stage = 3;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  r.fail_rank = 1;
  r.fail_step = 2;
  const auto t0 = std::chrono::steady_clock::now();
  const Outcome o = train(r);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(o.status.ok());
  // Rank 0's error (the first in rank order) names rank 1.
  EXPECT_NE(o.status.message().find("rank 1"), std::string::npos) << o.status.to_string();
  EXPECT_LT(seconds, 60.0) << "ranks waited for the watchdog instead of seeing the departure";
}

// An I/O error while the optimizer writes its state back to NVMe fails the
// step on every rank with the file, the offset and the piece, and no rank
// hangs (the previous version stays readable: the tier's shadow writes,
// tested in nvme_state_tier_test).
TEST(EngineNvme, WriteErrorMidStepFailsTheStepNamingTheFileOffsetAndPiece) {
  FaultyEngines faults(2, /*reads=*/false, /*writes=*/true);
  TrainRun r;
  r.world = 2;
  r.steps = 5;
  r.opt.stage = 2;
  r.opt.offload_optimizer = OffloadDevice::kNvme;
  r.opt.overlap_optimizer = false;
  r.opt.nvme.path = ::testing::TempDir();
  r.opt.nvme.pipeline_read = r.opt.nvme.pipeline_write = true;
  r.after_step = [&](Engine& e, int64_t step) {
    if (step == 2) faults.counters[e.rank()]->arm(3);  // a few clean writes, then EIO
  };
  r.engine_for_rank = [&](int rank) { return faults[rank]; };
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  // A write-back's failure surfaces at the tier's next call: in step 3 or 4.
  EXPECT_GE(o.metrics.size(), 2u);
  EXPECT_LT(o.metrics.size(), 5u);
  const std::string msg = o.status.to_string();
  EXPECT_NE(msg.find("optimizer state of layer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the previous version stays readable"), std::string::npos) << msg;
  EXPECT_NE(msg.find("swap.bin offset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  EXPECT_GT(faults.eio(), 0u);
}

TEST(EngineMemory, DeviceTooSmallNamesTheStateAndTheTier) {
  TrainRun r;
  r.steps = 1;
  r.gpt.n_embd = 128;
  r.gpt.n_layer = 4;
  r.gpt.n_head = 4;
  r.device_bytes = 6 << 20;  // activations fit; 13 MiB of parameters + optimizer state do not
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.status.code(), StatusCode::kOutOfMemory) << o.status.to_string();
  EXPECT_NE(o.status.message().find("device memory"), std::string::npos) << o.status.message();
  // Refused before anything is allocated, with the plan's row and the fix.
  EXPECT_NE(o.status.message().find("stage 0, optimizer none, params none on 1 rank(s) needs"), std::string::npos)
      << o.status.message();
  EXPECT_NE(o.status.message().find("optimizer state"), std::string::npos) << o.status.message();
  EXPECT_NE(o.status.message().find("offload_optimizer.device"), std::string::npos) << o.status.message();
}

TEST(EngineMemory, HostBudgetTooSmallNamesTheLargestHostBuffer) {
  TrainRun r;
  r.steps = 1;
  r.world = 2;
  r.opt.stage = 2;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  r.opt.host_memory_budget = 64 << 10;
  const Outcome o = train(r);
  ASSERT_FALSE(o.status.ok());
  EXPECT_EQ(o.status.code(), StatusCode::kResourceExhausted) << o.status.to_string();
  EXPECT_NE(o.status.message().find("strata.host_memory_budget is 64.00 KiB"), std::string::npos) << o.status.message();
  EXPECT_NE(o.status.message().find("the largest is the optimizer state"), std::string::npos) << o.status.message();
  // Within the budget it trains.
  r.opt.host_memory_budget = 64 << 20;
  EXPECT_TRUE(train(r).status.ok());
}

// The plan (made before allocating) against what the run held, per rank:
// measured <= predicted <= 1.25 x measured for device and pinned memory.
TEST(EngineMemory, PredictedPeaksBoundTheMeasuredOnesWithinAQuarter) {
  using D = OffloadDevice;
  struct Case {
    int world, stage;
    D opt, param;
    DType dtype;
    int64_t live, bucket;
    double ratio = 1.0;
  };
  const int64_t layer = 12 * 128 * 128;  // one block's elements
  for (const Case& c : {Case{1, 0, D::kNone, D::kNone, DType::kF32, 1'000'000'000, 500'000'000},
                        Case{2, 1, D::kCpu, D::kNone, DType::kBF16, 1'000'000'000, 500'000'000},
                        Case{2, 2, D::kNone, D::kNone, DType::kF32, 1'000'000'000, 2 * layer},
                        Case{4, 3, D::kCpu, D::kCpu, DType::kBF16, 2 * layer, 2 * layer},
                        Case{2, 3, D::kCpu, D::kNone, DType::kF32, 1'000'000'000, 500'000'000},
                        Case{2, 3, D::kCpu, D::kNone, DType::kBF16, 2 * layer, 2 * layer, 0.5},
                        Case{2, 3, D::kNvme, D::kCpu, DType::kBF16, 2 * layer, 2 * layer},
                        Case{2, 3, D::kCpu, D::kNvme, DType::kBF16, 2 * layer, 2 * layer}}) {
    TrainRun r;
    r.world = c.world;
    r.steps = 2;
    r.global_batch = 4;
    r.seq_len = 8;
    r.gpt.n_embd = 128;
    r.gpt.n_layer = 4;
    r.gpt.n_head = 4;
    r.gpt.param_dtype = c.dtype;
    r.opt.grad_dtype = c.dtype;
    r.opt.stage = c.stage;
    r.opt.offload_optimizer = c.opt;
    r.opt.offload_param = c.param;
    r.opt.max_live_parameters = c.live;
    r.opt.reduce_bucket_size = c.bucket;
    r.opt.ratio = c.ratio;
    r.opt.nvme.path = ::testing::TempDir();
    r.opt.nvme_param.path = ::testing::TempDir();
    r.opt.nvme_param.max_in_cpu = 200'000;  // the first layers' shards in host memory, the rest on NVMe
    r.opt.max_reuse_distance = 0;
    r.opt.persistence_threshold = 0;
    const Outcome o = train(r);
    ASSERT_TRUE(o.status.ok()) << o.status.to_string();
    for (int rank = 0; rank < c.world; ++rank) {
      const EngineMemory& p = o.predicted[rank];
      const EngineMemory& m = o.measured[rank];
      const std::string what = fmt::format("world {} stage {} optimizer {} param {} {} rank {}: device measured {} "
                                           "predicted {}, pinned measured {} predicted {}",
                                           c.world, c.stage, offload_device_name(c.opt), offload_device_name(c.param),
                                           dtype_name(c.dtype), rank, m.device, p.device, m.pinned, p.pinned);
      EXPECT_LE(m.device, p.device) << what;
      EXPECT_LE(p.device, m.device * 1.25) << what;
      EXPECT_LE(m.pinned, p.pinned) << what;
      EXPECT_LE(p.pinned, m.pinned * 1.25) << what;
      if (c.opt == D::kNvme || c.param == D::kNvme) {
        EXPECT_GT(p.nvme, 0u) << what;
      }
    }
  }
}

TEST(EngineOptions, RefusesWhatItCannotRunWithTheKeyAndTheFix) {
  Config cfg;
  cfg.source = "ds.json";
  cfg.zero_optimization.stage = 3;
  cfg.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  Result<EngineOptions> r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("offload_optimizer.nvme_path is not set"), std::string::npos)
      << r.status().message();
  cfg.zero_optimization.offload_optimizer.nvme_path = "/tmp";
  r = engine_options_from_config(cfg);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->nvme.path, "/tmp");
  cfg.zero_optimization.offload_param.device = OffloadDevice::kNvme;  // without its nvme_path
  r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("offload_param.nvme_path is not set"), std::string::npos) << r.status().message();
  cfg.zero_optimization.offload_param.nvme_path = "/tmp";
  r = engine_options_from_config(cfg);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->nvme_param.path, "/tmp");
  cfg.zero_optimization.offload_param.device = OffloadDevice::kNone;
  cfg.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  cfg.zero_optimization.stage = 2;
  cfg.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("needs stage 3"), std::string::npos) << r.status().message();
  cfg.zero_optimization.offload_param.device = OffloadDevice::kNone;
  cfg.zero_optimization.offload_optimizer.ratio = 0.5;  // at stage 2: refused
  r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ratio 0.5 (partial offload) needs stage 3"), std::string::npos)
      << r.status().message();
  cfg.zero_optimization.stage = 3;
  r = engine_options_from_config(cfg);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->ratio, 0.5);
  cfg.zero_optimization.stage = 2;
  cfg.zero_optimization.offload_optimizer.ratio = 1.0;
  cfg.data_types.grad_accum_dtype = "int8";
  r = engine_options_from_config(cfg);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("data_types.grad_accum_dtype"), std::string::npos);
  cfg.data_types.grad_accum_dtype = "fp32";
  cfg.bf16.enabled = true;
  r = engine_options_from_config(cfg);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->stage, 2);
  EXPECT_EQ(r->grad_dtype, DType::kF32);
}

TEST(EngineRatio, HostPartIsAWholeNumberOfVectorsAndTheRestStaysOnTheDevice) {
  EXPECT_EQ(host_part(1.0, 1000), 1000u);
  EXPECT_EQ(host_part(0.5, 1000), 496u);
  EXPECT_EQ(host_part(0.5, 10), 0u);
  EXPECT_EQ(host_part(0.25, 4096), 1024u);
}

TEST(Partition, PiecesAreAlignedPaddedAtTheLayerEndAndCoverEveryElement) {
  std::vector<LayerSpec> layers(3);
  layers[0].name = "a";
  layers[0].param_count = 10'000;
  layers[1].name = "b";
  layers[1].param_count = 0;
  layers[2].name = "c";
  layers[2].param_count = 3 * 8192 + 5;
  for (int world : {1, 2, 3, 4}) {
    Partition p = Partition::create(layers, world, 8192).value();
    EXPECT_EQ(p.sub_group_elements() % (kShardAlign * world), 0u);
    for (size_t li = 0; li < 3; ++li) {
      const LayerPartition& lp = p.layer(li);
      size_t real = 0;
      for (size_t gi = 0; gi < lp.groups.size(); ++gi) {
        const SubGroup& g = lp.groups[gi];
        EXPECT_EQ(g.piece % kShardAlign, 0u);
        // Only the last sub-group has padding, so real elements are a prefix.
        if (gi + 1 < lp.groups.size()) {
          EXPECT_EQ(g.real, g.piece * world);
        }
        EXPECT_EQ(g.padded_begin, real);
        for (int r = 0; r < world; ++r) real += lp.piece_real(g, r);
      }
      EXPECT_EQ(real, lp.elements) << "world " << world << " layer " << li;
      EXPECT_EQ(lp.padded_elements, lp.shard_elements * world);
    }
  }
  EXPECT_EQ(Partition::create(layers, 2, 1).value().sub_group_elements(), 2 * kShardAlign);
  EXPECT_FALSE(Partition::create(layers, 0, 8192).ok());
  EXPECT_FALSE(Partition::create(layers, 2, 0).ok());
  EXPECT_EQ(Partition::create(layers, 2, 8192).value().describe(StateId{2, 1, 1}), "layer 2 'c' group 1 rank 1");
}

TEST(BlockSums, DoNotDependOnWhereABlockLivesAndCarryNonFiniteValues) {
  std::vector<float> g(4 * kShardAlign);
  for (size_t i = 0; i < g.size(); ++i) g[i] = std::sin(0.001f * static_cast<float>(i)) * 1e-3f;
  std::vector<double> all(4), one(1);
  block_sums_of_squares(g.data(), DType::kF32, g.size(), kShardAlign, all);
  // The same block copied elsewhere gives the same bits.
  std::vector<float> copy(g.begin() + 2 * kShardAlign, g.begin() + 3 * kShardAlign);
  block_sums_of_squares(copy.data(), DType::kF32, copy.size(), kShardAlign, one);
  EXPECT_EQ(std::bit_cast<uint64_t>(one[0]), std::bit_cast<uint64_t>(all[2]));
  double naive = 0;
  for (size_t i = 2 * kShardAlign; i < 3 * kShardAlign; ++i) naive += double(g[i]) * g[i];
  EXPECT_NEAR(one[0], naive, 1e-12 * naive);
  copy[7] = std::numeric_limits<float>::infinity();
  block_sums_of_squares(copy.data(), DType::kF32, copy.size(), kShardAlign, one);
  EXPECT_TRUE(std::isinf(one[0]));
  copy[7] = std::numeric_limits<float>::quiet_NaN();
  block_sums_of_squares(copy.data(), DType::kF32, copy.size(), kShardAlign, one);
  EXPECT_TRUE(std::isnan(one[0]));
}

}  // namespace
}  // namespace strata::offload
