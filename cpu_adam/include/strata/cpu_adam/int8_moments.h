#pragma once
// Block-wise 8-bit optimizer moments: one 8-bit code per element and one
// fp32 scale per block of `block_elements` elements (Note [Block-wise 8-bit
// moments] in cpu_adam/src/int8_moments.cpp, docs/cpu_adam.md). The step
// reads and writes them directly (StateSpans::moment_format); the functions
// here convert whole spans between fp32 moments and the 8-bit form (loading
// an fp32 checkpoint into an int8 run and back).
//
// Exact: codes -> fp32 -> codes gives the same codes and scales (for codes
// as the step and quantize_moments write them: every block holds its
// maximum as the code of 1.0).
// Rounded: fp32 -> codes -> fp32 (relative error <= 2^-4 for exp_avg and
// <= 2^-5 on sqrt(exp_avg_sq) for values >= 2^-14 of their block's
// largest; smaller values are rounded to a multiple of 2^-17 (exp_avg) or
// 2^-18 (sqrt(exp_avg_sq)) of it).

#include <cstddef>
#include <cstdint>

#include "strata/core/status.h"

namespace strata::cpu_adam {

// How a step stores both moments.
enum class MomentFormat : uint8_t {
  kDType = 0,  // one StateSpans::moment_dtype value (fp32 or bf16) per element
  kBlockInt8,  // one 8-bit code per element + one fp32 scale per block
};

// Elements per scale, chosen by measurement (docs/cpu_adam.md).
inline constexpr size_t kDefaultMomentBlockElements = 256;
// The largest block: the step keeps one block of both moments in fp32 on the stack.
inline constexpr size_t kMaxMomentBlockElements = 4096;

// Which moment a code encodes: the first moment is signed (sign + 7-bit
// E4M3 magnitude of m / scale); the second is stored as its square root,
// unsigned (8-bit E4M4 of sqrt(v) / scale).
enum class Int8Moment : uint8_t { kExpAvg = 0, kExpAvgSq };

// Scales per span: ceil(count / block_elements).
constexpr size_t moment_block_count(size_t count, size_t block_elements) {
  return block_elements == 0 ? 0 : (count + block_elements - 1) / block_elements;
}

// block_elements must be a multiple of 64 in [64, kMaxMomentBlockElements];
// `field` names it in the error.
Status validate_moment_block_elements(size_t block_elements, const char* field);

// fp32 moments -> codes + scales. For kExpAvgSq the values are v >= 0 (a
// negative or NaN v is an InvalidArgument naming its index).
Status quantize_moments(Int8Moment which, const float* values, size_t count, size_t block_elements,
                        uint8_t* codes, float* scales);
// codes + scales -> fp32 moments (v = (decoded sqrt)^2 for kExpAvgSq).
Status dequantize_moments(Int8Moment which, const uint8_t* codes, const float* scales, size_t count,
                          size_t block_elements, float* values);

// The per-element format, exposed for tests and device kernels that must
// give the same bits. `normalized` is |x| / scale (in [0, 1]).
uint8_t encode_magnitude(Int8Moment which, float normalized);
float decode_magnitude(Int8Moment which, uint8_t magnitude_code);

}  // namespace strata::cpu_adam
