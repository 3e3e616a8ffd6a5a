// Overflow: a gradient with one Inf or NaN leaves params, moments and the
// param copy bit-identical, runs no tile callback and reports it -- on
// every path, thread count and position of the bad element.
#include <gtest/gtest.h>

#include <atomic>
#include <limits>

#include "strata/cpu_adam/optimizer.h"
#include "test_state.h"

namespace strata::cpu_adam::testing {
namespace {

TEST(Overflow, OneInfOrNanLeavesEveryStateBitIdentical) {
  const float bad_values[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (KernelPath path : supported_kernel_paths()) {
    for (const Mix& mix : all_mixes()) {
      if (mix.moment == DType::kBF16 && mix.copy) continue;  // enough mixes; keeps the test fast
      for (int threads : {1, 2}) {
        CpuOptimizer opt = make_optimizer(mix.kind, path, threads, 64);
        const size_t count = 64 * 5 + 3;
        for (size_t at : {size_t{0}, size_t{200}, count - 1}) {
          for (float bad : bad_values) {
            TestState s(mix, count, 1);
            s.fill(17);
            s.set_grad(at, bad);
            const auto before = s.snapshot();
            std::atomic<int> callbacks{0};
            StepArgs a;
            a.step = 4;
            a.hyper.weight_decay = 0.01;
            a.loss_scale = 65536.0;
            auto r = opt.step(a, s.spans(), [&](const TileRange&) { callbacks++; });
            ASSERT_TRUE(r.ok()) << r.status().to_string();
            EXPECT_TRUE(r->overflow) << mix_name(mix) << " at " << at;
            EXPECT_EQ(r->tiles, 0u);
            EXPECT_EQ(callbacks.load(), 0);
            EXPECT_TRUE(s.snapshot() == before)
                << "state changed on overflow: " << mix_name(mix) << " path " << kernel_path_name(path) << " at " << at;
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(Overflow, FiniteGradientStillSteps) {
  Mix mix{OptimizerKind::kAdamW, DType::kF16, DType::kF32, true, DType::kF16};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kAuto, 2, 64);
  TestState s(mix, 500);
  s.fill(2);
  s.set_grad(3, 65504.0f);  // largest fp16: finite, must not count as overflow
  const auto before = s.snapshot();
  auto r = opt.step(StepArgs{}, s.spans());
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->overflow);
  EXPECT_EQ(r->tiles, 8u);
  EXPECT_FALSE(s.snapshot() == before);
}

TEST(Overflow, GradStatsThenAssumeFiniteIsTheTrainingFlow) {
  // The engine's flow: grad_stats (norm for clipping + overflow vote), then
  // the step without a second scan, with the clip coefficient fused.
  Mix mix{OptimizerKind::kAdamW, DType::kBF16, DType::kF32, true, DType::kBF16};
  CpuOptimizer opt = make_optimizer(mix.kind, KernelPath::kAuto, 2, 128);
  TestState s(mix, 1000), t(mix, 1000);
  s.fill(9, 4.0f);
  t.fill(9, 4.0f);
  auto stats = opt.grad_stats(s.grads(), mix.grad, s.count());
  ASSERT_TRUE(stats.ok());
  ASSERT_TRUE(stats->all_finite);
  StepArgs a;
  a.loss_scale = 8.0;
  a.clip_coefficient = clip_coefficient(stats->norm(a.loss_scale), 1.0);
  EXPECT_LT(a.clip_coefficient, 1.0);  // norm of N(0, 0.5) x 1000 is ~16 > 1
  a.overflow_check = OverflowCheck::kAssumeFinite;
  ASSERT_TRUE(opt.step(a, s.spans()).ok());
  a.overflow_check = OverflowCheck::kScanFirst;
  ASSERT_TRUE(opt.step(a, t.spans()).ok());
  EXPECT_TRUE(s.snapshot() == t.snapshot());

  // One Inf: the stats say so, so the caller skips the step.
  s.set_grad(999, -std::numeric_limits<float>::infinity());
  stats = opt.grad_stats(s.grads(), mix.grad, s.count());
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->all_finite);
  EXPECT_EQ(clip_coefficient(stats->norm(), 1.0), 1.0f);
}

}  // namespace
}  // namespace strata::cpu_adam::testing
