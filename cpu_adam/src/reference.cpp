// The scalar reference: one readable loop per optimizer, the definition that
// every SIMD path in x86/ is compared against element by element.
//
// Note [Update formulas]
// Per element, with g the gradient times f.grad_multiplier (loss-scale
// unscaling and clipping fused), in float; fma(a, b, c) = a * b + c rounded
// once (std::fma), every other operation rounded once:
//   Adam/AdamW (torch.optim.Adam/AdamW, DeepSpeed adam_w_mode):
//     if Adam and wd != 0:   g = fma(wd, p, g)                  (L2)
//     m = fma(1 - b1, g - m, m)                                  (torch's lerp)
//     v = fma((1 - b2) * g, g, v * b2)                           (torch's addcmul)
//     denom = fma(sqrt(v), 1 / sqrt(1 - b2^t), eps)
//     if AdamW and wd != 0:  p = p * (1 - lr * wd)              (decoupled)
//     p = fma(-lr / (1 - b1^t), m / denom, p)                    (torch's addcdiv)
//   Adagrad (torch.optim.Adagrad, lr_decay 0):
//     if wd != 0: g = fma(wd, p, g);  s = fma(g, g, s);  p = fma(-lr, g / (sqrt(s) + eps), p)
//   Lion:
//     c = fma(1 - b1, g - m, m);  if wd != 0: p = p * (1 - lr * wd)
//     p = fma(-lr, sign(c), p);   m = fma(1 - b2, g - m, m)
// Adam costs one square root and one division per element; the bias
// corrections are folded into two per-step scalars, so the element loop has
// no division by them (torch divides sqrt(v) by sqrt(1 - b2^t) and
// DeepSpeed multiplies; both round differently from us only at the last
// bit, see tests/cpu_adam/torch_compare.py). Scalar factors (1 - b1,
// -lr / (1 - b1^t), 1 / sqrt(1 - b2^t), 1 - lr * wd, -lr) are computed in
// double once per step and rounded to float once; b^t is std::pow(b, t)
// each step, so it does not drift over long runs. Without bias correction
// the step factor is -lr and 1 / sqrt(1 - b2^t) = 1.
// The SIMD paths perform exactly these float operations in this order,
// fusing exactly these FMAs (the library builds with -ffp-contract=off so
// the compiler fuses nothing else; sqrt, division and FMA are correctly
// rounded everywhere), so their results are bit-identical to this loop;
// moments and the copy are rounded to bf16/fp16 with round-to-nearest-even
// (AVX512-BF16's vcvtneps2bf16 additionally flushes bf16 subnormals to zero).
#include <cmath>
#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "int8_format.h"
#include "kernels.h"
#include "strata/cpu_adam/int8_moments.h"

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

// Reads one element of `in` and writes it to `out` (streaming probes; the
// same buffer in place, Note [Out-of-place steps] otherwise).
template <typename T>
void stream_element(const void* in, void* out, size_t i) {
  const volatile T* from = static_cast<const T*>(in) + i;
  volatile T* to = static_cast<T*>(out) + i;
  *to = *from;
}

float sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }

template <DType G, DType M, CopyType C>
void adam_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params_in[i];
    float g = load<G>(t.grads, i) * f.grad_multiplier;
    float m = load<M>(t.exp_avg_in, i);
    float v = load<M>(t.exp_avg_sq_in, i);
    if (f.l2_decay) g = std::fma(f.weight_decay, p, g);
    m = std::fma(f.one_minus_beta1, g - m, m);
    v = std::fma(f.one_minus_beta2 * g, g, v * f.beta2);
    const float denom = std::fma(std::sqrt(v), f.inv_bias_correction2_sqrt, f.eps);
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = std::fma(f.neg_step_size, m / denom, p);
    t.params[i] = p;
    store<M>(t.exp_avg, i, m);
    store<M>(t.exp_avg_sq, i, v);
    store_copy<C>(t.param_copy, i, p);
  }
}

