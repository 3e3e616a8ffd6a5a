// LrSchedule against closed-form values of DeepSpeed's schedules at the
// boundary steps (Note [Which lr the k-th update uses] in lr_schedule.h:
// update k runs with DeepSpeed's iteration k - 2), and its errors.

#include "strata/offload/lr_schedule.h"

#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "strata/core/config.h"

namespace strata::offload {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

SchedulerConfig make(SchedulerType type, json params) {
  SchedulerConfig cfg;
  cfg.type = type;
  cfg.params = std::move(params);
  return cfg;
}

LrSchedule create_ok(SchedulerType type, json params, double base_lr = 0.1) {
  Result<LrSchedule> s = LrSchedule::create(make(type, std::move(params)), base_lr, "run.json");
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return std::move(s).value();
}

// Relative 1e-13: the formulas are evaluated in the same order as
// DeepSpeed's, but the expectations below are written in closed form.
#define EXPECT_LR(actual, expected) EXPECT_NEAR((actual), (expected), 1e-13 * std::fabs(expected))

std::string create_error(SchedulerType type, json params, double base_lr = 0.1) {
  Result<LrSchedule> s = LrSchedule::create(make(type, std::move(params)), base_lr, "run.json");
  EXPECT_FALSE(s.ok());
  if (s.ok()) return "";
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("run.json"));
  EXPECT_THAT(s.status().message(), HasSubstr("hint"));
  return s.status().message();
}

TEST(LrSchedule, NoneIsTheBaseLr) {
  LrSchedule s = create_ok(SchedulerType::kNone, json::object(), 3e-4);
  EXPECT_EQ(s.type(), SchedulerType::kNone);
  EXPECT_EQ(s.lr(1), 3e-4);
  EXPECT_EQ(s.lr(2), 3e-4);
  EXPECT_EQ(s.lr(1'000'000), 3e-4);
  EXPECT_EQ(s.betas(1), std::nullopt);
}

TEST(LrSchedule, WarmupLogRisesToMaxAtStepWPlus1) {
  LrSchedule s = create_ok(SchedulerType::kWarmupLR,
                           {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 10}, {"warmup_type", "log"}});
  const double delta = 1e-3 - 1e-4;
  EXPECT_EQ(s.lr(1), 1e-4);  // iteration -1: the constructor's warmup_min_lr
  EXPECT_EQ(s.lr(2), 1e-4);  // iteration 0: log(1) = 0
  EXPECT_LR(s.lr(3), 1e-4 + delta * std::log(2.0) / std::log(10.0));
  EXPECT_LR(s.lr(6), 1e-4 + delta * std::log(5.0) / std::log(10.0));
  EXPECT_LR(s.lr(11), 1e-3);  // iteration 9: log(10) / log(10)
  EXPECT_EQ(s.lr(12), 1e-4 + delta);  // iteration 10: gamma exactly 1
  EXPECT_EQ(s.lr(1'000'000), 1e-4 + delta);
  EXPECT_LT(s.lr(10), s.lr(11));
}

TEST(LrSchedule, WarmupLinearReachesMaxAtStepWPlus2) {
  LrSchedule s = create_ok(SchedulerType::kWarmupLR,
                           {{"warmup_min_lr", 0.001}, {"warmup_max_lr", 0.002}, {"warmup_num_steps", 4}, {"warmup_type", "linear"}});
  EXPECT_EQ(s.lr(1), 0.001);
  EXPECT_EQ(s.lr(2), 0.001);  // iteration 0: 0 / 4
  EXPECT_LR(s.lr(3), 0.00125);
  EXPECT_LR(s.lr(4), 0.0015);
  EXPECT_LR(s.lr(5), 0.00175);
  EXPECT_LR(s.lr(6), 0.002);
  EXPECT_LR(s.lr(100), 0.002);
}

TEST(LrSchedule, WarmupOfOneStepIsClampedToTwoAsInDeepSpeed) {
  LrSchedule s = create_ok(SchedulerType::kWarmupLR,
                           {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1.0}, {"warmup_num_steps", 1}, {"warmup_type", "linear"}});
  EXPECT_EQ(s.lr(2), 0.0);
  EXPECT_EQ(s.lr(3), 0.5);
  EXPECT_EQ(s.lr(4), 1.0);
}

