// LossScaler against hand-traced sequences of DeepSpeed's
// DynamicLossScaler.update_scale (Note [DeepSpeed's dynamic loss scale] in
// loss_scaler.h), its static and disabled modes, checkpoint state and errors.

#include "strata/offload/loss_scaler.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace strata::offload {
namespace {

using ::testing::HasSubstr;

Fp16Config dynamic_config(int64_t power, int64_t window, int64_t hysteresis, bool consecutive = false,
                          double min_scale = 1) {
  Fp16Config cfg;
  cfg.enabled = true;
  cfg.loss_scale = 0;
  cfg.initial_scale_power = power;
  cfg.loss_scale_window = window;
  cfg.hysteresis = hysteresis;
  cfg.consecutive_hysteresis = consecutive;
  cfg.min_loss_scale = min_scale;
  return cfg;
}

LossScaler create_ok(const Fp16Config& cfg) {
  Result<LossScaler> s = LossScaler::create(cfg, "run.json");
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return std::move(s).value();
}

void update_ok(LossScaler& s, bool overflow) {
  Status st = s.update(overflow);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

// 'o' = an overflowing step, 'c' = a clean one.
void run(LossScaler& s, std::string_view steps) {
  for (char c : steps) update_ok(s, c == 'o');
}

TEST(LossScaler, DisabledIsScaleOneAndOnlyCounts) {
  Fp16Config cfg;
  cfg.enabled = false;
  cfg.hysteresis = 0;  // ignored when disabled, as in DeepSpeed
  LossScaler s = create_ok(cfg);
  EXPECT_EQ(s.mode(), LossScaler::Mode::kDisabled);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 1.0);
  run(s, "ococcc");
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.overflow_count(), 2);
  EXPECT_EQ(s.skipped_steps(), 2);
  EXPECT_EQ(s.state().iteration, 6);
}

TEST(LossScaler, StaticScaleNeverChanges) {
  Fp16Config cfg;
  cfg.enabled = true;
  cfg.loss_scale = 128;
  LossScaler s = create_ok(cfg);
  EXPECT_EQ(s.mode(), LossScaler::Mode::kStatic);
  EXPECT_EQ(s.scale(), 128.0);
  for (int i = 0; i < 3000; ++i) update_ok(s, i % 7 == 0);
  EXPECT_EQ(s.scale(), 128.0);
  EXPECT_EQ(s.overflow_count(), 429);  // i = 0, 7, ..., 2996
}

TEST(LossScaler, DynamicStartsAtTwoToThePower) {
  LossScaler s = create_ok(dynamic_config(16, 1000, 2));
  EXPECT_EQ(s.mode(), LossScaler::Mode::kDynamic);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  EXPECT_EQ(s.state().last_overflow_iteration, -1);
  EXPECT_EQ(create_ok(dynamic_config(0, 1, 1)).scale(), 1.0);
  EXPECT_EQ(create_ok(dynamic_config(64, 1, 1)).scale(), 18446744073709551616.0);
}

TEST(LossScaler, WindowDoublesOnTheWindowPlusFirstCleanStepThenEveryWindow) {
  LossScaler s = create_ok(dynamic_config(4, 3, 1));
  run(s, "ccc");
  EXPECT_EQ(s.scale(), 16.0);  // stable intervals 0, 1, 2
  run(s, "c");
  EXPECT_EQ(s.scale(), 32.0);  // stable interval 3
  run(s, "cc");
  EXPECT_EQ(s.scale(), 32.0);
  run(s, "c");
  EXPECT_EQ(s.scale(), 64.0);  // stable interval 6
  // An overflow halves (hysteresis 1) and restarts the count: window + 1 clean steps to double.
  run(s, "o");
  EXPECT_EQ(s.scale(), 32.0);
  run(s, "ccc");
  EXPECT_EQ(s.scale(), 32.0);
  run(s, "c");
  EXPECT_EQ(s.scale(), 64.0);
  EXPECT_EQ(s.overflow_count(), 1);
}

