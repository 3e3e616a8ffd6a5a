// The scalar reference: one readable loop per optimizer, the definition that
// every SIMD path in x86/ is compared against element by element.
//
// Note [Update formulas]
// Per element, with g the gradient times f.grad_multiplier (loss-scale
// unscaling and clipping fused), in float, each operation rounded once:
//   Adam/AdamW (torch.optim.Adam/AdamW, DeepSpeed adam_w_mode):
//     if Adam and wd != 0:   g = g + wd * p                (L2)
//     m = m + (1 - b1) * (g - m)                            (torch's lerp)
//     v = v * b2 + ((1 - b2) * g) * g                       (torch's addcmul)
//     denom = sqrt(v) / sqrt(1 - b2^t) + eps
//     if AdamW and wd != 0:  p = p * (1 - lr * wd)         (decoupled)
//     p = p - (lr / (1 - b1^t) * m) / denom
//   Adagrad (torch.optim.Adagrad, lr_decay 0):
//     if wd != 0: g = g + wd * p;  s = s + g * g;  p = p - (lr * g) / (sqrt(s) + eps)
//   Lion:
//     c = m + (1 - b1) * (g - m);  if wd != 0: p = p * (1 - lr * wd)
//     p = p - lr * sign(c);        m = m + (1 - b2) * (g - m)
// Scalar factors (1 - b1, lr / (1 - b1^t), sqrt(1 - b2^t), 1 - lr * wd) are
// computed in double once per step and rounded to float once; b^t is
// std::pow(b, t) each step, so it does not drift over long runs. Without
// bias correction step_size = lr and sqrt(1 - b2^t) = 1.
// The SIMD paths perform exactly these float operations in this order and
// use no FMA in the update (sqrt and division are correctly rounded in both),
// so their results are bit-identical to this loop; moments and the copy are
// rounded to bf16/fp16 with round-to-nearest-even (AVX512-BF16's
// vcvtneps2bf16 additionally flushes bf16 subnormals to zero).
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace strata::cpu_adam::detail {
namespace {

// Element access. The dtype is a template parameter so that each loop is
// compiled once per dtype mix (dispatch happens once per tile, below).
template <DType T>
float load(const void* base, size_t i) {
  if constexpr (T == DType::kF32) return static_cast<const float*>(base)[i];
  if constexpr (T == DType::kBF16) return bf16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  if constexpr (T == DType::kF16) return fp16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
}

template <DType T>
void store(void* base, size_t i, float value) {
  if constexpr (T == DType::kF32) static_cast<float*>(base)[i] = value;
  if constexpr (T == DType::kBF16) static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(value);
  if constexpr (T == DType::kF16) static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(value);
}

template <CopyType C>
void store_copy(void* base, size_t i, float p) {
  if constexpr (C == CopyType::kBF16) static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(p);
  if constexpr (C == CopyType::kF16) static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(p);
}

float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

template <DType G, DType M, CopyType C>
void adam_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    float g = load<G>(t.grads, i) * f.grad_multiplier;
    float m = load<M>(t.exp_avg, i);
    float v = load<M>(t.exp_avg_sq, i);
    if (f.l2_decay) g = g + f.weight_decay * p;
    m = m + f.one_minus_beta1 * (g - m);
    v = v * f.beta2 + (f.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / f.bias_correction2_sqrt + f.eps;
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = p - (f.step_size * m) / denom;
    t.params[i] = p;
    store<M>(t.exp_avg, i, m);
    store<M>(t.exp_avg_sq, i, v);
    store_copy<C>(t.param_copy, i, p);
  }
}

template <DType G, DType M, CopyType C>
void adagrad_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    float g = load<G>(t.grads, i) * f.grad_multiplier;
    float s = load<M>(t.exp_avg_sq, i);
    if (f.l2_decay) g = g + f.weight_decay * p;
    s = s + g * g;
    p = p - (f.lr * g) / (std::sqrt(s) + f.eps);
    t.params[i] = p;
    store<M>(t.exp_avg_sq, i, s);
    store_copy<C>(t.param_copy, i, p);
  }
}

