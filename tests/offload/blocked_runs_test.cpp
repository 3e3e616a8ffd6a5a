// plan_blocked_steps (offload/src/blocked_runs.h, Note [Runs in 8-bit
// blocks]): which elements of a piece with int8 moments go to the 8-bit
// kernel in whole blocks, and which blocks runs share.
#include <gtest/gtest.h>

#include "blocked_runs.h"

namespace strata::offload::engine_detail {
namespace {

using Range = BlockedSteps::Range;

void expect_range(const Range& r, size_t run, size_t first, size_t count) {
  EXPECT_EQ(r.run, run);
  EXPECT_EQ(r.first, first);
  EXPECT_EQ(r.count, count);
}

TEST(BlockedSteps, OneRunIsOneWholeRangeWithThePartialLastBlock) {
  const ElementRun runs[] = {{0, 1000}};
  const BlockedSteps s = plan_blocked_steps(runs, 1000, 256);
  ASSERT_EQ(s.whole.size(), 1u);
  expect_range(s.whole[0], 0, 0, 1000);
  EXPECT_TRUE(s.shared.empty());
}

TEST(BlockedSteps, BoundariesOnTheGridShareNoBlock) {
  const ElementRun runs[] = {{0, 3072}, {3072, 96}};  // a weight of 12 blocks, then its bias
  const BlockedSteps s = plan_blocked_steps(runs, 3168, 256);
  ASSERT_EQ(s.whole.size(), 2u);
  expect_range(s.whole[0], 0, 0, 3072);
  expect_range(s.whole[1], 1, 3072, 96);
  EXPECT_TRUE(s.shared.empty());
}

TEST(BlockedSteps, ABoundaryInsideABlockSharesThatBlockOnly) {
  const ElementRun runs[] = {{0, 300}, {300, 700}};
  const BlockedSteps s = plan_blocked_steps(runs, 1000, 256);
  ASSERT_EQ(s.whole.size(), 2u);
  expect_range(s.whole[0], 0, 0, 256);
  expect_range(s.whole[1], 1, 512, 488);
  ASSERT_EQ(s.shared.size(), 1u);
  EXPECT_EQ(s.shared[0].first, 256u);
  EXPECT_EQ(s.shared[0].count, 256u);
  ASSERT_EQ(s.shared[0].parts.size(), 2u);
  expect_range(s.shared[0].parts[0], 0, 256, 44);
  expect_range(s.shared[0].parts[1], 1, 300, 212);
}

TEST(BlockedSteps, SmallTensorsShareOneBlockAndGapsAreNotStepped) {
  // A Linear(10, 8): weight 80, bias 8, in one partial block.
  const ElementRun small[] = {{0, 80}, {80, 8}};
  BlockedSteps s = plan_blocked_steps(small, 88, 256);
  EXPECT_TRUE(s.whole.empty());
  ASSERT_EQ(s.shared.size(), 1u);
  EXPECT_EQ(s.shared[0].count, 88u);
  ASSERT_EQ(s.shared[0].parts.size(), 2u);
  expect_range(s.shared[0].parts[1], 1, 80, 8);
  // Elements [100, 200) belong to no run; whole blocks of run 1 merge.
  const ElementRun gap[] = {{0, 100}, {200, 400}};
  s = plan_blocked_steps(gap, 600, 256);
  ASSERT_EQ(s.shared.size(), 1u);
  ASSERT_EQ(s.shared[0].parts.size(), 2u);
  expect_range(s.shared[0].parts[0], 0, 0, 100);
  expect_range(s.shared[0].parts[1], 1, 200, 56);
  ASSERT_EQ(s.whole.size(), 1u);
  expect_range(s.whole[0], 1, 256, 344);
}

TEST(BlockedSteps, ManyRunsInOneBlockAndNoRunsAtAll) {
  const ElementRun runs[] = {{0, 10}, {10, 10}, {20, 10}, {30, 500}};
  BlockedSteps s = plan_blocked_steps(runs, 530, 256);
  ASSERT_EQ(s.shared.size(), 1u);
  EXPECT_EQ(s.shared[0].parts.size(), 4u);
  ASSERT_EQ(s.whole.size(), 1u);
  expect_range(s.whole[0], 3, 256, 274);
  s = plan_blocked_steps({}, 530, 256);
  EXPECT_TRUE(s.whole.empty());
  EXPECT_TRUE(s.shared.empty());
}

}  // namespace
}  // namespace strata::offload::engine_detail
