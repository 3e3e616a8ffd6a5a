#include "strata/core/dtype.h"

#include <string>

#include <fmt/format.h>

namespace strata {

Result<DType> parse_dtype(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "float" || name == "f32") return DType::kF32;
  if (name == "fp16" || name == "float16" || name == "half" || name == "f16") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp64" || name == "float64" || name == "double" || name == "f64") return DType::kF64;
  if (name == "int64" || name == "i64") return DType::kI64;
  return InvalidArgument(fmt::format("unknown dtype '{}' (use fp32, fp16, bf16, fp64 or int64)", name));
}

}  // namespace strata
