// LrSchedule: DeepSpeed's learning-rate schedules as pure functions of the
// applied-update count. The arithmetic follows DeepSpeed's operation order
// (e.g. (1 / log W) * log(i + 1), not log(i + 1) / log W) so that the values
// match its Python floats bit for bit where libm agrees.

#include "strata/offload/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include <fmt/format.h>

#include "strata/core/config_schema.h"

namespace strata::offload {
namespace {

using nlohmann::json;

constexpr double kMax = std::numeric_limits<double>::max();
constexpr int64_t kMaxSteps = int64_t{1} << 53;  // counts stay exact as doubles

// DeepSpeed tests its "0" switches with math.isclose(x, 0), which with the
// default tolerances is true only for exactly 0.
bool is_zero(double x) { return x == 0.0; }

Status check_base_lr(double base_lr, std::string_view source) {
  if (std::isfinite(base_lr) && base_lr >= 0) return Status::Ok();
  ConfigIssue issue{IssueSeverity::kError, "optimizer.params.lr", fmt::format("learning rate {} must be finite and >= 0", base_lr),
                    "set optimizer.params.lr to the peak learning rate, e.g. 1e-4"};
  return InvalidArgument(format_issue(issue, source));
}

Status check_params_object(const json& params, std::string_view source) {
  if (params.is_object()) return Status::Ok();
  ConfigIssue issue{IssueSeverity::kError, "scheduler.params", fmt::format("must be an object, not {}", params.dump()),
                    "write \"params\": { ... } with the schedule's keys"};
  return InvalidArgument(format_issue(issue, source));
}

}  // namespace

// Reads scheduler.params.<name> with messages in the config checker's format.
class LrSchedule::ParamReader {
 public:
  ParamReader(const json& params, std::string_view type, std::string_view source)
      : params_(params), type_(type), source_(source) {}

  Status error(std::string_view name, std::string message, std::string hint) const {
    ConfigIssue issue;
    issue.severity = IssueSeverity::kError;
    issue.path = fmt::format("scheduler.params.{}", name);
    issue.message = std::move(message);
    issue.hint = std::move(hint);
    return InvalidArgument(format_issue(issue, source_));
  }

  // The given value, else the schema's default; null when neither exists.
  json value(std::string_view name) const {
    const auto it = params_.find(std::string(name));
    if (it != params_.end()) return *it;
    const ConfigKey* key = find_config_key(fmt::format("scheduler.params.{}", name));
    return key == nullptr ? json() : key->default_value();
  }

  bool is_null(std::string_view name) const { return value(name).is_null(); }

  Result<double> number(std::string_view name, double min, double max, std::string_view hint) const {
    const json v = value(name);
    if (v.is_null()) {
      return error(name, fmt::format("required by {} but not given", type_), std::string(hint));
    }
    if (!v.is_number()) {
      return error(name, fmt::format("must be a number, not {}", v.dump()), std::string(hint));
    }
    const double d = v.get<double>();
    if (!std::isfinite(d)) return error(name, fmt::format("must be finite, not {}", d), std::string(hint));
    if (d < min || d > max) {
      return error(name,
                   max == std::numeric_limits<double>::max()
                       ? fmt::format("{} is below the smallest allowed value {}", d, min)
                       : fmt::format("{} is outside [{}, {}]", d, min, max),
                   std::string(hint));
    }
    return d;
  }

  Result<int64_t> integer(std::string_view name, int64_t min, std::string_view hint) const {
    const json v = value(name);
    if (v.is_null()) {
      return error(name, fmt::format("required by {} but not given", type_), std::string(hint));
    }
    int64_t i = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
        return error(name, fmt::format("{} is too large", v.dump()), std::string(hint));
      }
      i = v.get<int64_t>();
    } else if (v.is_number_float()) {
      // JSON writes 1e3 as a float; accept it when it is a whole number.
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e15) {
        return error(name, fmt::format("must be a whole number of steps, not {}", v.dump()), std::string(hint));
      }
      i = static_cast<int64_t>(d);
    } else {
      return error(name, fmt::format("must be an integer, not {}", v.dump()), std::string(hint));
    }
    if (i < min) return error(name, fmt::format("{} is below the smallest allowed value {}", i, min), std::string(hint));
    return i;
  }

  Result<bool> boolean(std::string_view name) const {
    const json v = value(name);
    if (!v.is_boolean()) return error(name, fmt::format("must be true or false, not {}", v.dump()), "write true or false");
    return v.get<bool>();
  }

 private:
  const json& params_;
  std::string_view type_;
  std::string_view source_;
};