TEST(LrSchedule, WarmupDecayFallsLinearlyToZeroAtTotal) {
  LrSchedule s = create_ok(SchedulerType::kWarmupDecayLR, {{"warmup_min_lr", 0.0},
                                                            {"warmup_max_lr", 1.0},
                                                            {"warmup_num_steps", 10},
                                                            {"warmup_type", "linear"},
                                                            {"total_num_steps", 110}});
  EXPECT_EQ(s.lr(1), 0.0);
  EXPECT_LR(s.lr(7), 0.5);     // iteration 5 of 10
  EXPECT_LR(s.lr(11), 0.9);    // iteration 9: last warm-up step
  EXPECT_EQ(s.lr(12), 1.0);    // iteration 10: (110 - 10) / 100
  EXPECT_LR(s.lr(13), 0.99);
  EXPECT_LR(s.lr(62), 0.5);    // iteration 60
  EXPECT_LR(s.lr(111), 0.01);  // iteration 109
  EXPECT_EQ(s.lr(112), 0.0);   // iteration 110 = total_num_steps
  EXPECT_EQ(s.lr(500), 0.0);   // clamped, never negative
}

TEST(LrSchedule, WarmupDecayWithTotalEqualToWarmupDropsToMin) {
  LrSchedule s = create_ok(SchedulerType::kWarmupDecayLR, {{"warmup_min_lr", 0.25},
                                                            {"warmup_max_lr", 1.0},
                                                            {"warmup_num_steps", 10},
                                                            {"warmup_type", "linear"},
                                                            {"total_num_steps", 10}});
  EXPECT_LR(s.lr(11), 0.25 + 0.75 * 0.9);
  EXPECT_EQ(s.lr(12), 0.25);  // (10 - 10) / max(1, 0)
}

TEST(LrSchedule, WarmupCosineStartsAtZeroThenFollowsTheCosine) {
  LrSchedule s = create_ok(SchedulerType::kWarmupCosineLR, {{"warmup_num_steps", 10},
                                                             {"warmup_type", "linear"},
                                                             {"total_num_steps", 110},
                                                             {"warmup_min_ratio", 0.1},
                                                             {"cos_min_ratio", 0.01}},
                           0.1);
  EXPECT_EQ(s.lr(1), 0.0);  // DeepSpeed's value before the schedule starts
  EXPECT_LR(s.lr(2), 0.1 * 0.1);
  EXPECT_LR(s.lr(7), 0.1 * (0.1 + 0.5 * 0.9));
  EXPECT_LR(s.lr(11), 0.1 * (0.1 + 0.9 * 0.9));
  EXPECT_LR(s.lr(12), 0.1 * (0.01 + 0.99 * (1 + std::cos(std::numbers::pi * 0.01)) / 2));
  EXPECT_LR(s.lr(61), 0.1 * (0.01 + 0.99 * 0.5));  // half way: progress 50 / 100
  EXPECT_LR(s.lr(111), 0.1 * 0.01);                // progress 1
  EXPECT_LR(s.lr(112), 0.1 * 0.01);                // clamped at the floor
  EXPECT_LR(s.lr(10'000), 0.1 * 0.01);
}

TEST(LrSchedule, WarmupCosineLogWarmup) {
  LrSchedule s = create_ok(SchedulerType::kWarmupCosineLR,
                           {{"warmup_num_steps", 100}, {"warmup_type", "log"}, {"total_num_steps", 1000},
                            {"warmup_min_ratio", 0.0}, {"cos_min_ratio", 0.0001}},
                           2.0);
  EXPECT_EQ(s.lr(1), 0.0);
  EXPECT_EQ(s.lr(2), 0.0);
  EXPECT_LR(s.lr(3), 2.0 * std::log(2.0) / std::log(100.0));
  EXPECT_LR(s.lr(51), 2.0 * std::log(50.0) / std::log(100.0));
  EXPECT_LR(s.lr(101), 2.0);  // iteration 99: log(100) / log(100)
}

TEST(LrSchedule, OneCycleRisesPeaksFallsThenHolds) {
  LrSchedule s = create_ok(SchedulerType::kOneCycle,
                           {{"cycle_min_lr", 0.1}, {"cycle_max_lr", 1.1}, {"cycle_first_step_size", 10}, {"cycle_momentum", false}});
  EXPECT_EQ(s.lr(1), 0.1);      // batch 0
  EXPECT_LR(s.lr(2), 0.2);      // batch 1
  EXPECT_LR(s.lr(6), 0.6);      // batch 5
  EXPECT_LR(s.lr(11), 1.1);     // batch 10: the peak
  EXPECT_LR(s.lr(16), 0.6);     // batch 15: half way down (second half defaults to the first)
  EXPECT_LR(s.lr(20), 0.2);     // batch 19
  EXPECT_LR(s.lr(21), 0.1);     // batch 20: end of the cycle
  EXPECT_EQ(s.lr(22), 0.1);     // after the cycle, no decay configured
  EXPECT_EQ(s.lr(1000), 0.1);
  EXPECT_EQ(s.betas(5), std::nullopt);
}

TEST(LrSchedule, OneCycleAsymmetricHalves) {
  LrSchedule s = create_ok(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0},
                                                      {"cycle_max_lr", 1.0},
                                                      {"cycle_first_step_size", 4},
                                                      {"cycle_second_step_size", 6},
                                                      {"cycle_momentum", false}});
  EXPECT_LR(s.lr(3), 0.5);   // batch 2 of 4 up
  EXPECT_LR(s.lr(5), 1.0);   // batch 4: peak
  EXPECT_LR(s.lr(8), 0.5);   // batch 7: 3 of 6 down
  EXPECT_NEAR(s.lr(11), 0.0, 1e-15);  // batch 10: end
}

