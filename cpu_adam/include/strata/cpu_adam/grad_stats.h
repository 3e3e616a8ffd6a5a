#pragma once
// The gradient's squared L2 norm and finiteness in one read-only pass: the
// input of global gradient clipping and of the loss-scaler's overflow
// decision. Sums are taken in double over fixed tiles and added in tile
// order, so the result does not depend on the thread count.

#include <cmath>
#include <cstddef>

namespace strata::cpu_adam {

struct GradStats {
  // Sum of g*g over the raw (still loss-scaled) gradient elements. Each
  // square is exact in double; not finite iff some element is Inf or NaN.
  double sum_squares = 0.0;
  bool all_finite = true;  // no Inf or NaN anywhere in the gradient

  // L2 norm of the unscaled gradient: sqrt(sum_squares) / loss_scale.
  double norm(double loss_scale = 1.0) const { return std::sqrt(sum_squares) / loss_scale; }
};

// Combines per-shard stats (e.g. after an all-reduce of sum_squares).
inline GradStats combine(const GradStats& a, const GradStats& b) {
  return {a.sum_squares + b.sum_squares, a.all_finite && b.all_finite};
}

// torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm /
// (total_norm + 1e-6)); 1 when max_norm <= 0 (clipping off).
inline float clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0.0 || !std::isfinite(total_norm)) return 1.0f;
  const double coef = max_norm / (total_norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

}  // namespace strata::cpu_adam