Result<LrSchedule> LrSchedule::create(const SchedulerConfig& cfg, double base_lr, std::string_view source) {
  LrSchedule s;
  s.type_ = cfg.type;
  STRATA_RETURN_IF_ERROR(check_base_lr(base_lr, source));
  s.base_lr_ = base_lr;
  if (cfg.type == SchedulerType::kNone) return s;
  STRATA_RETURN_IF_ERROR(check_params_object(cfg.params, source));
  const ParamReader p(cfg.params, scheduler_type_name(cfg.type), source);
  STRATA_RETURN_IF_ERROR(s.read_last_batch_iteration(p));
  STRATA_RETURN_IF_ERROR(s.read_type_params(p, cfg, base_lr));
  return s;
}

Status LrSchedule::read_last_batch_iteration(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(last_batch_iteration_,
                          p.integer("last_batch_iteration", -1, "-1 starts the schedule; N resumes after iteration N"));
  if (last_batch_iteration_ > kMaxSteps) {
    return p.error("last_batch_iteration", fmt::format("{} is too large", last_batch_iteration_), "at most 2^53");
  }
  return Status::Ok();
}

// The parameters of cfg.type, in the order DeepSpeed's constructors read them.
Status LrSchedule::read_type_params(const ParamReader& p, const SchedulerConfig& cfg, double base_lr) {
  switch (cfg.type) {
    case SchedulerType::kNone:
      return Status::Ok();
    case SchedulerType::kWarmupLR:
      STRATA_RETURN_IF_ERROR(read_warmup_curve(p));
      return read_warmup_lrs(p, cfg, base_lr);
    case SchedulerType::kWarmupDecayLR:
      STRATA_RETURN_IF_ERROR(read_warmup_curve(p));
      STRATA_RETURN_IF_ERROR(read_warmup_lrs(p, cfg, base_lr));
      return read_total_steps(p);
    case SchedulerType::kWarmupCosineLR:
      STRATA_RETURN_IF_ERROR(read_warmup_curve(p));
      STRATA_RETURN_IF_ERROR(read_total_steps(p));
      return read_cosine_ratios(p);
    case SchedulerType::kOneCycle:
      STRATA_RETURN_IF_ERROR(read_cycle_lrs(p));
      STRATA_RETURN_IF_ERROR(read_cycle_shape(p));
      return read_cycle_decay_and_momentum(p);
    case SchedulerType::kLRRangeTest:
      return read_range_test(p);
  }
  return Status::Ok();
}

// warmup_num_steps (clamped to at least 2, as DeepSpeed does) and warmup_type.
Status LrSchedule::read_warmup_curve(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(int64_t warmup_num_steps,
                          p.integer("warmup_num_steps", 1, "at least 1 (DeepSpeed rejects 0 warm-up steps)"));
  if (warmup_num_steps > kMaxSteps) return p.error("warmup_num_steps", "is too large", "at most 2^53");
  warmup_steps_ = std::max<int64_t>(2, warmup_num_steps);
  inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_steps_));
  const json warmup_type = p.value("warmup_type");
  if (!warmup_type.is_string() || (warmup_type != "log" && warmup_type != "linear")) {
    return p.error("warmup_type", fmt::format("unknown warm-up curve {}", warmup_type.dump()),
                   "use \"log\" or \"linear\"");
  }
  warmup_linear_ = warmup_type == "linear";
  return Status::Ok();
}

