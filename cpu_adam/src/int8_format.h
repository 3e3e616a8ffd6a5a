#pragma once
// Private: the scalar definition of the 8-bit moment code (Note [Block-wise
// 8-bit moments], int8_moments.cpp). The scalar reference and the span
// helpers call these; the SIMD paths (x86/kernel_body.h) perform the same
// integer and float operations lane by lane.
#include <bit>
#include <cstdint>

namespace strata::cpu_adam::detail {

// A magnitude code with `kMantissa` mantissa bits and 4 exponent bits:
//   q >= 2^M:  2^((q >> M) - 15) * (1 + (q & (2^M - 1)) / 2^M)    (normal)
//   q <  2^M:  q * 2^(-14 - M)                                     (subnormal)
// The largest code used is 15 << M, the value 1.0.
template <int kMantissa>
struct MiniFloat {
  static constexpr int M = kMantissa;
  static constexpr uint32_t kMaxCode = 15u << M;                       // 1.0
  static constexpr uint32_t kRebias = 112u << M;                        // (127 - 15) << M
  static constexpr uint32_t kRoundHalf = 1u << (22 - M);               // half a code step, in the bits
  static constexpr float kSubnormalUnit = 1.0f / static_cast<float>(1u << (14 + M));  // 2^(-14-M)
  static constexpr float kDownscale = 0x1p-112f;                        // 2^(15 - 127)

  // Note [Codes from fp32's lowest binades]
  // r * 2^-112 moves the code's range onto fp32's lowest binades: 1.0 to
  // 2^-112 (exponent field 15), the code's smallest normal 2^-14 to fp32's
  // smallest normal 2^-126, and the code's subnormals (multiples of
  // 2^(-14-M)) to fp32 subnormals (multiples of 2^(23-M) in the bits). So
  // the scaled value's bits, rounded to their top M mantissa bits as an
  // integer (a midpoint up: one add), are the code for every r, with no
  // branch between normal and subnormal codes. The multiply is exact for
  // r >= 2^-14; below, it rounds r to a multiple of 2^-37 first (an fp32
  // subnormal result), so such an r within 2^-38 of a midpoint between two
  // codes may round as if it were on the midpoint. It needs subnormal
  // results, not flushed to zero: the kernels run under SubnormalsKept
  // (float_environment.h).
  //
  // |r| (any float bits; the sign is ignored) -> code, round to nearest (a
  // midpoint goes to the larger code), saturating at kMaxCode (only Inf/NaN
  // or r >= 1 + 2^-(M+1) saturate).
  static uint32_t encode(float r) {
    const uint32_t a = std::bit_cast<uint32_t>(r * kDownscale) & 0x7fffffffu;
    const uint32_t q = (a + kRoundHalf) >> (23 - M);
    return q < kMaxCode ? q : kMaxCode;
  }
  static float decode(uint32_t q) {
    if (q >= (1u << M)) return std::bit_cast<float>((q + kRebias) << (23 - M));
    return static_cast<float>(static_cast<int32_t>(q)) * kSubnormalUnit;
  }
};
using ExpAvgCode = MiniFloat<3>;    // sign bit 7 + 7-bit magnitude
using ExpAvgSqCode = MiniFloat<4>;  // 8-bit magnitude of sqrt(v)

// 1 / scale, or 0 for a zero (or NaN) scale so that every code is 0.
inline float inverse_scale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// The block maximum of |x| is taken on the bits with the sign cleared, as
// an unsigned integer max: exact and order-independent (NaN is largest).
inline uint32_t abs_bits(float x) { return std::bit_cast<uint32_t>(x) & 0x7fffffffu; }

inline uint8_t encode_exp_avg(float m, float inv_scale) {
  const uint32_t sign = (std::bit_cast<uint32_t>(m) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | ExpAvgCode::encode(m * inv_scale));
}
inline float decode_exp_avg(uint8_t code, float scale) {
  const float magnitude = ExpAvgCode::decode(code & 0x7fu);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | (static_cast<uint32_t>(code & 0x80u) << 24)) *
         scale;
}
// The code of the second moment holds u = sqrt(v) >= 0.
inline uint8_t encode_exp_avg_sq_root(float u, float inv_scale) {
  return static_cast<uint8_t>(ExpAvgSqCode::encode(u * inv_scale));
}
inline float decode_exp_avg_sq_root(uint8_t code, float scale) { return ExpAvgSqCode::decode(code) * scale; }

}  // namespace strata::cpu_adam::detail