template <DType G, DType M, CopyType C>
void adagrad_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params_in[i];
    float g = load<G>(t.grads, i) * f.grad_multiplier;
    float s = load<M>(t.exp_avg_sq_in, i);
    if (f.l2_decay) g = std::fma(f.weight_decay, p, g);
    s = std::fma(g, g, s);
    p = std::fma(f.neg_lr, g / (std::sqrt(s) + f.eps), p);
    t.params[i] = p;
    store<M>(t.exp_avg_sq, i, s);
    store_copy<C>(t.param_copy, i, p);
  }
}

template <DType G, DType M, CopyType C>
void lion_update(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    float p = t.params_in[i];
    const float g = load<G>(t.grads, i) * f.grad_multiplier;
    float m = load<M>(t.exp_avg_in, i);
    const float c = std::fma(f.one_minus_beta1, g - m, m);
    if (f.decoupled_decay) p = p * f.decay_factor;
    p = std::fma(f.neg_lr, sign(c), p);
    m = std::fma(f.one_minus_beta2, g - m, m);
    t.params[i] = p;
    store<M>(t.exp_avg, i, m);
    store_copy<C>(t.param_copy, i, p);
  }
}

// Adam/AdamW with 8-bit moments (Note [Block-wise 8-bit moments],
// int8_moments.cpp): per block, decode with the old scales, the update of
// Note [Update formulas] with u = sqrt(v) kept, then the new scales (block
// maxima) and the codes. Same floats as dequantize -> fp32 step -> quantize.
template <DType G, CopyType C>
void adam_update_int8(const StepFactors& f, const TileSpans& t) {
  auto* m_codes = static_cast<uint8_t*>(t.exp_avg);
  auto* v_codes = static_cast<uint8_t*>(t.exp_avg_sq);
  const auto* m_codes_in = static_cast<const uint8_t*>(t.exp_avg_in);
  const auto* v_codes_in = static_cast<const uint8_t*>(t.exp_avg_sq_in);
  float m_new[kMaxMomentBlockElements], u_new[kMaxMomentBlockElements];
  for (size_t begin = 0, block = 0; begin < t.count; begin += t.block_elements, ++block) {
    const size_t n = std::min(t.block_elements, t.count - begin);
    const float m_scale = t.exp_avg_scale_in[block], u_scale = t.exp_avg_sq_scale_in[block];
    uint32_t m_max = 0, u_max = 0;
    for (size_t j = 0; j < n; ++j) {
      const size_t i = begin + j;
      float p = t.params_in[i];
      float g = load<G>(t.grads, i) * f.grad_multiplier;
      float m = decode_exp_avg(m_codes_in[i], m_scale);
      const float u_old = decode_exp_avg_sq_root(v_codes_in[i], u_scale);
      float v = u_old * u_old;
      if (f.l2_decay) g = std::fma(f.weight_decay, p, g);
      m = std::fma(f.one_minus_beta1, g - m, m);
      v = std::fma(f.one_minus_beta2 * g, g, v * f.beta2);
      const float u = std::sqrt(v);
      const float denom = std::fma(u, f.inv_bias_correction2_sqrt, f.eps);
      if (f.decoupled_decay) p = p * f.decay_factor;
      p = std::fma(f.neg_step_size, m / denom, p);
      t.params[i] = p;
      store_copy<C>(t.param_copy, i, p);
      m_new[j] = m;
      u_new[j] = u;
      m_max = std::max(m_max, abs_bits(m));
      u_max = std::max(u_max, abs_bits(u));
    }
    const float m_scale_new = std::bit_cast<float>(m_max), u_scale_new = std::bit_cast<float>(u_max);
    const float m_inv = inverse_scale(m_scale_new), u_inv = inverse_scale(u_scale_new);
    for (size_t j = 0; j < n; ++j) {
      m_codes[begin + j] = encode_exp_avg(m_new[j], m_inv);
      v_codes[begin + j] = encode_exp_avg_sq_root(u_new[j], u_inv);
    }
    t.exp_avg_scale[block] = m_scale_new;
    t.exp_avg_sq_scale[block] = u_scale_new;
  }
}