TEST(LrSchedule, OneCycleDecayAfterTheCycle) {
  LrSchedule s = create_ok(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.1},
                                                      {"cycle_max_lr", 1.1},
                                                      {"cycle_first_step_size", 10},
                                                      {"decay_step_size", 5},
                                                      {"decay_lr_rate", 0.5},
                                                      {"cycle_momentum", false}});
  EXPECT_LR(s.lr(21), 0.1);            // iteration 19: still in the cycle
  EXPECT_LR(s.lr(22), 0.1 / 1.1);      // iteration 20: decay batch 1, interval 0.2
  EXPECT_LR(s.lr(31), 0.1 / 2.0);      // decay batch 10, interval 2
  EXPECT_LR(s.lr(121), 0.1 / 11.0);    // decay batch 100, interval 20
}

TEST(LrSchedule, OneCycleStairs) {
  LrSchedule s = create_ok(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0},
                                                      {"cycle_max_lr", 1.0},
                                                      {"cycle_first_step_size", 10},
                                                      {"cycle_first_stair_count", 5},
                                                      {"cycle_momentum", false}});
  EXPECT_EQ(s.lr(1), 0.0);   // batch 0
  EXPECT_EQ(s.lr(2), 0.0);   // batch 1: floor(0.5) stairs
  EXPECT_EQ(s.lr(3), 0.2);   // batch 2
  EXPECT_EQ(s.lr(4), 0.2);   // batch 3
  EXPECT_EQ(s.lr(11), 1.0);  // batch 10: the peak is a whole stair
  EXPECT_EQ(s.lr(12), 0.8);  // batch 11: (20 - 11) * 5 / 10 = 4.5 -> 4 stairs (second count defaults to the first)
  EXPECT_EQ(s.lr(14), 0.6);  // batch 13: 3.5 -> 3
}

TEST(LrSchedule, OneCycleMomentumCyclesInverselyWithBeta2At099) {
  LrSchedule s = create_ok(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.1},
                                                      {"cycle_max_lr", 1.1},
                                                      {"cycle_first_step_size", 10},
                                                      {"cycle_min_mom", 0.8},
                                                      {"cycle_max_mom", 0.9},
                                                      {"decay_step_size", 10},
                                                      {"decay_mom_rate", 0.1}});
  ASSERT_TRUE(s.betas(1).has_value());
  EXPECT_EQ(*s.betas(1), (std::array<double, 2>{0.8, 0.99}));  // DeepSpeed's constructor sets cycle_min_mom
  EXPECT_LR((*s.betas(2))[0], 0.89);   // batch 1
  EXPECT_LR((*s.betas(6))[0], 0.85);   // batch 5
  EXPECT_LR((*s.betas(11))[0], 0.8);   // batch 10: lr peak, momentum trough
  EXPECT_EQ((*s.betas(11))[1], 0.99);
  EXPECT_LR((*s.betas(21))[0], 0.9);   // end of the cycle
  EXPECT_LR((*s.betas(31))[0], 0.9 * (1 + 0.1 * 1.0));  // decay batch 10: interval 1
  EXPECT_EQ(s.lr(31), 0.1);            // decay_lr_rate 0: the lr does not decay
}