Status LrSchedule::read_warmup_lrs(const ParamReader& p, const SchedulerConfig& cfg, double base_lr) {
  STRATA_ASSIGN_OR_RETURN(warmup_min_lr_, p.number("warmup_min_lr", 0, kMax, "a learning rate >= 0, e.g. 0"));
  // DeepSpeed's WarmupLR: None means the optimizer's lr.
  const bool max_lr_is_base_lr = cfg.type == SchedulerType::kWarmupLR && cfg.params.contains("warmup_max_lr") &&
                                 cfg.params["warmup_max_lr"].is_null();
  if (max_lr_is_base_lr) {
    warmup_max_lr_ = base_lr;
  } else {
    STRATA_ASSIGN_OR_RETURN(warmup_max_lr_, p.number("warmup_max_lr", 0, kMax, "a learning rate >= 0, e.g. 1e-3"));
  }
  if (warmup_max_lr_ < warmup_min_lr_) {
    return p.error("warmup_max_lr",
                   fmt::format("{} is below warmup_min_lr {}: the warm-up would lower the learning rate",
                               warmup_max_lr_, warmup_min_lr_),
                   "make warmup_max_lr at least warmup_min_lr");
  }
  return Status::Ok();
}

Status LrSchedule::read_total_steps(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(total_num_steps_,
                          p.integer("total_num_steps", 1, "set it to the number of optimizer steps of the run"));
  if (total_num_steps_ > kMaxSteps) return p.error("total_num_steps", "is too large", "at most 2^53");
  STRATA_ASSIGN_OR_RETURN(int64_t warmup_num_steps, p.integer("warmup_num_steps", 1, ""));
  if (total_num_steps_ < warmup_num_steps) {
    return p.error("total_num_steps",
                   fmt::format("total_num_steps {} is shorter than warmup_num_steps {}", total_num_steps_,
                               warmup_num_steps),
                   "make total_num_steps at least warmup_num_steps");
  }
  return Status::Ok();
}

Status LrSchedule::read_cosine_ratios(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(warmup_min_ratio_,
                          p.number("warmup_min_ratio", 0, 1, "a fraction of optimizer.params.lr in [0, 1]"));
  STRATA_ASSIGN_OR_RETURN(cos_min_ratio_, p.number("cos_min_ratio", 0, 1, "a fraction of optimizer.params.lr in [0, 1]"));
  return Status::Ok();
}

// OneCycle's learning rates: the cycle's range and the decay after it.
Status LrSchedule::read_cycle_lrs(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(cycle_min_lr_, p.number("cycle_min_lr", 0, kMax, "the lowest lr of the cycle, e.g. 1e-5"));
  STRATA_ASSIGN_OR_RETURN(cycle_max_lr_, p.number("cycle_max_lr", 0, kMax, "the highest lr of the cycle, e.g. 1e-3"));
  if (cycle_min_lr_ > cycle_max_lr_) {
    return p.error("cycle_min_lr", fmt::format("{} is above cycle_max_lr {}", cycle_min_lr_, cycle_max_lr_),
                   "swap the two values");
  }
  STRATA_ASSIGN_OR_RETURN(decay_lr_rate_, p.number("decay_lr_rate", 0, kMax, "a rate >= 0; 0 keeps cycle_min_lr"));
  return Status::Ok();
}

// OneCycle's two halves: their lengths in steps and their stairs.
Status LrSchedule::read_cycle_shape(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(int64_t first, p.integer("cycle_first_step_size", 1, "at least 1 step"));
  int64_t second = first;
  if (!p.is_null("cycle_second_step_size")) {
    STRATA_ASSIGN_OR_RETURN(second, p.integer("cycle_second_step_size", 0, "at least 0 steps; null: same as the first"));
  }
  if (first > kMaxSteps || second > kMaxSteps) {
    return p.error(first > kMaxSteps ? "cycle_first_step_size" : "cycle_second_step_size", "is too large", "at most 2^53");
  }
  first_step_size_ = static_cast<double>(first);
  second_step_size_ = static_cast<double>(second);
  total_size_ = first_step_size_ + second_step_size_;
  step_ratio_ = first_step_size_ / total_size_;
  STRATA_ASSIGN_OR_RETURN(first_stair_count_, p.integer("cycle_first_stair_count", 0, "0 (smooth) or more stairs"));
  second_stair_count_ = first_stair_count_;
  if (!p.is_null("cycle_second_stair_count")) {
    STRATA_ASSIGN_OR_RETURN(second_stair_count_,
                            p.integer("cycle_second_stair_count", 0, "0 (smooth) or more stairs; null: same as the first"));
  }
  if (second_stair_count_ > 0 && second == 0) {
    return p.error("cycle_second_stair_count", "stairs in a falling half of 0 steps",
                   "set cycle_second_step_size >= 1 or the stair count to 0");
  }
  return Status::Ok();
}