TEST(LossScaler, HandTracedSequenceWithHysteresisTwo) {
  // power 10, window 4, hysteresis 2, not consecutive. Traced by hand from
  // DeepSpeed's update_scale: the first overflow only spends hysteresis, the
  // second halves, the next doubling refills hysteresis.
  LossScaler s = create_ok(dynamic_config(10, 4, 2));
  const std::string steps = "cccccoocccccccccc";
  const std::vector<double> scales = {1024, 1024, 1024, 1024, 2048, 2048, 1024, 1024, 1024,
                                      1024, 1024, 2048, 2048, 2048, 2048, 4096, 4096};
  const std::vector<int64_t> hysteresis = {2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2};
  ASSERT_EQ(steps.size(), scales.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    update_ok(s, steps[i] == 'o');
    EXPECT_EQ(s.scale(), scales[i]) << "after update " << i;
    EXPECT_EQ(s.state().hysteresis_left, hysteresis[i]) << "after update " << i;
  }
  EXPECT_EQ(s.state().last_overflow_iteration, 6);
  EXPECT_EQ(s.state().iteration, 17);
  EXPECT_EQ(s.overflow_count(), 2);
}

TEST(LossScaler, HysteresisIsNotRefilledByCleanStepsWithoutConsecutive) {
  LossScaler s = create_ok(dynamic_config(8, 1000, 2, /*consecutive=*/false));
  run(s, "o");
  EXPECT_EQ(s.scale(), 256.0);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  run(s, "cc");
  EXPECT_EQ(s.state().hysteresis_left, 1);
  run(s, "o");
  EXPECT_EQ(s.scale(), 128.0);
  run(s, "o");  // hysteresis stays spent: every further overflow halves
  EXPECT_EQ(s.scale(), 64.0);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScaler s = create_ok(dynamic_config(8, 1000, 2, /*consecutive=*/true));
  run(s, "oco");
  EXPECT_EQ(s.scale(), 256.0);  // each overflow spent the refilled hysteresis
  EXPECT_EQ(s.state().hysteresis_left, 1);
  run(s, "o");
  EXPECT_EQ(s.scale(), 128.0);  // two in a row: halves
  run(s, "c");
  EXPECT_EQ(s.state().hysteresis_left, 2);
}

TEST(LossScaler, HysteresisOneHalvesOnEveryOverflow) {
  LossScaler s = create_ok(dynamic_config(8, 1000, 1));
  run(s, "o");
  EXPECT_EQ(s.scale(), 128.0);
  run(s, "o");
  EXPECT_EQ(s.scale(), 64.0);
}

TEST(LossScaler, MinScaleClampsThenAnOverflowAtTheMinimumIsAnError) {
  LossScaler s = create_ok(dynamic_config(2, 1000, 1, false, /*min_scale=*/3));
  run(s, "o");
  EXPECT_EQ(s.scale(), 3.0);  // max(4 / 2, 3)
  const LossScalerState before = s.state();
  Status st = s.update(true);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("minimum loss scale 3"));
  EXPECT_THAT(st.message(), HasSubstr("fp16.min_loss_scale"));
  EXPECT_EQ(s.state(), before);  // DeepSpeed raises before changing anything
  // A clean step still works afterwards.
  update_ok(s, false);
  EXPECT_EQ(s.state().iteration, before.iteration + 1);
}

TEST(LossScaler, FractionalMinimum) {
  LossScaler s = create_ok(dynamic_config(0, 1000, 1, false, /*min_scale=*/0.25));
  run(s, "oo");
  EXPECT_EQ(s.scale(), 0.25);
  EXPECT_FALSE(s.update(true).ok());
}

TEST(LossScaler, OverflowAtTheMinimumWithHysteresisLeftOnlySpendsIt) {
  LossScaler s = create_ok(dynamic_config(0, 1000, 2));
  run(s, "o");  // scale 1 = min, hysteresis 2 -> 1: no error yet
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.update(true).code(), StatusCode::kFailedPrecondition);
}

TEST(LossScaler, StateRoundTripResumesBitForBit) {
  const Fp16Config cfg = dynamic_config(12, 5, 3, false, 0.5);
  LossScaler a = create_ok(cfg);
  run(a, "ccooccccccoccoooccc");
  const LossScalerState saved = a.state();
  LossScaler b = create_ok(cfg);
  ASSERT_TRUE(b.restore(saved).ok());
  EXPECT_EQ(b.state(), saved);
  EXPECT_EQ(b.scale(), a.scale());
  const std::string rest = "ccccccccccccoccccccoooccccccccccccc";
  for (char c : rest) {
    update_ok(a, c == 'o');
    update_ok(b, c == 'o');
    ASSERT_EQ(a.state(), b.state());
  }
  EXPECT_EQ(b.overflow_count(), 10);
}

