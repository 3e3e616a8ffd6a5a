#pragma once
// Element types of training state and their scalar conversions.
// fp64 and int64 are reduction types for collectives (global gradient norms,
// overflow votes, token counts); training state itself is fp32/fp16/bf16
// (is_state_float), and kernels that only handle those reject the others.
// Conversions to 16-bit types round to nearest, ties to even; NaN stays NaN
// (quieted), Inf stays Inf, fp16 subnormals are produced and read exactly.
// These scalar functions are the reference that every SIMD path is
// compared against (see dtype_convert.h for bulk conversion).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3, kI64 = 4 };

// Storage types: raw bit patterns, no arithmetic.
struct float16 { uint16_t bits; };
struct bfloat16 { uint16_t bits; };
static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kF64:
    case DType::kI64: return 8;
  }
  return 0;
}
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF64: return "fp64";
    case DType::kI64: return "int64";
  }
  return "?";
}
// The types parameters, gradients and optimizer state are stored in.
constexpr bool is_state_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }
// Accepts fp32|float32|float|f32, fp16|float16|half|f16, bf16|bfloat16,
// fp64|float64|double|f64, int64|i64.
Result<DType> parse_dtype(std::string_view name);

// fp32 -> bf16, round to nearest even; NaN -> quiet NaN with the same sign.
inline uint16_t fp32_to_bf16_bits(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding_bias) >> 16);
}

inline float bf16_bits_to_fp32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

// fp32 -> fp16, round to nearest even, with subnormals, overflow to Inf.
inline uint16_t fp32_to_fp16_bits(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t out;
  if (x >= 0x47800000u) {  // |value| >= 65536 (or Inf/NaN): all exponent bits set
    out = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {
    // Result is an fp16 subnormal or zero. Adding 0.5 (2^-1) aligns the value
    // so that the FPU's own round-to-nearest-even drops exactly the bits fp16
    // cannot hold; the low mantissa bits are then the fp16 subnormal.
    const float magic = std::bit_cast<float>(0x3f000000u);  // 0.5f
    const float sum = std::bit_cast<float>(x) + magic;
    out = std::bit_cast<uint32_t>(sum) - 0x3f000000u;
  } else {
    const uint32_t mantissa_odd = (x >> 13) & 1u;
    x += 0xc8000fffu;  // rebias exponent (15 - 127) << 23, plus rounding 0xfff
    x += mantissa_odd;
    out = x >> 13;
  }
  return static_cast<uint16_t>(out | sign);
}

inline float fp16_bits_to_fp32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline bfloat16 to_bf16(float v) { return {fp32_to_bf16_bits(v)}; }
inline float16 to_fp16(float v) { return {fp32_to_fp16_bits(v)}; }
inline float to_fp32(bfloat16 v) { return bf16_bits_to_fp32(v.bits); }
inline float to_fp32(float16 v) { return fp16_bits_to_fp32(v.bits); }

}  // namespace strata
