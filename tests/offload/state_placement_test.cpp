// StatePlacement (Note [State placement]): every placement decision, made
// once, and the memory plan as a pure function of it.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/state_placement.h"

namespace strata::offload {
namespace {

// Four layers: a big bf16 one, a small bf16 one (below the persistence
// threshold), a frozen bf16 one, a big fp32 one.
constexpr int64_t kBig = 3 * 4096;
constexpr int64_t kSmall = 512;

SpecModel four_layers() {
  std::vector<LayerDescription> layers;
  layers.push_back({"big", {{"big.weight", {kBig}, DType::kBF16, true, std::nullopt, 1.0}}});
  layers.push_back({"small", {{"small.weight", {kSmall}, DType::kBF16, true, std::nullopt, 1.0}}});
  layers.push_back({"frozen", {{"frozen.weight", {kBig}, DType::kBF16, false, std::nullopt, 1.0}}});
  layers.push_back({"fp32", {{"fp32.weight", {kBig}, DType::kF32, true, std::nullopt, 1.0}}});
  return SpecModel::create(std::move(layers)).value();
}

EngineOptions options(int stage, OffloadDevice optimizer, OffloadDevice params) {
  EngineOptions o;
  o.stage = stage;
  o.offload_optimizer = optimizer;
  o.offload_param = params;
  o.persistence_threshold = kSmall + 1;
  o.nvme.path = "/unused";
  o.nvme_param.path = "/unused";
  return o;
}

StatePlacement place(const EngineOptions& o, int world = 2, int rank = 1, bool host_addressable = true) {
  const PlannedDevice device = host_addressable ? PlannedDevice::cpu() : PlannedDevice::gpu();
  const SpecModel model = four_layers();
  const Partition part = Partition::create(model.layers(), world, o.sub_group_size).value();
  Result<StatePlacement> p = StatePlacement::compute(o, model.layers(), part, rank, device);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? *p : StatePlacement{};
}

TEST(StatePlacement, Stage1OnTheDeviceReadsGradientsInPlace) {
  const StatePlacement p = place(options(1, OffloadDevice::kNone, OffloadDevice::kNone));
  EXPECT_EQ(p.optimizer_state, StateHome::kDevice);
  EXPECT_TRUE(p.gradients_in_place);
  EXPECT_FALSE(p.device_kernel);  // the cpu device: its memory is the host's
  EXPECT_FALSE(p.owns_every_piece());
  EXPECT_EQ(p.owned_rank_begin(), 1);
  for (const LayerPlacement& l : p.layers) EXPECT_EQ(l.params, ParamHome::kWholeOnDevice);
  const LayerPlacement& big = p.layers[0];
  EXPECT_EQ(big.gradients, GradientBuffer::kPersistent);
  EXPECT_TRUE(big.master);
  EXPECT_FALSE(big.device_gradient_shard || big.pinned_gradient_shard);
  EXPECT_EQ(big.staging, UpdateStaging::kNone);
  EXPECT_EQ(p.shared_staging_bytes, 0u);
  // fp32 parameters stepped on the device are their own master.
  EXPECT_FALSE(p.layers[3].master);
  // A frozen layer: parameters and nothing else.
  const LayerPlacement& frozen = p.layers[2];
  EXPECT_TRUE(frozen.frozen);
  EXPECT_EQ(frozen.gradients, GradientBuffer::kNone);
  EXPECT_FALSE(frozen.master || frozen.pinned_gradient_shard || frozen.device_gradient_shard ||
               frozen.norm_gradient_copy);
  EXPECT_EQ(frozen.staging, UpdateStaging::kNone);
}

TEST(StatePlacement, Stage0OwnsEveryPiece) {
  const StatePlacement p = place(options(0, OffloadDevice::kNone, OffloadDevice::kNone));
  EXPECT_TRUE(p.owns_every_piece());
  EXPECT_EQ(p.owned_rank_begin(), 0);
  EXPECT_EQ(p.owned_rank_end(), 2);
}

TEST(StatePlacement, Stage2OnTheDeviceCopiesTheReducedShard) {
  const StatePlacement p = place(options(2, OffloadDevice::kNone, OffloadDevice::kNone));
  EXPECT_FALSE(p.gradients_in_place);
  EXPECT_EQ(p.layers[0].gradients, GradientBuffer::kPerStep);
  EXPECT_TRUE(p.layers[0].device_gradient_shard);
}

TEST(StatePlacement, DeviceTheHostCannotReadStepsWithTheDeviceKernelAndCopiesForTheNorm) {
  const StatePlacement p = place(options(1, OffloadDevice::kNone, OffloadDevice::kNone), 2, 1, false);
  EXPECT_TRUE(p.device_kernel);
  EXPECT_TRUE(p.layers[0].norm_gradient_copy);
  EXPECT_FALSE(p.layers[2].norm_gradient_copy);  // frozen: no gradient
  // The plan counts the copies (pinned, the padded layer at stage 1 in place).
  const SpecModel model = four_layers();
  const EngineOptions o = options(1, OffloadDevice::kNone, OffloadDevice::kNone);
  const EngineMemory with_copy = plan_engine_memory(o, model.layers(), 2, 1, PlannedDevice::gpu()).value();
  const EngineMemory without = plan_engine_memory(o, model.layers(), 2, 1, PlannedDevice::cpu()).value();
  EXPECT_GT(with_copy.pinned_grads, without.pinned_grads);
  EXPECT_EQ(with_copy.device, without.device);
}

TEST(StatePlacement, AtWorldOneAStage3ShardOnTheDeviceIsAcquiredInPlace) {
  const EngineOptions o = options(3, OffloadDevice::kNone, OffloadDevice::kNone);
  const StatePlacement one = place(o, 1, 0), two = place(o, 2, 1);
  EXPECT_TRUE(one.layers[0].acquired_in_place);
  EXPECT_FALSE(one.layers[1].acquired_in_place);  // whole on the device anyway
  EXPECT_FALSE(two.layers[0].acquired_in_place);  // a shard is half the layer: gathered
  EXPECT_FALSE(place(options(3, OffloadDevice::kCpu, OffloadDevice::kCpu), 1, 0).layers[0].acquired_in_place);
  const SpecModel model = four_layers();
  EXPECT_EQ(plan_engine_memory(o, model.layers(), 1, 0, PlannedDevice::cpu()).value().device_gathered, 0u);
  EXPECT_GT(plan_engine_memory(o, model.layers(), 2, 1, PlannedDevice::cpu()).value().device_gathered, 0u);
}

TEST(StatePlacement, Stage3CpuOffloadKeepsShardsInHostAndStagesOnlyWholeLayers) {
  const StatePlacement p = place(options(3, OffloadDevice::kCpu, OffloadDevice::kCpu));
  EXPECT_EQ(p.optimizer_state, StateHome::kPinnedHost);
  EXPECT_EQ(p.layers[0].params, ParamHome::kShardInPinnedHost);
  EXPECT_EQ(p.layers[1].params, ParamHome::kWholeOnDevice);  // below the persistence threshold
  EXPECT_EQ(p.layers[2].params, ParamHome::kShardInPinnedHost);  // frozen layers are partitioned too
  // The host optimizer writes a host shard in place; a whole layer's
  // pieces go through the one shared staging buffer (Note [Update staging]).
  EXPECT_EQ(p.layers[0].staging, UpdateStaging::kNone);
  EXPECT_EQ(p.layers[1].staging, UpdateStaging::kSharedPiece);
  EXPECT_EQ(p.layers[2].staging, UpdateStaging::kNone);  // frozen
  EXPECT_LE(p.shared_staging_bytes, kSmall * 2u);  // rank 1's piece of the small bf16 layer (possibly empty)
  EXPECT_TRUE(p.layers[0].pinned_gradient_shard);
  EXPECT_TRUE(p.layers[3].master);  // the host keeps fp32 masters for every dtype
}

TEST(StatePlacement, Stage2HostOptimizerStagesOnePieceAtATime) {
  // Stages 1-2 with the state on the host: every trained layer's pieces are
  // staged in one buffer, the largest piece (the fp32 layer's, at 4 B); the
  // plan counts it once, not per layer.
  EngineOptions o = options(2, OffloadDevice::kCpu, OffloadDevice::kNone);
  o.sub_group_size = 1024;
  const StatePlacement p = place(o);
  for (size_t li : {0u, 1u, 3u}) EXPECT_EQ(p.layers[li].staging, UpdateStaging::kSharedPiece) << li;
  EXPECT_EQ(p.layers[2].staging, UpdateStaging::kNone);
  const SpecModel model = four_layers();
  const Partition part = Partition::create(model.layers(), 2, o.sub_group_size).value();
  uint64_t largest = 0;
  for (size_t li : {0u, 1u, 3u})
    for (const SubGroup& g : part.layer(li).groups)
      largest = std::max<uint64_t>(largest, part.layer(li).piece_real(g, 1) * p.layers[li].param_element_bytes);
  EXPECT_EQ(p.shared_staging_bytes, largest);
  EXPECT_EQ(plan_engine_memory(o, part, p).pinned_staging, largest);
  // Early updates keep every layer's values until the step commits: one
  // buffer per layer, and no shared one.
  o.speculative_optimizer = SpeculationMode::kOn;
  const StatePlacement early = place(o);
  ASSERT_TRUE(early.early_updates);
  for (size_t li : {0u, 1u, 3u}) EXPECT_EQ(early.layers[li].staging, UpdateStaging::kLayer) << li;
  EXPECT_EQ(early.shared_staging_bytes, 0u);
  EXPECT_GT(plan_engine_memory(o, part, early).pinned_staging, largest);
}

TEST(StatePlacement, MaxInCpuKeepsTheFirstShardsInHostAndTheRestOnNvme) {
  EngineOptions o = options(3, OffloadDevice::kNvme, OffloadDevice::kNvme);
  const SpecModel model = four_layers();
  const Partition part = Partition::create(model.layers(), 2, o.sub_group_size).value();
  o.nvme_param.max_in_cpu = static_cast<int64_t>(part.layer(0).shard_elements);  // room for the first shard only
  const StatePlacement p = StatePlacement::compute(o, model.layers(), part, 0, PlannedDevice::cpu()).value();
  EXPECT_EQ(p.optimizer_state, StateHome::kNvme);
  EXPECT_EQ(p.layers[0].params, ParamHome::kShardInPinnedHost);
  EXPECT_EQ(p.layers[2].params, ParamHome::kShardOnNvme);
  EXPECT_EQ(p.layers[3].params, ParamHome::kShardOnNvme);
  EXPECT_EQ(p.param_elements_in_host, part.layer(0).shard_elements);
  EXPECT_EQ(p.largest_nvme_shard_bytes, part.layer(3).shard_elements * 4);  // the fp32 layer
  EXPECT_EQ(p.layers[0].staging, UpdateStaging::kNone);
  // The update of a shard on NVMe is stepped into a parameter slot and
  // written back from it: no staging of its own.
  EXPECT_EQ(p.layers[3].staging, UpdateStaging::kParameterSlot);
  EXPECT_EQ(p.layers[1].staging, UpdateStaging::kSharedPiece);  // whole on the device
  EXPECT_LE(p.shared_staging_bytes, kSmall * 2u);  // the small layer's piece only
  // The plan puts exactly those shards on NVMe, beside two versions of the state.
  const EngineMemory m = plan_engine_memory(o, part, p);
  uint64_t state_nvme = 0;
  for (size_t li : {0u, 1u, 3u}) {
    const LayerPartition& lp = part.layer(li);
    for (const SubGroup& g : lp.groups) state_nvme += 2 * nvme_piece_bytes(lp.piece_real(g, 0), true, o.moments);
  }
  EXPECT_EQ(m.nvme, state_nvme + part.layer(2).shard_elements * 2 + part.layer(3).shard_elements * 4);
}

TEST(StatePlacement, PartialOffloadSplitsTheState) {
  EngineOptions o = options(3, OffloadDevice::kCpu, OffloadDevice::kNone);
  o.ratio = 0.5;
  const StatePlacement p = place(o);
  EXPECT_TRUE(p.split);
  EXPECT_EQ(p.layers[0].params, ParamHome::kShardOnDevice);
  EXPECT_TRUE(p.layers[0].device_gradient_shard);  // the device part's input
  EXPECT_TRUE(p.layers[0].pinned_gradient_shard);
}

TEST(StatePlacement, ALayerTheEngineCannotStepIsRefusedNamingIt) {
  LayerSpec mixed;
  mixed.name = "mixed";
  mixed.params = {ParamTensorSpec{"mixed.a", {8}, DType::kBF16, 0, 0, true, std::nullopt, 1.0},
                  ParamTensorSpec{"mixed.b", {8}, DType::kF32, 16, 8, true, std::nullopt, 1.0}};
  mixed.param_bytes = 16 + 32;
  mixed.param_count = 16;
  LayerSpec ints;
  ints.name = "ints";
  ints.params = {ParamTensorSpec{"ints.table", {8}, DType::kI64, 0, 0, true, std::nullopt, 1.0}};
  ints.param_bytes = 64;
  ints.param_count = 8;
  LayerSpec half_frozen;
  half_frozen.name = "half\x1b";
  half_frozen.params = {ParamTensorSpec{"half.a", {8}, DType::kF32, 0, 0, true, std::nullopt, 1.0},
                        ParamTensorSpec{"half.b", {8}, DType::kF32, 32, 8, false, std::nullopt, 1.0}};
  half_frozen.param_bytes = 64;
  half_frozen.param_count = 16;
  const EngineOptions o = options(1, OffloadDevice::kNone, OffloadDevice::kNone);
  struct Case {
    LayerSpec spec;
    StatusCode code;
    std::string says;
  };
  for (const Case& c : {Case{mixed, StatusCode::kUnsupported, "layer 0 'mixed': tensor 'mixed.b' (fp32)"},
                        Case{ints, StatusCode::kUnsupported, "layer 0 'ints' has dtype"},
                        Case{half_frozen, StatusCode::kInvalidArgument, "tensor 'half.b' is frozen"}}) {
    const std::vector<LayerSpec> layers{c.spec};
    const Partition part = Partition::create(layers, 1, o.sub_group_size).value();
    Result<StatePlacement> p = StatePlacement::compute(o, layers, part, 0, PlannedDevice::cpu());
    ASSERT_FALSE(p.ok()) << c.spec.name;
    EXPECT_EQ(p.status().code(), c.code) << p.status().to_string();
    EXPECT_NE(p.status().message().find(c.says), std::string::npos) << p.status().message();
    EXPECT_EQ(p.status().message().find('\x1b'), std::string::npos) << "control characters are escaped";
  }
  const std::vector<LayerSpec> none;
  EXPECT_EQ(plan_engine_memory(o, none, 2, 2, PlannedDevice::cpu()).status().code(), StatusCode::kInvalidArgument);
}

// LayerPartition::piece_runs against piece_real rank by rank: the runs cover
// [begin, end) in order, each rank's piece_real is its run's, and there are at
// most three, for rank ranges that start and end before, at and after the
// partial piece.
TEST(Partition, PieceRunsAreEveryRanksPieceRealInOrder) {
  std::vector<LayerDescription> described;
  for (int64_t n : {int64_t{1}, int64_t{2048}, int64_t{40'000}, int64_t{100'003}, int64_t{0}})
    described.push_back({fmt::format("l{}", n), {{fmt::format("l{}.weight", n), {std::max<int64_t>(n, 1)}, DType::kF32,
                                                   n != 0, std::nullopt, 1.0}}});
  const SpecModel model = SpecModel::create(std::move(described)).value();
  size_t partial_runs = 0;
  for (int world : {1, 2, 3, 7, 33, 64})
    for (const int64_t sub_group : {int64_t{1'000'000'000}, int64_t{8192}}) {
      const Partition part = Partition::create(model.layers(), world, sub_group).value();
      for (size_t li = 0; li < part.layer_count(); ++li)
        for (const SubGroup& g : part.layer(li).groups)
          for (int begin = 0; begin <= world; ++begin)
            for (int end = begin; end <= world; ++end) {
              const LayerPartition::PieceRuns runs = part.layer(li).piece_runs(g, begin, end);
              ASSERT_LE(runs.count, 3u);
              int rank = begin;
              for (const LayerPartition::PieceRun& run : runs) {
                ASSERT_GE(run.ranks, 1u);
                partial_runs += run.real != 0 && run.real != g.piece;
                for (uint64_t i = 0; i < run.ranks; ++i, ++rank)
                  ASSERT_EQ(run.real, part.layer(li).piece_real(g, rank))
                      << fmt::format("layer {} world {} ranks [{}, {}) rank {}", li, world, begin, end, rank);
              }
              EXPECT_EQ(rank, end) << fmt::format("layer {} world {} ranks [{}, {})", li, world, begin, end);
            }
    }
  EXPECT_GT(partial_runs, 0u);  // some sub-group ends mid-piece
}

// Partition::distinct_ranks: every rank's plan equals the plan of the first
// rank of its run, so the largest over those ranks is the largest over all
// (what `strata plan --model` and `strata estimate --model` print), for every
// stage and placement, on both kinds of device, at world sizes whose pieces
// end mid-layer, mid-piece and past the last element.
TEST(StatePlacement, EachRankPlansAsTheFirstRankOfItsRun) {
  std::vector<LayerDescription> described;
  for (int64_t n : {kBig, kSmall, int64_t{100'003}, int64_t{2048}, int64_t{40'000}})
    described.push_back({fmt::format("l{}", n), {{fmt::format("l{}.weight", n), {n}, DType::kBF16, true, std::nullopt, 1.0}}});
  const SpecModel model = SpecModel::create(std::move(described)).value();
  auto same = [](const EngineMemory& a, const EngineMemory& b) {
    return a.device == b.device && a.device_params == b.device_params && a.device_grads == b.device_grads &&
           a.device_optimizer == b.device_optimizer && a.device_gathered == b.device_gathered &&
           a.pinned == b.pinned && a.pinned_optimizer == b.pinned_optimizer && a.pinned_grads == b.pinned_grads &&
           a.pinned_staging == b.pinned_staging && a.pinned_params == b.pinned_params &&
           a.pinned_speculation == b.pinned_speculation && a.nvme == b.nvme &&
           a.snapshot_slot_bytes == b.snapshot_slot_bytes;
  };
  struct Case {
    int stage;
    OffloadDevice optimizer, params;
  };
  const Case cases[] = {{0, OffloadDevice::kNone, OffloadDevice::kNone}, {1, OffloadDevice::kCpu, OffloadDevice::kNone},
                        {2, OffloadDevice::kNvme, OffloadDevice::kNone}, {2, OffloadDevice::kNone, OffloadDevice::kNone},
                        {3, OffloadDevice::kCpu, OffloadDevice::kCpu},   {3, OffloadDevice::kNvme, OffloadDevice::kNvme},
                        {3, OffloadDevice::kNone, OffloadDevice::kNone}};
  size_t runs_shorter_than_world = 0;
  for (const Case& c : cases)
    for (const int64_t sub_group : {int64_t{1'000'000'000}, int64_t{8192}})
      for (const bool gpu : {false, true})
        for (int world : {1, 2, 3, 5, 7, 16, 33, 64}) {
          EngineOptions o = options(c.stage, c.optimizer, c.params);
          o.sub_group_size = sub_group;
          const PlannedDevice device = gpu ? PlannedDevice::gpu() : PlannedDevice::cpu();
          const Partition part = Partition::create(model.layers(), world, o.sub_group_size).value();
          const std::vector<int> starts = part.distinct_ranks();
          ASSERT_FALSE(starts.empty());
          EXPECT_EQ(starts.front(), 0);
          runs_shorter_than_world += starts.size() < static_cast<size_t>(world);
          size_t run = 0;
          for (int r = 0; r < world; ++r) {
            while (run + 1 < starts.size() && starts[run + 1] <= r) ++run;
            const EngineMemory mine = plan_engine_memory(o, model.layers(), world, r, device).value();
            const EngineMemory first = plan_engine_memory(o, model.layers(), world, starts[run], device).value();
            EXPECT_TRUE(same(mine, first)) << fmt::format("stage {} world {} rank {} (run from rank {}) {}", c.stage,
                                                          world, r, starts[run], gpu ? "gpu" : "cpu");
            // What the fit's final check reads from the placement besides the plan.
            const StatePlacement mine_placed = StatePlacement::compute(o, model.layers(), part, r, device).value();
            const StatePlacement first_placed =
                StatePlacement::compute(o, model.layers(), part, starts[run], device).value();
            EXPECT_EQ(mine_placed.largest_nvme_shard_bytes, first_placed.largest_nvme_shard_bytes);
            EXPECT_EQ(mine_placed.gradient_nvme_bytes, first_placed.gradient_nvme_bytes);
            EXPECT_EQ(mine_placed.gradient_slot_count, first_placed.gradient_slot_count);
            EXPECT_EQ(mine_placed.gradient_slot_bytes, first_placed.gradient_slot_bytes);
            for (size_t li = 0; li < mine_placed.layers.size(); ++li) {
              const LayerPlacement& a = mine_placed.layers[li];
              const LayerPlacement& b = first_placed.layers[li];
              EXPECT_TRUE(a.shard_on_nvme() == b.shard_on_nvme() && a.persistent() == b.persistent() &&
                          a.acquired_in_place == b.acquired_in_place && a.gradients == b.gradients)
                  << fmt::format("stage {} world {} rank {} layer {}", c.stage, world, r, li);
            }
          }
        }
  EXPECT_GT(runs_shorter_than_world, 0u);  // the runs do merge ranks
}

}  // namespace
}  // namespace strata::offload
