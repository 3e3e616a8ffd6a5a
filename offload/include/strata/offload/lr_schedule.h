#pragma once
// The learning rate of each optimizer update, from the config's scheduler
// section, computed the way DeepSpeed's runtime/lr_schedules.py computes it
// (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), so a
// DeepSpeed config trains with the same learning rates here.
//
//   STRATA_ASSIGN_OR_RETURN(LrSchedule schedule,
//                           LrSchedule::create(config.scheduler, config.optimizer.lr, config.source));
//   ... for the k-th applied update (k = 1, 2, ...): hyper.lr = schedule.lr(k);
//
// Note [Which lr the k-th update uses]
// DeepSpeed's scheduler holds last_batch_iteration, -1 at the start. Its
// constructor writes the lr of iteration -1 into the optimizer, and the
// engine calls scheduler.step() (iteration += 1, write that lr) after every
// optimizer step that was applied; a step skipped for an fp16 overflow does
// not advance it. So the k-th applied update runs with the lr of iteration
// k - 2:
//   update 1 -> iteration -1 (the constructor's value), update 2 -> iteration 0, ...
// lr(k) returns exactly that. `k` counts APPLIED updates only: the engine must
// not advance it on a step the loss scaler skipped. Consequences, as in DeepSpeed:
//   - WarmupLR / WarmupDecayLR: lr(1) = lr(2) = warmup_min_lr (iteration -1 and 0);
//     log warm-up reaches warmup_max_lr at k = W + 1, linear at k = W + 2,
//     where W = max(2, warmup_num_steps) (DeepSpeed's own clamp).
//   - WarmupCosineLR: lr(1) = 0 (DeepSpeed returns 0 before the schedule
//     starts); lr(2) = base_lr * warmup_min_ratio.
//   - OneCycle, LRRangeTest: lr(k) is the curve at batch k - 1, so lr(1) is
//     cycle_min_lr / lr_range_test_min_lr and OneCycle peaks at
//     k = cycle_first_step_size + 1.
// scheduler.params.last_batch_iteration = L >= 0 resumes a schedule: the
// first update of this run uses the lr of iteration L (what the optimizer
// of the interrupted run last held), i.e. lr(k) is the fresh schedule's
// lr(k + L + 1). (DeepSpeed keeps whatever lr the optimizer holds for that
// first update; after a checkpoint load that is the same value.) An engine
// that restores its own update count from a checkpoint should leave L at -1
// and pass the absolute count.
//
// Momentum: DeepSpeed's OneCycle also cycles Adam's beta1 (and sets beta2 to
// 0.99) when cycle_momentum is true (the default). betas(k) gives those
// values for the same k; every other schedule returns nullopt (betas stay
// the optimizer's). Whether to apply them is the engine's choice.
//
// Differences from DeepSpeed: values DeepSpeed would accept and then misuse
// are errors here (see create()); unknown warmup_type is an error (DeepSpeed
// falls back to log with a warning); one lr for all parameter groups.

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "strata/core/config.h"
#include "strata/core/status.h"

namespace strata::offload {

class LrSchedule {
 public:
  // `cfg.params` must hold the type's parameters by name; a key missing
  // from it takes the config schema's default (the config parser has
  // already filled them in). WarmupLR's warmup_max_lr given as null is
  // base_lr, as DeepSpeed's None. `base_lr` is the optimizer's lr
  // (optimizer.params.lr): the constant lr of SchedulerType::kNone and the
  // peak of WarmupCosineLR. `source` (the config file) prefixes messages.
  // InvalidArgument, naming the key ("scheduler.params.warmup_num_steps")
  // with a hint, for: a missing required value (total_num_steps,
  // cycle_min_lr, cycle_max_lr), a wrong JSON type, a non-integer count,
  // a non-finite or negative number, warmup_num_steps < 1,
  // warmup_max_lr < warmup_min_lr, total_num_steps < warmup_num_steps,
  // a ratio outside [0, 1], cycle_min_lr > cycle_max_lr, step sizes < 1,
  // last_batch_iteration < -1, unknown warmup_type, base_lr < 0.
  static Result<LrSchedule> create(const SchedulerConfig& cfg, double base_lr, std::string_view source = {});

  // The lr of the step-th applied optimizer update (1-based; Note [Which lr
  // the k-th update uses]). step < 1 is a bug (checked).
  double lr(int64_t step) const;

  // {beta1, beta2} for the step-th applied update when the schedule cycles
  // momentum (OneCycle with cycle_momentum true); nullopt otherwise.
  std::optional<std::array<double, 2>> betas(int64_t step) const;

  SchedulerType type() const { return type_; }
  double base_lr() const { return base_lr_; }

 private:
  LrSchedule() = default;
  // DeepSpeed's last_batch_iteration during the step-th applied update.
  int64_t iteration_of(int64_t step) const;
  double lr_at_iteration(int64_t iteration) const;
  double one_cycle_scale(int64_t batch) const;

  // create's steps: each reads its keys of scheduler.params into the members below.
  class ParamReader;  // scheduler.params.<name> with the config checker's messages (lr_schedule.cpp)
  Status read_last_batch_iteration(const ParamReader& p);
  Status read_type_params(const ParamReader& p, const SchedulerConfig& cfg, double base_lr);
  Status read_warmup_curve(const ParamReader& p);
  Status read_warmup_lrs(const ParamReader& p, const SchedulerConfig& cfg, double base_lr);
  Status read_total_steps(const ParamReader& p);
  Status read_cosine_ratios(const ParamReader& p);
  Status read_cycle_lrs(const ParamReader& p);
  Status read_cycle_shape(const ParamReader& p);
  Status read_cycle_decay_and_momentum(const ParamReader& p);
  Status read_range_test(const ParamReader& p);

  SchedulerType type_ = SchedulerType::kNone;
  double base_lr_ = 0;
  int64_t last_batch_iteration_ = -1;

  // WarmupLR, WarmupDecayLR, WarmupCosineLR.
  double warmup_min_lr_ = 0;
  double warmup_max_lr_ = 0;
  int64_t warmup_steps_ = 2;  // max(2, warmup_num_steps), as DeepSpeed clamps it
  bool warmup_linear_ = false;
  double inverse_log_warmup_ = 0;
  int64_t total_num_steps_ = 0;
  double warmup_min_ratio_ = 0;
  double cos_min_ratio_ = 0;

  // OneCycle.
  double cycle_min_lr_ = 0;
  double cycle_max_lr_ = 0;
  double decay_lr_rate_ = 0;
  double first_step_size_ = 0;
  double second_step_size_ = 0;
  double total_size_ = 0;
  double step_ratio_ = 0;
  int64_t first_stair_count_ = 0;
  int64_t second_stair_count_ = 0;
  int64_t decay_step_size_ = 0;
  bool skip_lr_decay_ = true;
  bool cycle_momentum_ = false;
  bool skip_mom_decay_ = true;
  double cycle_min_mom_ = 0;
  double cycle_max_mom_ = 0;
  double decay_mom_rate_ = 0;

  // LRRangeTest.
  double range_min_lr_ = 0;
  double range_step_rate_ = 0;
  int64_t range_step_size_ = 1;
  bool range_staircase_ = false;
};

}  // namespace strata::offload
