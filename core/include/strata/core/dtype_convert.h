#pragma once
// Bulk dtype conversion of arrays: fp32 <-> bf16, fp32 <-> fp16. Any length,
// any (element-aligned) start. Bit-for-bit identical to the scalar
// reference in dtype.h on every path: round to nearest even, NaN stays NaN
// (quieted when narrowing), Inf stays Inf, subnormals handled exactly.
//
// Paths are chosen at run time by cpuid: AVX-512 with BF16 > AVX-512 >
// AVX2+F16C > scalar. force_convert_path() (or the environment variable
// STRATA_CONVERT_PATH=scalar|avx2|avx512|avx512bf16) pins one, for tests,
// benchmarks and `strata report`.

#include <cstddef>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata {

enum class ConvertPath : uint8_t { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16 };

std::string_view convert_path_name(ConvertPath path);  // "auto", "scalar", "avx2", ...
Result<ConvertPath> parse_convert_path(std::string_view name);
// Compiled in and supported by this CPU (kAuto and kScalar always are).
bool convert_path_available(ConvertPath path);
std::vector<ConvertPath> available_convert_paths();  // scalar first, best last
// The path the convert_* functions use now (never kAuto).
ConvertPath active_convert_path();
// kAuto returns to the cpuid choice; an unavailable path is Unsupported.
Status force_convert_path(ConvertPath path);

// Convert `count` elements with the active path.
void convert_fp32_to_bf16(const float* src, bfloat16* dst, size_t count);
void convert_bf16_to_fp32(const bfloat16* src, float* dst, size_t count);
void convert_fp32_to_fp16(const float* src, float16* dst, size_t count);
void convert_fp16_to_fp32(const float16* src, float* dst, size_t count);

// Any supported pair (fp32<->bf16, fp32<->fp16, and same-type copies) on
// an explicit path (kAuto = active). InvalidArgument for bf16<->fp16,
// Unsupported for an unavailable path.
Status convert(const void* src, DType src_type, void* dst, DType dst_type, size_t count,
               ConvertPath path = ConvertPath::kAuto);

}  // namespace strata