TEST(LrSchedule, LrRangeTestContinuousAndStaircase) {
  LrSchedule c = create_ok(SchedulerType::kLRRangeTest,
                           {{"lr_range_test_min_lr", 0.01}, {"lr_range_test_step_size", 10}, {"lr_range_test_step_rate", 1.0},
                            {"lr_range_test_staircase", false}});
  EXPECT_EQ(c.lr(1), 0.01);
  EXPECT_LR(c.lr(6), 0.015);
  EXPECT_LR(c.lr(11), 0.02);
  EXPECT_LR(c.lr(101), 0.11);
  LrSchedule st = create_ok(SchedulerType::kLRRangeTest,
                            {{"lr_range_test_min_lr", 0.01}, {"lr_range_test_step_size", 10}, {"lr_range_test_step_rate", 2.0},
                             {"lr_range_test_staircase", true}});
  EXPECT_EQ(st.lr(1), 0.01);
  EXPECT_EQ(st.lr(10), 0.01);   // batch 9: floor(0.9) = 0
  EXPECT_LR(st.lr(11), 0.03);   // batch 10: 1 + 2 * 1
  EXPECT_LR(st.lr(25), 0.05);   // batch 24: 1 + 2 * 2
}

TEST(LrSchedule, LastBatchIterationResumesTheSchedule) {
  const json fresh_params = {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1.0}, {"warmup_num_steps", 4}, {"warmup_type", "linear"}};
  json resumed_params = fresh_params;
  resumed_params["last_batch_iteration"] = 2;
  LrSchedule fresh = create_ok(SchedulerType::kWarmupLR, fresh_params);
  LrSchedule resumed = create_ok(SchedulerType::kWarmupLR, resumed_params);
  EXPECT_EQ(resumed.lr(1), 0.5);  // iteration 2
  EXPECT_EQ(resumed.lr(2), 0.75);
  for (int64_t k = 1; k < 20; ++k) EXPECT_EQ(resumed.lr(k), fresh.lr(k + 3)) << k;
}

TEST(LrSchedule, MissingKeysTakeTheSchemaDefaults) {
  // WarmupLR defaults: min 0, max 0.001, 1000 steps, log.
  LrSchedule s = create_ok(SchedulerType::kWarmupLR, json::object());
  EXPECT_EQ(s.lr(1), 0.0);
  EXPECT_LR(s.lr(3), 0.001 * std::log(2.0) / std::log(1000.0));
  EXPECT_EQ(s.lr(1002), 0.001);
}

TEST(LrSchedule, WarmupLrNullMaxIsTheOptimizerLr) {
  LrSchedule s = create_ok(SchedulerType::kWarmupLR,
                           {{"warmup_min_lr", 0.0}, {"warmup_max_lr", nullptr}, {"warmup_num_steps", 4}, {"warmup_type", "linear"}},
                           0.4);
  EXPECT_EQ(s.lr(4), 0.2);
  EXPECT_EQ(s.lr(6), 0.4);
  // WarmupDecayLR has no such fallback in DeepSpeed: null is an error there.
  EXPECT_FALSE(LrSchedule::create(make(SchedulerType::kWarmupDecayLR, {{"warmup_max_lr", nullptr}, {"total_num_steps", 2000}}), 0.4).ok());
}

TEST(LrSchedule, FromAParsedConfig) {
  ConfigCheck check = check_config_text(R"({
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 110, "warmup_num_steps": 10, "warmup_type": "linear"}}
  })");
  ASSERT_TRUE(check.ok()) << check.format();
  Result<LrSchedule> s = LrSchedule::create(check.config.scheduler, check.config.optimizer.lr, "run.json");
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(s->type(), SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(s->lr(2), 0.0);                        // warmup_min_ratio defaults to 0
  EXPECT_LR(s->lr(7), 0.1 * 0.5);
  EXPECT_LR(s->lr(111), 0.1 * 0.0001);             // cos_min_ratio defaults to 1e-4
}