// OneCycle after the cycle: the decay's step size, and the momentum cycle when it is on.
Status LrSchedule::read_cycle_decay_and_momentum(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(decay_step_size_, p.integer("decay_step_size", 0, "0 (no decay) or more steps"));
  skip_lr_decay_ = decay_step_size_ == 0 || is_zero(decay_lr_rate_);
  STRATA_ASSIGN_OR_RETURN(cycle_momentum_, p.boolean("cycle_momentum"));
  if (!cycle_momentum_) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(cycle_min_mom_, p.number("cycle_min_mom", 0, 1, "a momentum in [0, 1], e.g. 0.85"));
  STRATA_ASSIGN_OR_RETURN(cycle_max_mom_, p.number("cycle_max_mom", 0, 1, "a momentum in [0, 1], e.g. 0.95"));
  STRATA_ASSIGN_OR_RETURN(decay_mom_rate_, p.number("decay_mom_rate", 0, kMax, "a rate >= 0; 0 keeps cycle_max_mom"));
  skip_mom_decay_ = decay_step_size_ == 0 || is_zero(decay_mom_rate_);
  return Status::Ok();
}

Status LrSchedule::read_range_test(const ParamReader& p) {
  STRATA_ASSIGN_OR_RETURN(range_min_lr_, p.number("lr_range_test_min_lr", 0, kMax, "the starting lr, e.g. 1e-5"));
  STRATA_ASSIGN_OR_RETURN(range_step_size_, p.integer("lr_range_test_step_size", 1, "at least 1 step"));
  STRATA_ASSIGN_OR_RETURN(range_step_rate_, p.number("lr_range_test_step_rate", 0, kMax, "an increase >= 0 per step_size steps"));
  STRATA_ASSIGN_OR_RETURN(range_staircase_, p.boolean("lr_range_test_staircase"));
  return Status::Ok();
}

int64_t LrSchedule::iteration_of(int64_t step) const {
  STRATA_CHECK(step >= 1, "LrSchedule: optimizer updates count from 1");
  STRATA_CHECK(step <= kMaxSteps, "LrSchedule: step count beyond 2^53");
  // Fresh run: update k runs with iteration k - 2; resumed after iteration L:
  // update 1 with L, update k with L + k - 1. Both are k - 2 + (L + 1).
  return step - 2 + (last_batch_iteration_ + 1);
}

double LrSchedule::lr(int64_t step) const {
  const int64_t iteration = iteration_of(step);
  return type_ == SchedulerType::kNone ? base_lr_ : lr_at_iteration(iteration);
}

// DeepSpeed's OneCycle._get_scale_factor for batch = last_batch_iteration + 1.
double LrSchedule::one_cycle_scale(int64_t batch) const {
  const double b = static_cast<double>(batch);
  const double cycle = std::floor(1 + b / total_size_);
  const double x = 1. + b / total_size_ - cycle;
  double scale = 0;
  int64_t stair_count = 0;
  if (x <= step_ratio_) {
    scale = x / step_ratio_;
    stair_count = first_stair_count_;
  } else {
    scale = (x - 1) / (step_ratio_ - 1);
    stair_count = second_stair_count_;
  }
  if (stair_count > 0) {
    // Stairs are counted from the integer position in the cycle, not from
    // `scale`, whose rounding at the peak could drop a whole stair.
    const double in_cycle = std::fmod(b, total_size_);
    const double count = static_cast<double>(stair_count);
    const double position = in_cycle <= first_step_size_ ? in_cycle * count / first_step_size_
                                                          : (total_size_ - in_cycle) * count / second_step_size_;
    scale = std::floor(position) / count;
  }
  return scale;
}