template <DType G, DType M, CopyType C>
void lion_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    const float g = load<G>(t.grads, i) * f.grad_multiplier;
    float m = load<M>(t.exp_avg, i);
    const float c = m + f.one_minus_beta1 * (g - m);
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = p - f.lr * sign(c);
    m = m + f.one_minus_beta2 * (g - m);
    t.params[i] = p;
    store<M>(t.exp_avg, i, m);
    store_copy<C>(t.param_copy, i, p);
  }
}

// The streaming probe: the same loads and stores as the update, one add each.
template <DType G, DType M, CopyType C>
void probe(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    const float g = load<G>(t.grads, i);
    const float p = t.params[i] + g;
    t.params[i] = p;
    if (uses_exp_avg(f.kind)) store<M>(t.exp_avg, i, load<M>(t.exp_avg, i) + g);
    if (uses_exp_avg_sq(f.kind)) store<M>(t.exp_avg_sq, i, load<M>(t.exp_avg_sq, i) + g);
    store_copy<C>(t.param_copy, i, p);
  }
}

template <DType G, DType M, CopyType C>
void update_or_probe(bool is_probe, const StepFactors& f, const TileSpans& t) {
  if (is_probe) return probe<G, M, C>(f, t);
  switch (f.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: return adam_update<G, M, C>(f, t);
    case OptimizerKind::kAdagrad: return adagrad_update<G, M, C>(f, t);
    case OptimizerKind::kLion: return lion_update<G, M, C>(f, t);
  }
}

// Runtime dtypes -> one instantiation, once per tile.
template <DType G, DType M>
void by_copy(bool is_probe, const StepFactors& f, const TileSpans& t) {
  switch (t.copy_type) {
    case CopyType::kNone: return update_or_probe<G, M, CopyType::kNone>(is_probe, f, t);
    case CopyType::kBF16: return update_or_probe<G, M, CopyType::kBF16>(is_probe, f, t);
    case CopyType::kF16: return update_or_probe<G, M, CopyType::kF16>(is_probe, f, t);
  }
}
template <DType G>
void by_moment(bool is_probe, const StepFactors& f, const TileSpans& t) {
  if (t.moment_dtype == DType::kBF16) return by_copy<G, DType::kBF16>(is_probe, f, t);
  return by_copy<G, DType::kF32>(is_probe, f, t);
}
void dispatch(bool is_probe, const StepFactors& f, const TileSpans& t) {
  switch (t.grad_dtype) {
    case DType::kF32: return by_moment<DType::kF32>(is_probe, f, t);
    case DType::kBF16: return by_moment<DType::kBF16>(is_probe, f, t);
    case DType::kF16: return by_moment<DType::kF16>(is_probe, f, t);
    case DType::kF64:
    case DType::kI64: break;  // rejected by validate_state
  }
}

void scalar_update(const StepFactors& f, const TileSpans& t) { dispatch(false, f, t); }
void scalar_probe(const StepFactors& f, const TileSpans& t) { dispatch(true, f, t); }

template <DType G>
double sum_squares(const void* grads, size_t count) {
  double sum = 0.0;
  for (size_t i = 0; i < count; ++i) {
    const double g = load<G>(grads, i);
    sum += g * g;
  }
  return sum;
}

double scalar_sum_squares(const void* grads, DType grad_dtype, size_t count) {
  switch (grad_dtype) {
    case DType::kF32: return sum_squares<DType::kF32>(grads, count);
    case DType::kBF16: return sum_squares<DType::kBF16>(grads, count);
    case DType::kF16: return sum_squares<DType::kF16>(grads, count);
    case DType::kF64:
    case DType::kI64: break;  // rejected by grad_stats
  }
  return 0.0;
}

}  // namespace

const KernelTable& scalar_kernels() {
  static const KernelTable table{&scalar_update, &scalar_probe, &scalar_sum_squares};
  return table;
}

}  // namespace strata::cpu_adam::detail
