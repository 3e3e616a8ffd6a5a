#pragma once
// The fp16 loss scale, from the config's fp16 section, updated once per
// optimizer step exactly as DeepSpeed's DynamicLossScaler.update_scale
// (runtime/fp16/loss_scaler.py) does, so a DeepSpeed fp16 config skips the
// same steps and uses the same scales here.
//
//   STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::create(config.fp16, config.source));
//   each step: backward with loss * scaler.scale(); overflow = any non-finite gradient
//              (voted over all ranks); STRATA_RETURN_IF_ERROR(scaler.update(overflow));
//              overflow: skip the update (and do not advance the LrSchedule's count)
//              else: unscale the gradients by 1 / (the scale the backward used) and step.
//
// Modes:
//   - disabled (fp16.enabled false): scale 1; update only counts.
//   - static (fp16.loss_scale > 0): scale = loss_scale forever; update only counts.
//   - dynamic (fp16.loss_scale == 0): scale starts at 2^initial_scale_power.
//
// Note [DeepSpeed's dynamic loss scale]
// State: scale, iteration (update calls so far), last_overflow_iteration
// (-1 before any), hysteresis_left (starts at fp16.hysteresis). One update:
//   overflow:
//     if fp16.hysteresis == 1 or hysteresis_left == 1:
//        if scale == min_loss_scale: error (DeepSpeed raises "Current loss scale already
//          at minimum" and the run stops; nothing changes here either)
//        scale = max(scale / 2, min_loss_scale)        (hysteresis_left stays 1)
//     else hysteresis_left -= 1
//     last_overflow_iteration = iteration
//   no overflow:
//     if consecutive_hysteresis: hysteresis_left = fp16.hysteresis
//     stable = iteration - last_overflow_iteration - 1
//     if stable > 0 and stable % loss_scale_window == 0:
//        if not consecutive_hysteresis: hysteresis_left = fp16.hysteresis
//        scale *= 2
//   iteration += 1
// So the scale doubles on the (window + 1)-th clean update in a row (from the
// start or after an overflow) and then on every window-th clean update after
// that; an overflow restarts the count.
//
// Differences from DeepSpeed: min_loss_scale may be fractional (DeepSpeed's
// pydantic model types it int); every value is checked (see create()).

#include <cstdint>
#include <string_view>

#include "strata/core/config.h"
#include "strata/core/status.h"

namespace strata::offload {

// Everything a checkpoint needs to resume the scaler bit for bit.
struct LossScalerState {
  double scale = 1;
  int64_t iteration = 0;                 // update() calls so far (DeepSpeed's cur_iter)
  int64_t last_overflow_iteration = -1;  // iteration of the last overflow; -1: none yet
  int64_t hysteresis_left = 1;           // overflows still tolerated before halving (cur_hysteresis)
  int64_t overflow_count = 0;            // updates that overflowed = optimizer steps skipped

  bool operator==(const LossScalerState&) const = default;
};

class LossScaler {
 public:
  enum class Mode : uint8_t { kDisabled, kStatic, kDynamic };

  // InvalidArgument naming "fp16.<key>" with a hint when fp16 is enabled and
  // initial_scale_power is outside [0, 64], loss_scale_window < 1,
  // hysteresis < 1, min_loss_scale is not finite and > 0, loss_scale is not
  // finite and >= 0, or (dynamic) 2^initial_scale_power < min_loss_scale.
  // Nothing is checked when fp16 is disabled (DeepSpeed ignores the section).
  static Result<LossScaler> create(const Fp16Config& cfg, std::string_view source = {});

  Mode mode() const { return mode_; }
  bool dynamic() const { return mode_ == Mode::kDynamic; }
  // The scale to multiply the loss by in this step's backward.
  double scale() const { return state_.scale; }

  // Once per optimizer step, after the overflow vote (Note [DeepSpeed's
  // dynamic loss scale]). FailedPrecondition (state unchanged) when a
  // dynamic scale is already at min_loss_scale and overflows again with no
  // hysteresis left: the gradients are not finite even at the smallest
  // scale, and DeepSpeed stops the run there too. Static and disabled
  // scalers only count.
  [[nodiscard]] Status update(bool overflow);

  int64_t overflow_count() const { return state_.overflow_count; }
  // The same count under DeepSpeed's name (engine.skipped_steps).
  int64_t skipped_steps() const { return state_.overflow_count; }

  const LossScalerState& state() const { return state_; }
  // Resumes from a checkpoint's state. InvalidArgument when it cannot have
  // come from this configuration (dynamic: scale not finite or below
  // min_loss_scale, hysteresis_left outside [1, fp16.hysteresis]; any mode:
  // negative counters, last_overflow_iteration not in [-1, iteration),
  // overflow_count above iteration). A static or disabled scaler keeps its
  // configured scale and takes only the counters.
  [[nodiscard]] Status restore(const LossScalerState& state);

 private:
  LossScaler() = default;

  Mode mode_ = Mode::kDisabled;
  double min_scale_ = 1;
  int64_t window_ = 1000;
  int64_t hysteresis_ = 2;
  bool consecutive_hysteresis_ = false;
  LossScalerState state_;
};

}  // namespace strata::offload
