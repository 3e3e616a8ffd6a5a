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

float load_element(const void* base, DType type, size_t i) {
  switch (type) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return fp16_bits_to_fp32(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

void store_element(void* base, DType type, size_t i, float value) {
  switch (type) {
    case DType::kF32: static_cast<float*>(base)[i] = value; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = fp32_to_bf16_bits(value); break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = fp32_to_fp16_bits(value); break;
  }
}

void store_copy(const TileSpans& t, size_t i, float p) {
  if (t.copy_type == CopyType::kBF16) static_cast<uint16_t*>(t.param_copy)[i] = fp32_to_bf16_bits(p);
  if (t.copy_type == CopyType::kF16) static_cast<uint16_t*>(t.param_copy)[i] = fp32_to_fp16_bits(p);
}

float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

void adam_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    float g = load_element(t.grads, t.grad_dtype, i) * f.grad_multiplier;
    float m = load_element(t.exp_avg, t.moment_dtype, i);
    float v = load_element(t.exp_avg_sq, t.moment_dtype, i);
    if (f.l2_decay) g = g + f.weight_decay * p;
    m = m + f.one_minus_beta1 * (g - m);
    v = v * f.beta2 + (f.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / f.bias_correction2_sqrt + f.eps;
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = p - (f.step_size * m) / denom;
    t.params[i] = p;
    store_element(t.exp_avg, t.moment_dtype, i, m);
    store_element(t.exp_avg_sq, t.moment_dtype, i, v);
    store_copy(t, i, p);
  }
}

void adagrad_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    float g = load_element(t.grads, t.grad_dtype, i) * f.grad_multiplier;
    float s = load_element(t.exp_avg_sq, t.moment_dtype, i);
    if (f.l2_decay) g = g + f.weight_decay * p;
    s = s + g * g;
    p = p - (f.lr * g) / (std::sqrt(s) + f.eps);
    t.params[i] = p;
    store_element(t.exp_avg_sq, t.moment_dtype, i, s);
    store_copy(t, i, p);
  }
}

void lion_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params[i];
    const float g = load_element(t.grads, t.grad_dtype, i) * f.grad_multiplier;
    float m = load_element(t.exp_avg, t.moment_dtype, i);
    const float c = m + f.one_minus_beta1 * (g - m);
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = p - f.lr * sign(c);
    m = m + f.one_minus_beta2 * (g - m);
    t.params[i] = p;
    store_element(t.exp_avg, t.moment_dtype, i, m);
    store_copy(t, i, p);
  }
}

void scalar_update(const StepFactors& f, const TileSpans& t) {
  switch (f.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: adam_update(f, t); break;
    case OptimizerKind::kAdagrad: adagrad_update(f, t); break;
    case OptimizerKind::kLion: lion_update(f, t); break;
  }
}

void scalar_probe(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    const float g = load_element(t.grads, t.grad_dtype, i);
    const float p = t.params[i] + g;
    t.params[i] = p;
    if (uses_exp_avg(f.kind))
      store_element(t.exp_avg, t.moment_dtype, i, load_element(t.exp_avg, t.moment_dtype, i) + g);
    if (uses_exp_avg_sq(f.kind))
      store_element(t.exp_avg_sq, t.moment_dtype, i, load_element(t.exp_avg_sq, t.moment_dtype, i) + g);
    store_copy(t, i, p);
  }
}

double scalar_sum_squares(const void* grads, DType grad_dtype, size_t count) {
  double sum = 0.0;
  for (size_t i = 0; i < count; ++i) {
    const double g = load_element(grads, grad_dtype, i);
    sum += g * g;
  }
  return sum;
}

}  // namespace

const KernelTable& scalar_kernels() {
  static const KernelTable table{&scalar_update, &scalar_probe, &scalar_sum_squares};
  return table;
}

}  // namespace strata::cpu_adam::detail