// The conversion probe for 8-bit moments: decode with the block's scale,
// one add, encode with the same scale; scales read and written back.
template <DType G, CopyType C>
void probe_int8(const StepFactors&, const TileSpans& t) {
  auto* m_codes = static_cast<uint8_t*>(t.exp_avg);
  auto* v_codes = static_cast<uint8_t*>(t.exp_avg_sq);
  const auto* m_codes_in = static_cast<const uint8_t*>(t.exp_avg_in);
  const auto* v_codes_in = static_cast<const uint8_t*>(t.exp_avg_sq_in);
  for (size_t begin = 0, block = 0; begin < t.count; begin += t.block_elements, ++block) {
    const size_t n = std::min(t.block_elements, t.count - begin);
    const float m_scale = t.exp_avg_scale_in[block], u_scale = t.exp_avg_sq_scale_in[block];
    const float m_inv = inverse_scale(m_scale), u_inv = inverse_scale(u_scale);
    for (size_t i = begin; i < begin + n; ++i) {
      const float g = load<G>(t.grads, i);
      const float p = t.params_in[i] + g;
      t.params[i] = p;
      m_codes[i] = encode_exp_avg(decode_exp_avg(m_codes_in[i], m_scale) + g, m_inv);
      v_codes[i] = encode_exp_avg_sq_root(decode_exp_avg_sq_root(v_codes_in[i], u_scale) + g, u_inv);
      store_copy<C>(t.param_copy, i, p);
    }
    t.exp_avg_scale[block] = m_scale;
    t.exp_avg_sq_scale[block] = u_scale;
  }
}

// The streaming probe for 8-bit moments: codes and scales read and written back.
template <DType G, CopyType C>
void stream_int8(const StepFactors&, const TileSpans& t) {
  volatile uint32_t* params = reinterpret_cast<uint32_t*>(t.params);
  const volatile uint32_t* params_in = reinterpret_cast<const uint32_t*>(t.params_in);
  using GT = std::conditional_t<G == DType::kF32, uint32_t, uint16_t>;
  const volatile GT* grads = static_cast<const GT*>(t.grads);
  for (size_t begin = 0, block = 0; begin < t.count; begin += t.block_elements, ++block) {
    const size_t end = std::min(t.count, begin + t.block_elements);
    for (size_t i = begin; i < end; ++i) {
      const uint32_t p = params_in[i];
      static_cast<void>(grads[i]);
      stream_element<uint8_t>(t.exp_avg_in, t.exp_avg, i);
      stream_element<uint8_t>(t.exp_avg_sq_in, t.exp_avg_sq, i);
      params[i] = p;
      if constexpr (C != CopyType::kNone) static_cast<volatile uint16_t*>(t.param_copy)[i] = static_cast<uint16_t>(p);
    }
    stream_element<uint32_t>(t.exp_avg_scale_in, t.exp_avg_scale, block);
    stream_element<uint32_t>(t.exp_avg_sq_scale_in, t.exp_avg_sq_scale, block);
  }
}

// The conversion probe: the same loads and stores as the update through the
// dtype conversions, one add each.
template <DType G, DType M, CopyType C>
void probe(const StepFactors& f, const TileSpans& t) {
  for (size_t i = 0; i < t.count; ++i) {
    const float g = load<G>(t.grads, i);
    const float p = t.params_in[i] + g;
    t.params[i] = p;
    if (uses_exp_avg(f.kind)) store<M>(t.exp_avg, i, load<M>(t.exp_avg_in, i) + g);
    if (uses_exp_avg_sq(f.kind)) store<M>(t.exp_avg_sq, i, load<M>(t.exp_avg_sq_in, i) + g);
    store_copy<C>(t.param_copy, i, p);
  }
}

