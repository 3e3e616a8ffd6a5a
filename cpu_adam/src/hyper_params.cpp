#include "strata/cpu_adam/hyper_params.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>

namespace strata::cpu_adam {

std::string_view optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdagrad: return "adagrad";
    case OptimizerKind::kLion: return "lion";
  }
  return "?";
}

Result<OptimizerKind> parse_optimizer_kind(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW, OptimizerKind::kAdagrad, OptimizerKind::kLion})
    if (n == optimizer_kind_name(k)) return k;
  return InvalidArgument(fmt::format("unknown optimizer '{}'; expected adam, adamw, adagrad or lion", name));
}

namespace {
Status check_range(std::string_view field, double value, double lo, bool lo_inclusive, double hi, std::string_view hint) {
  const bool ok = std::isfinite(value) && (lo_inclusive ? value >= lo : value > lo) && value < hi;
  if (ok) return Status::Ok();
  return InvalidArgument(fmt::format("optimizer hyper-parameter {} = {} is out of range: {}", field, value, hint));
}
}  // namespace

Status validate_hyper_params(OptimizerKind kind, const HyperParams& h) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  STRATA_RETURN_IF_ERROR(check_range("lr", h.lr, 0.0, true, kInf, "must be finite and >= 0"));
  STRATA_RETURN_IF_ERROR(check_range("weight_decay", h.weight_decay, 0.0, true, kInf, "must be finite and >= 0"));
  if (kind != OptimizerKind::kAdagrad) {
    STRATA_RETURN_IF_ERROR(check_range("beta1", h.beta1, 0.0, true, 1.0, "must be in [0, 1), e.g. 0.9"));
    STRATA_RETURN_IF_ERROR(check_range("beta2", h.beta2, 0.0, true, 1.0, "must be in [0, 1), e.g. 0.999"));
  }
  if (kind == OptimizerKind::kAdagrad) {
    STRATA_RETURN_IF_ERROR(check_range("eps", h.eps, 0.0, false, kInf, "must be finite and > 0 for Adagrad, e.g. 1e-10"));
  } else if (kind != OptimizerKind::kLion) {
    STRATA_RETURN_IF_ERROR(check_range("eps", h.eps, 0.0, true, kInf, "must be finite and >= 0, e.g. 1e-8"));
  }
  return Status::Ok();
}

}  // namespace strata::cpu_adam
