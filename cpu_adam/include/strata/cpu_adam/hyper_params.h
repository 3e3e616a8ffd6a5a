#pragma once
// The optimizer algorithms and their hyper-parameters. Hyper-parameters and
// the step count are passed on every call, so schedules can change them.

#include <cstdint>
#include <string_view>

#include "strata/core/status.h"

namespace strata::cpu_adam {

// kAdam adds weight_decay * param to the gradient (L2, DeepSpeed
// adam_w_mode=false, torch.optim.Adam); kAdamW decays the parameter
// directly (decoupled, adam_w_mode=true, torch.optim.AdamW).
// kAdagrad follows torch.optim.Adagrad (lr_decay 0, initial accumulator 0);
// kLion follows Chen et al. 2023 (sign of the interpolated momentum).
enum class OptimizerKind : uint8_t { kAdam = 0, kAdamW, kAdagrad, kLion };

std::string_view optimizer_kind_name(OptimizerKind kind);  // "adam", "adamw", ...
// Accepts adam|adamw|adagrad|lion (case-insensitive).
Result<OptimizerKind> parse_optimizer_kind(std::string_view name);
// DeepSpeed's Adam: adam_w_mode true -> kAdamW, false -> kAdam.
constexpr OptimizerKind adam_kind(bool adam_w_mode) {
  return adam_w_mode ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
}

// Kept in double, like the Python floats of PyTorch and DeepSpeed; the
// kernels use the float value of each derived factor (see Note [Update
// formulas] in cpu_adam/src/reference.cpp).
struct HyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;    // Adam/AdamW/Lion
  double beta2 = 0.999;  // Adam/AdamW/Lion
  double eps = 1e-8;     // Adam/AdamW/Adagrad
  double weight_decay = 0.0;
  bool bias_correction = true;  // Adam/AdamW

  bool operator==(const HyperParams&) const = default;
};

// Checks ranges for `kind`: lr >= 0, 0 <= beta < 1, eps >= 0 (> 0 for
// Adagrad), weight_decay >= 0, all finite. The message names the field.
Status validate_hyper_params(OptimizerKind kind, const HyperParams& hyper);

}  // namespace strata::cpu_adam