double LrSchedule::lr_at_iteration(int64_t iteration) const {
  const double i = static_cast<double>(iteration);
  switch (type_) {
    case SchedulerType::kNone:
      return base_lr_;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR: {
      if (iteration < 0) return warmup_min_lr_;  // the constructor's value
      double gamma = 1.0;
      if (iteration < warmup_steps_) {
        gamma = warmup_linear_ ? i / static_cast<double>(warmup_steps_) : inverse_log_warmup_ * std::log(i + 1);
      } else if (type_ == SchedulerType::kWarmupDecayLR) {
        gamma = std::max(0.0, static_cast<double>(total_num_steps_ - iteration) /
                                  std::max(1.0, static_cast<double>(total_num_steps_ - warmup_steps_)));
      }
      return warmup_min_lr_ + (warmup_max_lr_ - warmup_min_lr_) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
      if (iteration < 0) return 0.0;  // DeepSpeed: "before it has started"
      double ratio = 0;
      if (iteration < warmup_steps_) {
        ratio = warmup_linear_ ? i / static_cast<double>(warmup_steps_) : inverse_log_warmup_ * std::log(i + 1);
        ratio = warmup_min_ratio_ + ratio * (1. - warmup_min_ratio_);
      } else {
        const double real_last = static_cast<double>(iteration - warmup_steps_ + 1);
        const double real_total = static_cast<double>(std::max<int64_t>(1, total_num_steps_ - warmup_steps_));
        const double progress = std::min(1.0, real_last / real_total);
        ratio = (1 + std::cos(std::numbers::pi * progress)) / 2;
        ratio = std::max(0.0, cos_min_ratio_ + (1. - cos_min_ratio_) * ratio);
      }
      return base_lr_ * ratio;
    }
    case SchedulerType::kOneCycle: {
      if (i < total_size_) {
        return cycle_min_lr_ + (cycle_max_lr_ - cycle_min_lr_) * one_cycle_scale(iteration + 1);
      }
      if (skip_lr_decay_) return cycle_min_lr_;
      const double decay_interval = (i - total_size_ + 1) / static_cast<double>(decay_step_size_);
      return cycle_min_lr_ / (1 + decay_lr_rate_ * decay_interval);
    }
    case SchedulerType::kLRRangeTest: {
      const double batch = i + 1;
      const double step_size = static_cast<double>(range_step_size_);
      const double interval = range_staircase_ ? std::floor(batch / step_size) : batch / step_size;
      return range_min_lr_ * (1 + range_step_rate_ * interval);
    }
  }
  STRATA_CHECK(false, "LrSchedule: unknown scheduler type");
  return 0;
}

std::optional<std::array<double, 2>> LrSchedule::betas(int64_t step) const {
  const int64_t iteration = iteration_of(step);
  if (type_ != SchedulerType::kOneCycle || !cycle_momentum_) return std::nullopt;
  // DeepSpeed pins beta2 at 0.99 whenever it cycles momentum.
  constexpr double kBeta2 = 0.99;
  if (iteration < 0) return std::array<double, 2>{cycle_min_mom_, kBeta2};  // the constructor's value
  const double i = static_cast<double>(iteration);
  if (i < total_size_) {
    return std::array<double, 2>{cycle_max_mom_ - (cycle_max_mom_ - cycle_min_mom_) * one_cycle_scale(iteration + 1), kBeta2};
  }
  if (skip_mom_decay_) return std::array<double, 2>{cycle_max_mom_, kBeta2};
  const double decay_interval = (i - total_size_ + 1) / static_cast<double>(decay_step_size_);
  return std::array<double, 2>{cycle_max_mom_ * (1 + decay_mom_rate_ * decay_interval), kBeta2};
}

}  // namespace strata::offload