TEST(LrSchedule, BadValuesNameTheKey) {
  const json warm = {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 1.0}, {"warmup_num_steps", 10}, {"warmup_type", "log"}};
  auto with = [&](json base, const char* key, json value) {
    base[key] = std::move(value);
    return base;
  };
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_num_steps", 0)),
              HasSubstr("scheduler.params.warmup_num_steps"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_num_steps", -5)),
              HasSubstr("scheduler.params.warmup_num_steps"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_num_steps", 2.5)),
              HasSubstr("whole number"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_num_steps", "10")),
              HasSubstr("must be an integer"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(with(warm, "warmup_min_lr", 1e-3), "warmup_max_lr", 1e-5)),
              HasSubstr("scheduler.params.warmup_max_lr"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_min_lr", -1.0)),
              HasSubstr("scheduler.params.warmup_min_lr"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_min_lr", std::nan(""))),
              HasSubstr("finite"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_max_lr", std::numeric_limits<double>::infinity())),
              HasSubstr("scheduler.params.warmup_max_lr"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_max_lr", "0.1")),
              HasSubstr("must be a number"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "warmup_type", "cosine")),
              HasSubstr("scheduler.params.warmup_type"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, with(warm, "last_batch_iteration", -2)),
              HasSubstr("scheduler.params.last_batch_iteration"));
  // total_num_steps: required, at least warmup_num_steps.
  EXPECT_THAT(create_error(SchedulerType::kWarmupDecayLR, warm), HasSubstr("scheduler.params.total_num_steps"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupDecayLR, warm), HasSubstr("required by WarmupDecayLR"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupDecayLR, with(warm, "total_num_steps", 5)),
              HasSubstr("shorter than warmup_num_steps"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupCosineLR,
                           {{"total_num_steps", 100}, {"warmup_num_steps", 10}, {"cos_min_ratio", 1.5}}),
              HasSubstr("scheduler.params.cos_min_ratio"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupCosineLR,
                           {{"total_num_steps", 100}, {"warmup_num_steps", 10}, {"warmup_min_ratio", -0.1}}),
              HasSubstr("scheduler.params.warmup_min_ratio"));
  // OneCycle.
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_max_lr", 1.0}}), HasSubstr("scheduler.params.cycle_min_lr"));
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_min_lr", 2.0}, {"cycle_max_lr", 1.0}}),
              HasSubstr("above cycle_max_lr"));
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0}, {"cycle_max_lr", 1.0}, {"cycle_first_step_size", 0}}),
              HasSubstr("scheduler.params.cycle_first_step_size"));
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0}, {"cycle_max_lr", 1.0}, {"decay_lr_rate", -1.0}}),
              HasSubstr("scheduler.params.decay_lr_rate"));
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0}, {"cycle_max_lr", 1.0}, {"cycle_min_mom", 1.5}}),
              HasSubstr("scheduler.params.cycle_min_mom"));
  EXPECT_THAT(create_error(SchedulerType::kOneCycle, {{"cycle_min_lr", 0.0}, {"cycle_max_lr", 1.0}, {"cycle_momentum", "yes"}}),
              HasSubstr("scheduler.params.cycle_momentum"));
  // LRRangeTest.
  EXPECT_THAT(create_error(SchedulerType::kLRRangeTest, {{"lr_range_test_step_size", 0}}),
              HasSubstr("scheduler.params.lr_range_test_step_size"));
  // The optimizer's lr.
  EXPECT_THAT(create_error(SchedulerType::kNone, json::object(), std::nan("")), HasSubstr("optimizer.params.lr"));
  EXPECT_THAT(create_error(SchedulerType::kWarmupCosineLR, {{"total_num_steps", 100}}, -1.0), HasSubstr("optimizer.params.lr"));
  // Not an object.
  EXPECT_THAT(create_error(SchedulerType::kWarmupLR, json::array()), HasSubstr("scheduler.params"));
}

TEST(LrScheduleDeathTest, StepZeroIsABug) {
  LrSchedule s = create_ok(SchedulerType::kNone, json::object());
  EXPECT_DEATH((void)s.lr(0), "count from 1");
}

}  // namespace
}  // namespace strata::offload
