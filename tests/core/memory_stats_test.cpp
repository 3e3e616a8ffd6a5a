#include "strata/core/memory_stats.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "strata/core/tier.h"

namespace strata {
namespace {

TEST(Tier, NamesRoundTrip) {
  for (Tier t : kAllTiers) {
    auto parsed = parse_tier(tier_name(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(*parse_tier("pinned"), Tier::kPinnedHost);
  EXPECT_EQ(*parse_tier("gpu"), Tier::kDevice);
  auto bad = parse_tier("hbm3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'hbm3'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("pinned_host"), std::string::npos);
}

TEST(MemoryStats, CurrentPeakAllocatedFreed) {
  MemoryStats stats;
  stats.on_allocate(Tier::kDevice, 100);
  stats.on_allocate(Tier::kDevice, 50);
  stats.on_free(Tier::kDevice, 100);
  stats.on_allocate(Tier::kDevice, 20);
  TierStats s = stats.get(Tier::kDevice);
  EXPECT_EQ(s.current_bytes, 70u);
  EXPECT_EQ(s.peak_bytes, 150u);
  EXPECT_EQ(s.allocated_bytes, 170u);
  EXPECT_EQ(s.freed_bytes, 100u);
  EXPECT_EQ(s.allocation_count, 3u);
  EXPECT_EQ(s.free_count, 1u);
  EXPECT_EQ(stats.get(Tier::kPinnedHost).allocated_bytes, 0u);  // tiers are separate
  stats.reset_peak(Tier::kDevice);
  EXPECT_EQ(stats.get(Tier::kDevice).peak_bytes, 70u);
  EXPECT_NE(stats.to_string(Tier::kDevice).find("device: current 70 B"), std::string::npos)
      << stats.to_string(Tier::kDevice);
}

TEST(MemoryStats, FeedsProcessTotals) {
  const TierStats before = MemoryStats::process().get(Tier::kNvme);
  {
    MemoryStats stats;
    stats.on_allocate(Tier::kNvme, 4096);
    EXPECT_EQ(MemoryStats::process().get(Tier::kNvme).allocated_bytes, before.allocated_bytes + 4096);
    stats.on_free(Tier::kNvme, 4096);
  }
  EXPECT_EQ(MemoryStats::process().get(Tier::kNvme).freed_bytes, before.freed_bytes + 4096);
}

TEST(MemoryStats, ThreadSafe) {
  MemoryStats stats;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        stats.on_allocate(Tier::kPinnedHost, 8);
        stats.on_free(Tier::kPinnedHost, 8);
      }
    });
  }
  for (auto& th : threads) th.join();
  TierStats s = stats.get(Tier::kPinnedHost);
  EXPECT_EQ(s.current_bytes, 0u);
  EXPECT_EQ(s.allocated_bytes, 4u * 10000 * 8);
  EXPECT_EQ(s.freed_bytes, s.allocated_bytes);
  EXPECT_GE(s.peak_bytes, 8u);
  EXPECT_LE(s.peak_bytes, 32u);
}

TEST(MemoryStatsDeathTest, FreeingMoreThanInUseIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MemoryStats stats;
  stats.on_allocate(Tier::kDevice, 10);
  EXPECT_DEATH(stats.on_free(Tier::kDevice, 11), "double free");
}

}  // namespace
}  // namespace strata
