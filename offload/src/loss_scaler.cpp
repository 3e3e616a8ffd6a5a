// LossScaler: DeepSpeed's static and dynamic fp16 loss scaling
// (Note [DeepSpeed's dynamic loss scale] in loss_scaler.h).

#include "strata/offload/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

namespace strata::offload {
namespace {

Status fp16_error(std::string_view source, std::string_view key, std::string message, std::string hint) {
  ConfigIssue issue;
  issue.severity = IssueSeverity::kError;
  issue.path = fmt::format("fp16.{}", key);
  issue.message = std::move(message);
  issue.hint = std::move(hint);
  return InvalidArgument(format_issue(issue, source));
}

Status state_error(std::string message) {
  return InvalidArgument(fmt::format("loss scaler state: {} (hint: the checkpoint was written with a different fp16 "
                                     "section, or is damaged)",
                                     message));
}

}  // namespace

Result<LossScaler> LossScaler::create(const Fp16Config& cfg, std::string_view source) {
  LossScaler s;
  if (!cfg.enabled) {
    s.mode_ = Mode::kDisabled;
    s.state_.scale = 1;
    return s;
  }
  if (!std::isfinite(cfg.loss_scale) || cfg.loss_scale < 0) {
    return fp16_error(source, "loss_scale", fmt::format("{} must be finite and >= 0", cfg.loss_scale),
                      "0 selects dynamic loss scaling; a positive value is a static scale, e.g. 128");
  }
  if (cfg.loss_scale > 0) {
    s.mode_ = Mode::kStatic;
    s.state_.scale = cfg.loss_scale;
    return s;
  }
  if (cfg.initial_scale_power < 0 || cfg.initial_scale_power > 64) {
    return fp16_error(source, "initial_scale_power", fmt::format("{} is outside [0, 64]", cfg.initial_scale_power),
                      "the scale starts at 2^initial_scale_power; 16 is the usual value");
  }
  if (cfg.loss_scale_window < 1) {
    return fp16_error(source, "loss_scale_window", fmt::format("{} must be at least 1", cfg.loss_scale_window),
                      "clean steps before the scale doubles; 1000 is the usual value");
  }
  if (cfg.hysteresis < 1) {
    return fp16_error(source, "hysteresis", fmt::format("{} must be at least 1", cfg.hysteresis),
                      "overflows tolerated before the scale halves; 1 halves on every overflow, 2 is the default");
  }
  if (!std::isfinite(cfg.min_loss_scale) || !(cfg.min_loss_scale > 0)) {
    return fp16_error(source, "min_loss_scale", fmt::format("{} must be finite and > 0", cfg.min_loss_scale),
                      "the smallest dynamic scale; 1 is the default");
  }
  const double initial = std::ldexp(1.0, static_cast<int>(cfg.initial_scale_power));
  if (initial < cfg.min_loss_scale) {
    return fp16_error(source, "initial_scale_power",
                      fmt::format("the initial scale 2^{} = {} is below min_loss_scale {}", cfg.initial_scale_power,
                                  initial, cfg.min_loss_scale),
                      "raise initial_scale_power or lower min_loss_scale");
  }
  s.mode_ = Mode::kDynamic;
  s.min_scale_ = cfg.min_loss_scale;
  s.window_ = cfg.loss_scale_window;
  s.hysteresis_ = cfg.hysteresis;
  s.consecutive_hysteresis_ = cfg.consecutive_hysteresis;
  s.state_.scale = initial;
  s.state_.hysteresis_left = cfg.hysteresis;
  return s;
}

Status LossScaler::update(bool overflow) {
  LossScalerState& st = state_;
  if (mode_ == Mode::kDynamic) {
    if (overflow) {
      if (hysteresis_ == 1 || st.hysteresis_left == 1) {
        if (st.scale == min_scale_) {
          return FailedPrecondition(fmt::format(
              "fp16 gradients overflowed at the minimum loss scale {} (update {}, {} overflows so far): the loss "
              "scale cannot shrink further (hint: the run has diverged; lower the learning rate, lower "
              "fp16.min_loss_scale, or train in bf16)",
              st.scale, st.iteration + 1, st.overflow_count));
        }
        st.scale = std::max(st.scale / 2, min_scale_);
      } else {
        st.hysteresis_left -= 1;
      }
      st.last_overflow_iteration = st.iteration;
    } else {
      if (consecutive_hysteresis_) st.hysteresis_left = hysteresis_;
      const int64_t stable = st.iteration - st.last_overflow_iteration - 1;
      if (stable > 0 && stable % window_ == 0) {
        if (!consecutive_hysteresis_) st.hysteresis_left = hysteresis_;
        st.scale *= 2;
      }
    }
  } else if (overflow) {
    // A static or disabled scale never moves; the step is still skipped.
    st.last_overflow_iteration = st.iteration;
  }
  if (overflow) st.overflow_count += 1;
  st.iteration += 1;
  return Status::Ok();
}

Status LossScaler::restore(const LossScalerState& state) {
  if (state.iteration < 0) return state_error(fmt::format("iteration {} is negative", state.iteration));
  if (state.last_overflow_iteration < -1 || state.last_overflow_iteration >= state.iteration) {
    return state_error(fmt::format("last_overflow_iteration {} is not in [-1, iteration {})",
                                   state.last_overflow_iteration, state.iteration));
  }
  if (state.overflow_count < 0 || state.overflow_count > state.iteration) {
    return state_error(fmt::format("overflow_count {} is not in [0, iteration {}]", state.overflow_count, state.iteration));
  }
  if (state.last_overflow_iteration == -1 && state.overflow_count != 0) {
    return state_error(fmt::format("overflow_count {} with no last overflow", state.overflow_count));
  }
  LossScalerState next = state;
  if (mode_ == Mode::kDynamic) {
    if (!std::isfinite(state.scale) || state.scale < min_scale_) {
      return state_error(fmt::format("scale {} is not finite and >= fp16.min_loss_scale {}", state.scale, min_scale_));
    }
    if (state.hysteresis_left < 1 || state.hysteresis_left > hysteresis_) {
      return state_error(fmt::format("hysteresis_left {} is not in [1, fp16.hysteresis {}]", state.hysteresis_left,
                                     hysteresis_));
    }
  } else {
    next.scale = state_.scale;
    next.hysteresis_left = state_.hysteresis_left;
  }
  state_ = next;
  return Status::Ok();
}

}  // namespace strata::offload
