// The estimator against design.md's ledger (exact numbers), its offload
// rules, buffers, precision options and the JSON shape.
#include <random>

#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"
#include "strata/core/estimator.h"

namespace strata {
namespace {

constexpr auto kNone = OffloadDevice::kNone;
constexpr auto kCpu = OffloadDevice::kCpu;
constexpr auto kNvme = OffloadDevice::kNvme;

EstimateInput input(uint64_t params, uint32_t gpus, uint32_t nodes = 1) {
  EstimateInput in;
  in.params = params;
  in.gpus_per_node = gpus;
  in.nodes = nodes;
  return in;
}

EstimateRow row(const EstimateInput& in, int stage, OffloadDevice opt = kNone, OffloadDevice param = kNone) {
  auto r = estimate_row(in, Placement{stage, opt, param});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : EstimateRow{};
}

// design.md section 1, written as the table reads ((4 + 12/N) Psi is
// (4N + 12) Psi / N), in exact integer arithmetic for Psi divisible by N.
uint64_t reference_bytes_per_rank(int stage, uint64_t psi, uint64_t n) {
  const unsigned __int128 p = psi;
  switch (stage) {
    case 0: return static_cast<uint64_t>(16 * p);
    case 1: return static_cast<uint64_t>((4 * n + 12) * p / n);
    case 2: return static_cast<uint64_t>((2 * n + 14) * p / n);
    default: return static_cast<uint64_t>(16 * p / n);
  }
}

TEST(Estimator, ByteCountsBeyond64BitsAreAnErrorNotASaturatedNumber) {
  auto huge = estimate_memory(input(2'000'000'000'000'000'000ull, 1));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("exceed 2^64 bytes"), std::string::npos) << huge.status().message();
  EXPECT_TRUE(estimate_memory(input(1'000'000'000'000'000ull, 8)).ok());  // 1e15 still fits
  auto world = estimate_memory(input(7'000'000'000ull, 65536, 65536));
  ASSERT_FALSE(world.ok());
  EXPECT_NE(world.status().message().find("GPUs is more than"), std::string::npos) << world.status().message();
  EXPECT_TRUE(estimate_memory(input(7'000'000'000ull, 8)).ok());  // and the next estimate is clean again
}

TEST(Estimator, DesignExamplesExactly) {
  EXPECT_EQ(row(input(7'000'000'000, 1), 0).gpu_model_state_bytes, 112'000'000'000ull);
  EXPECT_EQ(row(input(7'000'000'000, 8), 0).gpu_model_state_bytes, 112'000'000'000ull);
  const EstimateInput in = input(13'000'000'000, 4);
  EXPECT_EQ(row(in, 1).gpu_model_state_bytes, 91'000'000'000ull);
  EXPECT_EQ(row(in, 2).gpu_model_state_bytes, 71'500'000'000ull);
  EXPECT_EQ(row(in, 3).gpu_model_state_bytes, 52'000'000'000ull);
}

TEST(Estimator, MatchesTheLedgerTableForManySizes) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t gpus = 1 + static_cast<uint32_t>(rng() % 16);
    const uint32_t nodes = 1 + static_cast<uint32_t>(rng() % 4);
    const uint64_t world = static_cast<uint64_t>(gpus) * nodes;
    const uint64_t psi = world * (1 + rng() % 5'000'000'000ull / world);
    const EstimateInput in = input(psi, gpus, nodes);
    for (int stage = 0; stage <= 3; ++stage) {
      EXPECT_EQ(row(in, stage).gpu_model_state_bytes, reference_bytes_per_rank(stage, psi, world))
          << "psi " << psi << " world " << world << " stage " << stage;
    }
  }
}

TEST(Estimator, ShardsRoundUpLikePaddedPartitions) {
  const EstimateInput in = input(10, 4);  // shard = ceil(10 / 4) = 3
  EXPECT_EQ(row(in, 3).gpu_model_state_bytes, 16ull * 3);
  EXPECT_EQ(row(in, 1).gpu_model_state_bytes, 4ull * 10 + 12ull * 3);
}

TEST(Estimator, OptimizerOffloadMovesStateAndFp32Gradients) {
  const EstimateInput in = input(13'000'000'000, 4);
  const uint64_t shard = 3'250'000'000;
  const EstimateRow s1 = row(in, 1, kCpu);
  EXPECT_EQ(s1.gpu_model_state_bytes, 4 * 13'000'000'000ull);  // params + full gradients stay
  EXPECT_EQ(s1.cpu_bytes_per_node, 16 * shard * 4);          // (12 + 4) x shard x 4 GPUs
  const EstimateRow s2 = row(in, 2, kCpu);
  EXPECT_EQ(s2.gpu_model_state_bytes, 26'000'000'000ull);  // DeepSpeed: 2P
  EXPECT_EQ(s2.cpu_bytes_per_node, 208'000'000'000ull);
  EXPECT_EQ(s2.nvme_bytes_per_node, 0ull);
  const EstimateRow s2n = row(in, 2, kNvme);
  EXPECT_EQ(s2n.gpu_model_state_bytes, 26'000'000'000ull);
  EXPECT_EQ(s2n.cpu_bytes_per_node, 4 * shard * 4);  // fp32 gradient shard stays in pinned host memory
  EXPECT_EQ(s2n.nvme_bytes_per_node, 12 * shard * 4);
  const EstimateRow s3 = row(in, 3, kCpu);
  EXPECT_EQ(s3.gpu_model_state_bytes, 2 * shard);  // DeepSpeed: 2P/G (+ 4L, counted as buffers)
}

TEST(Estimator, ParameterOffloadMovesTheSixteenBitShard) {
  const EstimateInput in = input(13'000'000'000, 4);
  const uint64_t shard = 3'250'000'000;
  EXPECT_EQ(row(in, 3, kNone, kCpu).gpu_model_state_bytes, 14 * shard);
  EXPECT_EQ(row(in, 3, kNone, kCpu).cpu_bytes_per_node, 2 * shard * 4);
  const EstimateRow all_cpu = row(in, 3, kCpu, kCpu);
  EXPECT_EQ(all_cpu.gpu_model_state_bytes, 0ull);
  EXPECT_EQ(all_cpu.cpu_bytes_per_node, 18 * shard * 4);  // DeepSpeed: 18P per node
  const EstimateRow all_nvme = row(in, 3, kNvme, kNvme);
  EXPECT_EQ(all_nvme.gpu_model_state_bytes, 0ull);
  EXPECT_EQ(all_nvme.cpu_bytes_per_node, 4 * shard * 4);
  EXPECT_EQ(all_nvme.nvme_bytes_per_node, 14 * shard * 4);
  const EstimateRow mixed = row(in, 3, kNvme, kCpu);
  EXPECT_EQ(mixed.cpu_bytes_per_node, (4 + 2) * shard * 4);
  EXPECT_EQ(mixed.nvme_bytes_per_node, 12 * shard * 4);
}

// Every row conserves the state: what leaves the GPU arrives on the host or
// NVMe, plus the fp32 copy of the offloaded gradients.
TEST(Estimator, StateIsConservedAcrossTiers) {
  const EstimateInput in = input(8'000'000'000, 8);
  const uint64_t shard = 1'000'000'000;
  for (const Placement& pl : estimate_placements()) {
    if (pl.stage != 3) continue;
    const EstimateRow r = row(in, pl.stage, pl.optimizer, pl.param);
    const uint64_t per_rank = r.gpu_model_state_bytes + (r.cpu_bytes_per_node + r.nvme_bytes_per_node) / 8;
    const uint64_t extra = pl.optimizer == kNone ? 0 : (4 - 2) * shard;  // fp32 host gradients replace bf16 ones
    EXPECT_EQ(per_rank, 16 * shard + extra) << offload_device_name(pl.optimizer) << "/" << offload_device_name(pl.param);
  }
}

TEST(Estimator, SixteenRows) {
  auto e = estimate_memory(input(1'000'000'000, 2));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->rows.size(), 16ull);
  EXPECT_EQ(estimate_placements().size(), 16ull);
  for (const EstimateRow& r : e->rows) EXPECT_FALSE(r.fits.has_value());
}

TEST(Estimator, GpuBuffers) {
  EstimateInput in = input(7'000'000'000, 8);
  in.largest_layer_params = 200'000'000;
  const EstimateRow s2 = row(in, 2);
  EXPECT_EQ(s2.buffers.reduce_buckets, 500'000'000ull * 2);     // one bucket: overlap_comm off below stage 3
  EXPECT_EQ(s2.buffers.allgather_bucket, 500'000'000ull * 2);
  EXPECT_EQ(s2.buffers.live_params, 0ull);
  const EstimateRow s3 = row(in, 3);
  EXPECT_EQ(s3.buffers.reduce_buckets, 2 * 500'000'000ull * 2);  // two buckets with overlap_comm
  EXPECT_EQ(s3.buffers.allgather_bucket, 0ull);
  EXPECT_EQ(s3.buffers.live_params, (200'000'000ull + 50'000'000ull) * 2);  // layer + prefetch
  EXPECT_EQ(s3.buffers.layer_grads, 200'000'000ull * 2);
  EXPECT_EQ(s3.gpu_buffer_bytes, s3.buffers.reduce_buckets + s3.buffers.live_params + s3.buffers.layer_grads);
  in.zero.stage3_max_live_parameters = 100'000'000;  // below the layer: the layer still has to be there
  EXPECT_EQ(row(in, 3).buffers.live_params, 200'000'000ull * 2);
}

TEST(Estimator, HostBuffersForNvme) {
  const EstimateInput in = input(8'000'000'000, 8);  // shard 1e9
  const EstimateRow r = row(in, 3, kNvme, kNvme);
  EXPECT_EQ(r.buffers.optimizer_swap, 4ull * 1'000'000'000ull * 12);  // buffer_count x sub_group x K
  EXPECT_EQ(r.buffers.param_swap, 5ull * 100'000'000ull * 2);          // buffer_count x buffer_size x p
  EXPECT_EQ(r.buffers.param_cache, 1'000'000'000ull * 2);            // min(max_in_cpu, shard) x p
  EXPECT_EQ(r.buffers.aio, 1048576ull * 8 * 1);
  EXPECT_EQ(r.cpu_buffer_bytes_per_node, r.buffers.host_total() * 8);
  EXPECT_EQ(row(in, 3, kCpu, kCpu).buffers.host_total(), 0ull);
}

TEST(Estimator, PrecisionOptionsChangeTheLedger) {
  EstimateInput in = input(7'000'000'000, 1);
  in.precision = *ledger_precision("bf16", "", "bf16");
  EXPECT_EQ(row(in, 0).gpu_model_state_bytes, 12 * 7'000'000'000ull);
  in.precision = *ledger_precision("bf16", "fp32", "fp32");
  EXPECT_EQ(row(in, 0).gpu_model_state_bytes, 18 * 7'000'000'000ull);
  in.precision = *ledger_precision("fp32", "", "fp32");
  EXPECT_EQ(row(in, 0).gpu_model_state_bytes, 20 * 7'000'000'000ull);
  EXPECT_FALSE(ledger_precision("fp8", "", "fp32").ok());
  EXPECT_FALSE(ledger_precision("bf16", "", "fp8").ok());
  // int8 moments: 4 B master + 1 + 1 B codes, and one fp32 scale per moment
  // per 256 parameters (7e9 / 256 = 27343750 blocks exactly).
  in.precision = *ledger_precision("bf16", "", "int8");
  EXPECT_EQ(row(in, 0).gpu_model_state_bytes, 10 * 7'000'000'000ull + 8 * 27'343'750ull);
  EXPECT_EQ(in.precision.optimizer_state_of(257), 6 * 257u + 16u);  // a partial block has its scales too
  const EstimateRow nvme = row(in, 3, kNvme, kNone);
  EXPECT_EQ(nvme.nvme_bytes_per_node, 6 * 7'000'000'000ull + 8 * 27'343'750ull);
}

TEST(Estimator, FitsAgainstGivenLimits) {
  EstimateInput in = input(7'000'000'000, 8);
  in.gpu_memory_bytes = 80'000'000'000;
  in.cpu_memory_bytes = 512'000'000'000;
  EXPECT_FALSE(*row(in, 0).fits);  // 112 GB of state on an 80 GB GPU
  EXPECT_TRUE(*row(in, 3).fits);   // 14 GB + buffers
  EXPECT_FALSE(row(in, 3).nvme_fits.has_value());
  in.cpu_memory_bytes = 10'000'000'000;
  const EstimateRow r = row(in, 3, kCpu, kCpu);  // 18 B x 7e9 = 126 GB on the host
  EXPECT_TRUE(*r.gpu_fits);
  EXPECT_FALSE(*r.cpu_fits);
  EXPECT_FALSE(*r.fits);
}

TEST(Estimator, ConfigRowIsMarkedAndUsesItsSettings) {
  ConfigOptions options;
  options.world_size = 8;
  auto config = load_config(testing::example_path("zero3_nvme_offload.json"), options);
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EstimateInput in = input(13'000'000'000, 8);
  in.from_config(*config);
  auto e = estimate_memory(in);
  ASSERT_TRUE(e.ok());
  int marked = 0;
  for (const EstimateRow& r : e->rows) {
    if (!r.is_config) continue;
    ++marked;
    EXPECT_EQ(r.placement, (Placement{3, kNvme, kNvme}));
    EXPECT_EQ(r.buffers.optimizer_swap, 4ull * 100'000'000ull * 12);  // its sub_group_size 1e8
    EXPECT_EQ(r.buffers.aio, 1048576ull * 32 * 2);                  // its queue_depth 32, 2 threads
  }
  EXPECT_EQ(marked, 1);
}

TEST(Estimator, PartialOffloadGetsItsOwnRow) {
  auto config = parse_config(nlohmann::json::parse(
      R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}})"));
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EstimateInput in = input(4'000'000'000, 4);  // shard 1e9
  in.from_config(*config);
  auto e = estimate_memory(in);
  ASSERT_TRUE(e.ok());
  ASSERT_EQ(e->rows.size(), 17ull);
  const EstimateRow& partial = e->rows.back();
  EXPECT_TRUE(partial.is_config);
  EXPECT_EQ(partial.gpu_model_state_bytes, 2 * 1'000'000'000ull + 14 * 750'000'000ull);
  EXPECT_EQ(partial.cpu_bytes_per_node, 16 * 250'000'000ull * 4);
  EXPECT_EQ(estimate_to_json(*e)["rows"][16]["offload_ratio"], 0.25);
}

TEST(Estimator, JsonShape) {
  auto e = estimate_memory(input(13'000'000'000, 4));
  ASSERT_TRUE(e.ok());
  const auto j = estimate_to_json(*e);
  EXPECT_EQ(j["params"], 13'000'000'000ull);
  EXPECT_EQ(j["gpus_per_node"], 4);
  EXPECT_EQ(j["nodes"], 1);
  ASSERT_EQ(j["rows"].size(), 16ull);
  for (const char* key : {"stage", "offload_optimizer", "offload_param", "gpu_model_state_bytes", "gpu_buffer_bytes",
                          "cpu_bytes_per_node", "nvme_bytes_per_node", "fits"}) {
    EXPECT_TRUE(j["rows"][0].contains(key)) << key;
  }
  EXPECT_EQ(j["rows"][5]["stage"], 2);
  EXPECT_EQ(j["rows"][4]["gpu_model_state_bytes"], 71'500'000'000ull);
  EXPECT_TRUE(j["rows"][0]["fits"].is_null());
}

TEST(Estimator, TextUsesDecimalOrBinaryUnits) {
  auto e = estimate_memory(input(7'000'000'000, 1));
  ASSERT_TRUE(e.ok());
  EXPECT_NE(format_estimate(*e, false).find("112.00 GB"), std::string::npos);
  EXPECT_NE(format_estimate(*e, true).find("104.31 GiB"), std::string::npos);
}

TEST(Estimator, BadInput) {
  EXPECT_FALSE(estimate_memory(input(0, 1)).ok());
  EstimateInput in = input(1000, 1);
  in.largest_layer_params = 2000;
  auto r = estimate_memory(in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--largest-layer"), std::string::npos);
  EXPECT_FALSE(estimate_memory(input(1000, 0)).ok());
  EXPECT_FALSE(estimate_row(input(1000, 1), Placement{2, kNone, kCpu}).ok());
  EXPECT_FALSE(estimate_row(input(1000, 1), Placement{0, kCpu, kNone}).ok());
}

}  // namespace
}  // namespace strata
