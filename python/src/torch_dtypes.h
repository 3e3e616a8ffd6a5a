#pragma once
// torch's dtype names (what the Python layer passes: str(tensor.dtype)
// without "torch.") and Strata's state dtypes, both ways.
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "strata/core/dtype.h"
#include "strata/core/printable.h"
#include "strata/core/status.h"

namespace strata::python {

// float32, bfloat16 or float16; anything else is an error naming `what`.
inline Result<DType> dtype_from_torch_name(const std::string& name, std::string_view what) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  return InvalidArgument(
      fmt::format("{}: dtype '{}' is not float32, bfloat16 or float16", what, printable(name, 32)));
}

inline std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: return std::string(dtype_name(dtype));
  }
}

}  // namespace strata::python