// The streaming probe (Note [Streaming probe], x86/kernel_body.h): every
// byte the update reads is read and every byte it writes is written, through
// volatile accesses so none is dropped; the state is written back unchanged
// and the copy receives the low 16 bits of each param's bit pattern.
template <DType G, DType M, CopyType C>
void stream(const StepFactors& f, const TileSpans& t) {
  using MT = std::conditional_t<M == DType::kF32, uint32_t, uint16_t>;
  using GT = std::conditional_t<G == DType::kF32, uint32_t, uint16_t>;
  volatile uint32_t* params = reinterpret_cast<uint32_t*>(t.params);
  const volatile uint32_t* params_in = reinterpret_cast<const uint32_t*>(t.params_in);
  const volatile GT* grads = static_cast<const GT*>(t.grads);
  for (size_t i = 0; i < t.count; ++i) {
    const uint32_t p = params_in[i];
    static_cast<void>(grads[i]);
    if (uses_exp_avg(f.kind)) stream_element<MT>(t.exp_avg_in, t.exp_avg, i);
    if (uses_exp_avg_sq(f.kind)) stream_element<MT>(t.exp_avg_sq_in, t.exp_avg_sq, i);
    params[i] = p;
    if constexpr (C != CopyType::kNone) static_cast<volatile uint16_t*>(t.param_copy)[i] = static_cast<uint16_t>(p);
  }
}

enum class Pass : uint8_t { kUpdate, kProbe, kStream };

template <DType G, CopyType C>
void update_or_probe_int8(Pass pass, const StepFactors& f, const TileSpans& t) {
  if (pass == Pass::kProbe) return probe_int8<G, C>(f, t);
  if (pass == Pass::kStream) return stream_int8<G, C>(f, t);
  adam_update_int8<G, C>(f, t);  // validate_state admits only Adam/AdamW
}

template <DType G, DType M, CopyType C>
void update_or_probe(Pass pass, const StepFactors& f, const TileSpans& t) {
  if (pass == Pass::kProbe) return probe<G, M, C>(f, t);
  if (pass == Pass::kStream) return stream<G, M, C>(f, t);
  switch (f.kind) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: return adam_update<G, M, C>(f, t);
    case OptimizerKind::kAdagrad: return adagrad_update<G, M, C>(f, t);
    case OptimizerKind::kLion: return lion_update<G, M, C>(f, t);
  }
}

// Runtime dtypes -> one instantiation, once per tile.
template <DType G, DType M>
void by_copy(Pass pass, const StepFactors& f, const TileSpans& t) {
  if (t.block_elements != 0) {
    switch (t.copy_type) {
      case CopyType::kNone: return update_or_probe_int8<G, CopyType::kNone>(pass, f, t);
      case CopyType::kBF16: return update_or_probe_int8<G, CopyType::kBF16>(pass, f, t);
      case CopyType::kF16: return update_or_probe_int8<G, CopyType::kF16>(pass, f, t);
    }
  }
  switch (t.copy_type) {
    case CopyType::kNone: return update_or_probe<G, M, CopyType::kNone>(pass, f, t);
    case CopyType::kBF16: return update_or_probe<G, M, CopyType::kBF16>(pass, f, t);
    case CopyType::kF16: return update_or_probe<G, M, CopyType::kF16>(pass, f, t);
  }
}
template <DType G>
void by_moment(Pass pass, const StepFactors& f, const TileSpans& t) {
  if (t.moment_dtype == DType::kBF16) return by_copy<G, DType::kBF16>(pass, f, t);
  return by_copy<G, DType::kF32>(pass, f, t);
}
void dispatch(Pass pass, const StepFactors& f, const TileSpans& t) {
  switch (t.grad_dtype) {
    case DType::kF32: return by_moment<DType::kF32>(pass, f, t);
    case DType::kBF16: return by_moment<DType::kBF16>(pass, f, t);
    case DType::kF16: return by_moment<DType::kF16>(pass, f, t);
    case DType::kF64:
    case DType::kI64: break;  // rejected by validate_state
  }
}

void scalar_update(const StepFactors& f, const TileSpans& t) { dispatch(Pass::kUpdate, f, t); }
void scalar_probe(const StepFactors& f, const TileSpans& t) { dispatch(Pass::kProbe, f, t); }
void scalar_stream(const StepFactors& f, const TileSpans& t) { dispatch(Pass::kStream, f, t); }

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
  static const KernelTable table{&scalar_update, &scalar_probe, &scalar_stream, &scalar_sum_squares};
  return table;
}

}  // namespace strata::cpu_adam::detail
