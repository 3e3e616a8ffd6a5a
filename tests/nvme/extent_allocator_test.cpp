// The first-fit allocator against a byte-map reference model.
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "nvme_test_util.h"
#include "strata/nvme/extent_allocator.h"

namespace strata::nvme {
namespace {

TEST(ExtentAllocator, FirstFitAndRounding) {
  ExtentAllocator a(64 * 4096, 4096);
  auto e1 = a.allocate(1);
  auto e2 = a.allocate(4097);
  ASSERT_TRUE(e1.ok() && e2.ok());
  EXPECT_EQ(*e1, (Extent{0, 4096}));
  EXPECT_EQ(*e2, (Extent{4096, 8192}));
  ASSERT_TRUE(a.free(*e1).ok());
  auto e3 = a.allocate(4096);  // first fit reuses the hole at 0
  ASSERT_TRUE(e3.ok());
  EXPECT_EQ(e3->offset, 0u);
  auto e4 = a.allocate(8192);  // does not fit the hole: goes after e2
  ASSERT_TRUE(e4.ok());
  EXPECT_EQ(e4->offset, 3u * 4096);
}

TEST(ExtentAllocator, FreeCoalescesBothNeighbours) {
  ExtentAllocator a(10 * 4096, 4096);
  std::vector<Extent> e;
  for (int i = 0; i < 10; ++i) e.push_back(*a.allocate(4096));
  EXPECT_EQ(a.free_bytes(), 0u);
  ASSERT_TRUE(a.free(e[3]).ok());
  ASSERT_TRUE(a.free(e[5]).ok());
  EXPECT_EQ(a.free_extent_count(), 2u);
  ASSERT_TRUE(a.free(e[4]).ok());  // joins 3 and 5
  EXPECT_EQ(a.free_extent_count(), 1u);
  EXPECT_EQ(a.largest_free(), 3u * 4096);
  for (int i : {0, 1, 2, 6, 7, 8, 9}) ASSERT_TRUE(a.free(e[i]).ok());
  EXPECT_EQ(a.free_extent_count(), 1u);
  EXPECT_EQ(a.largest_free(), 10u * 4096);
}

TEST(ExtentAllocator, ErrorsNameTheProblem) {
  ExtentAllocator a(4 * 4096, 4096);
  auto big = a.allocate(5 * 4096);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("raise the swap capacity"), std::string::npos);
  auto e = a.allocate(4096);
  ASSERT_TRUE(a.free(*e).ok());
  Status twice = a.free(*e);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.message().find("double free"), std::string::npos);
  EXPECT_FALSE(a.allocate(0).ok());
  EXPECT_FALSE(a.free(Extent{0, 8 * 4096}).ok());
  ASSERT_TRUE(a.reserve(Extent{4096, 4096}).ok());
  EXPECT_FALSE(a.reserve(Extent{4096, 4096}).ok());
  EXPECT_FALSE(a.reserve(Extent{100, 4096}).ok());
}

// Random allocate/free/reserve against a unit map; checks no overlap, first
// fit (lowest offset that fits) and exact free accounting.
TEST(ExtentAllocator, MatchesReferenceModel) {
  uint64_t seed = testing::test_seed(31337);
  std::mt19937_64 rng(seed);
  const uint64_t units = 256, unit = 512;
  ExtentAllocator a(units * unit, unit);
  std::vector<int> owner(units, -1);
  std::vector<Extent> live;
  for (int step = 0; step < 4000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t want = 1 + rng() % (8 * unit);
      uint64_t need_units = (want + unit - 1) / unit;
      // Reference first fit.
      int64_t expect = -1;
      for (uint64_t s = 0; s + need_units <= units && expect < 0; ++s) {
        bool fits = true;
        for (uint64_t k = 0; k < need_units && fits; ++k) fits = owner[s + k] < 0;
        if (fits) expect = static_cast<int64_t>(s);
      }
      auto e = a.allocate(want);
      if (expect < 0) {
        ASSERT_FALSE(e.ok()) << "step " << step << " seed " << seed;
        continue;
      }
      ASSERT_TRUE(e.ok()) << "step " << step << " seed " << seed;
      ASSERT_EQ(e->offset, static_cast<uint64_t>(expect) * unit) << "step " << step << " seed " << seed;
      for (uint64_t k = 0; k < need_units; ++k) owner[expect + k] = step;
      live.push_back(*e);
    } else {
      size_t i = rng() % live.size();
      ASSERT_TRUE(a.free(live[i]).ok());
      for (uint64_t k = 0; k < live[i].length / unit; ++k) owner[live[i].offset / unit + k] = -1;
      live[i] = live.back();
      live.pop_back();
    }
    uint64_t free_units = 0;
    for (int o : owner) free_units += o < 0;
    ASSERT_EQ(a.free_bytes(), free_units * unit) << "step " << step << " seed " << seed;
  }
}

}  // namespace
}  // namespace strata::nvme
