// Block-wise 8-bit moments: the span conversions (checkpoint load/save) and
// the format's definition.
//
// Note [Block-wise 8-bit moments]
// Each moment span is cut into blocks of B = block_elements elements (the
// same cut in every tile: tile_elements is a multiple of B). Per block one
// fp32 scale, per element one byte:
//   exp_avg (m):     scale = max |m| over the block; code = sign(m) << 7 |
//                    E4M3(|m| * (1 / scale))
//   exp_avg_sq (v):  stored as u = sqrt(v) (>= 0); scale = max u;
//                    code = E4M4(u * (1 / scale)), all 8 bits unsigned
// E4Mk is a 4-bit-exponent mini-float over [0, 1] (int8_format.h): for a
// magnitude code q, value 2^((q >> k) - 15) * (1 + (q mod 2^k) / 2^k) when
// q >= 2^k, else q * 2^(-14 - k); the largest code is 15 << k = 1.0 (codes
// above it are never written). Dynamic range 2^-17 (m) and 2^-18 (sqrt v)
// of the block maximum; relative error <= 2^-(k+1) above 2^-14.
// Encoding, exactly: inv = scale > 0 ? 1 / scale : 0 (one fp32 division per
// block); r = |x| * inv (fp32, rounded to nearest even); with a =
// bits(r * 2^-112) (Note [Codes from fp32's lowest binades], int8_format.h):
//   q = (a + 2^(22-k)) >> (23 - k)   (round to nearest, a midpoint to the
//   larger code; r below 2^-14 is first rounded to a multiple of 2^-37 by
//   the multiply), then q = min(q, 15 << k).
// The block maximum is an unsigned max of the bit patterns with the sign
// cleared (exact, independent of order and lane count). Decoding:
// m = (decoded magnitude with the code's sign) * scale; u = decoded * scale,
// v = u * u. Each is one correctly rounded fp32 operation, so the scalar
// reference and every SIMD path give identical codes and scales.
// Why sqrt(v): it halves v's dynamic range in bits, so an element whose m is
// still representable does not see its v flushed to zero (which would turn
// m / (sqrt(v) + eps) into m / eps); and the step computes sqrt(v) anyway.
// Why 4 exponent bits: m and sqrt(v) within a block span a few decades;
// values below 2^-17 of the block maximum contribute < 2^-17 of the largest
// update in the block.
#include "strata/cpu_adam/int8_moments.h"

#include <cmath>

#include <fmt/format.h>

#include "float_environment.h"
#include "int8_format.h"

namespace strata::cpu_adam {

using detail::abs_bits;
using detail::inverse_scale;

Status validate_moment_block_elements(size_t block_elements, const char* field) {
  if (block_elements >= 64 && block_elements <= kMaxMomentBlockElements && block_elements % 64 == 0)
    return Status::Ok();
  return InvalidArgument(fmt::format("{} = {} must be a multiple of 64 from 64 to {}, e.g. {}", field,
                                     block_elements, kMaxMomentBlockElements, kDefaultMomentBlockElements));
}

Status quantize_moments(Int8Moment which, const float* values, size_t count, size_t block_elements,
                        uint8_t* codes, float* scales) {
  STRATA_RETURN_IF_ERROR(validate_moment_block_elements(block_elements, "quantize_moments: block_elements"));
  if (count == 0) return Status::Ok();
  if (values == nullptr || codes == nullptr || scales == nullptr) {
    return InvalidArgument(fmt::format("quantize_moments: {} is null for {} elements",
                                       values == nullptr ? "values" : codes == nullptr ? "codes" : "scales", count));
  }
  const bool sq = which == Int8Moment::kExpAvgSq;
  const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
  for (size_t begin = 0; begin < count; begin += block_elements) {
    const size_t end = std::min(count, begin + block_elements);
    uint32_t max_bits = 0;
    for (size_t i = begin; i < end; ++i) {
      const float x = values[i];
      if (sq && !(x >= 0.0f)) {
        return InvalidArgument(fmt::format("quantize_moments: exp_avg_sq[{}] = {} is not a non-negative number",
                                           i, x));
      }
      const uint32_t b = abs_bits(sq ? std::sqrt(x) : x);
      max_bits = b > max_bits ? b : max_bits;
    }
    const float scale = std::bit_cast<float>(max_bits);
    const float inv = inverse_scale(scale);
    scales[begin / block_elements] = scale;
    for (size_t i = begin; i < end; ++i) {
      codes[i] = sq ? detail::encode_exp_avg_sq_root(std::sqrt(values[i]), inv)
                    : detail::encode_exp_avg(values[i], inv);
    }
  }
  return Status::Ok();
}

Status dequantize_moments(Int8Moment which, const uint8_t* codes, const float* scales, size_t count,
                          size_t block_elements, float* values) {
  STRATA_RETURN_IF_ERROR(validate_moment_block_elements(block_elements, "dequantize_moments: block_elements"));
  if (count == 0) return Status::Ok();
  if (values == nullptr || codes == nullptr || scales == nullptr) {
    return InvalidArgument(fmt::format("dequantize_moments: {} is null for {} elements",
                                       values == nullptr ? "values" : codes == nullptr ? "codes" : "scales", count));
  }
  const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
  for (size_t i = 0; i < count; ++i) {
    const float scale = scales[i / block_elements];
    if (which == Int8Moment::kExpAvg) {
      values[i] = detail::decode_exp_avg(codes[i], scale);
    } else {
      const float u = detail::decode_exp_avg_sq_root(codes[i], scale);
      values[i] = u * u;
    }
  }
  return Status::Ok();
}

uint8_t encode_magnitude(Int8Moment which, float normalized) {
  const detail::SubnormalsKept subnormals;  // Note [Subnormals kept]
  return static_cast<uint8_t>(which == Int8Moment::kExpAvg ? detail::ExpAvgCode::encode(normalized)
                                                           : detail::ExpAvgSqCode::encode(normalized));
}

float decode_magnitude(Int8Moment which, uint8_t magnitude_code) {
  return which == Int8Moment::kExpAvg ? detail::ExpAvgCode::decode(magnitude_code & 0x7fu)
                                      : detail::ExpAvgSqCode::decode(magnitude_code);
}

}  // namespace strata::cpu_adam