TEST(LossScaler, StaticRestoreKeepsTheConfiguredScale) {
  Fp16Config cfg;
  cfg.enabled = true;
  cfg.loss_scale = 64;
  LossScaler s = create_ok(cfg);
  LossScalerState st;
  st.scale = 4096;
  st.iteration = 10;
  st.last_overflow_iteration = 7;
  st.hysteresis_left = 2;
  st.overflow_count = 3;
  ASSERT_TRUE(s.restore(st).ok());
  EXPECT_EQ(s.scale(), 64.0);
  EXPECT_EQ(s.overflow_count(), 3);
  EXPECT_EQ(s.state().iteration, 10);
}

TEST(LossScaler, RestoreRejectsImpossibleStates) {
  LossScaler s = create_ok(dynamic_config(16, 1000, 2, false, 1));
  const LossScalerState good{.scale = 1024, .iteration = 10, .last_overflow_iteration = 4, .hysteresis_left = 1,
                             .overflow_count = 2};
  ASSERT_TRUE(s.restore(good).ok());
  auto bad = [&](LossScalerState st, const char* what) {
    const LossScalerState before = s.state();
    Status status = s.restore(st);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(status.message(), HasSubstr(what));
    EXPECT_EQ(s.state(), before);
  };
  LossScalerState st = good;
  st.hysteresis_left = 0;
  bad(st, "hysteresis_left 0");
  st = good;
  st.hysteresis_left = 3;
  bad(st, "hysteresis_left 3");
  st = good;
  st.scale = std::nan("");
  bad(st, "scale nan");
  st = good;
  st.scale = std::numeric_limits<double>::infinity();
  bad(st, "scale inf");
  st = good;
  st.scale = 0.5;
  bad(st, "scale 0.5");
  st = good;
  st.iteration = -1;
  bad(st, "iteration -1");
  st = good;
  st.last_overflow_iteration = 10;
  bad(st, "last_overflow_iteration 10");
  st = good;
  st.last_overflow_iteration = -2;
  bad(st, "last_overflow_iteration -2");
  st = good;
  st.overflow_count = 11;
  bad(st, "overflow_count 11");
  st = good;
  st.last_overflow_iteration = -1;
  bad(st, "with no last overflow");
}

TEST(LossScaler, BadConfigNamesTheKey) {
  auto error_of = [](const Fp16Config& cfg) {
    Result<LossScaler> s = LossScaler::create(cfg, "run.json");
    EXPECT_FALSE(s.ok());
    if (s.ok()) return std::string();
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr("run.json"));
    EXPECT_THAT(s.status().message(), HasSubstr("hint"));
    return s.status().message();
  };
  EXPECT_THAT(error_of(dynamic_config(65, 1000, 2)), HasSubstr("fp16.initial_scale_power"));
  EXPECT_THAT(error_of(dynamic_config(-1, 1000, 2)), HasSubstr("fp16.initial_scale_power"));
  EXPECT_THAT(error_of(dynamic_config(0, 1000, 2, false, 2)), HasSubstr("below min_loss_scale"));
  EXPECT_THAT(error_of(dynamic_config(16, 0, 2)), HasSubstr("fp16.loss_scale_window"));
  EXPECT_THAT(error_of(dynamic_config(16, 1000, 0)), HasSubstr("fp16.hysteresis"));
  EXPECT_THAT(error_of(dynamic_config(16, 1000, 2, false, 0)), HasSubstr("fp16.min_loss_scale"));
  EXPECT_THAT(error_of(dynamic_config(16, 1000, 2, false, -1)), HasSubstr("fp16.min_loss_scale"));
  EXPECT_THAT(error_of(dynamic_config(16, 1000, 2, false, std::nan(""))), HasSubstr("fp16.min_loss_scale"));
  EXPECT_THAT(error_of(dynamic_config(16, 1000, 2, false, std::numeric_limits<double>::infinity())),
              HasSubstr("fp16.min_loss_scale"));
  Fp16Config cfg = dynamic_config(16, 1000, 2);
  cfg.loss_scale = -1;
  EXPECT_THAT(error_of(cfg), HasSubstr("fp16.loss_scale"));
  cfg.loss_scale = std::nan("");
  EXPECT_THAT(error_of(cfg), HasSubstr("fp16.loss_scale"));
  cfg.loss_scale = std::numeric_limits<double>::infinity();
  EXPECT_THAT(error_of(cfg), HasSubstr("fp16.loss_scale"));
}

}  // namespace
}  // namespace strata::offload
