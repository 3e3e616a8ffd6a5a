#include "strata/offload/grad_norm.h"

#include <vector>

#include "strata/core/dtype_convert.h"
#include "strata/core/status.h"

namespace strata::offload {
namespace {

double block_sum(const float* x, size_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const double v = x[i + k];
      lane[k] += v * v;
    }
  for (int k = 0; i < n; ++i, ++k) {
    const double v = x[i];
    lane[k] += v * v;
  }
  double s = 0;
  for (double v : lane) s += v;
  return s;
}

}  // namespace

void block_sums_of_squares(const void* data, DType dtype, size_t count, size_t block, std::span<double> out) {
  STRATA_CHECK(block > 0 && count == out.size() * block, "block_sums_of_squares: count is not blocks x block");
  if (dtype == DType::kF32) {
    const float* x = static_cast<const float*>(data);
    for (size_t b = 0; b < out.size(); ++b) out[b] = block_sum(x + b * block, block);
    return;
  }
  STRATA_CHECK(dtype == DType::kBF16 || dtype == DType::kF16, "block_sums_of_squares: dtype must be fp32/bf16/fp16");
  std::vector<float> wide(block);
  const auto* bytes = static_cast<const std::byte*>(data);
  for (size_t b = 0; b < out.size(); ++b) {
    if (dtype == DType::kBF16)
      convert_bf16_to_fp32(reinterpret_cast<const bfloat16*>(bytes + b * block * 2), wide.data(), block);
    else
      convert_fp16_to_fp32(reinterpret_cast<const float16*>(bytes + b * block * 2), wide.data(), block);
    out[b] = block_sum(wide.data(), block);
  }
}

}  // namespace strata::offload
