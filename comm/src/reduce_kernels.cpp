#include "reduce_kernels.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

namespace strata::comm::detail {
namespace {

constexpr size_t kTile = 1024;

inline void load_tile(DType dtype, const void* src, size_t begin, size_t n, float* dst) {
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, static_cast<const float*>(src) + begin, n * sizeof(float)); break;
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src) + begin;
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_fp32(s[i]);
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src) + begin;
      for (size_t i = 0; i < n; ++i) dst[i] = fp16_bits_to_fp32(s[i]);
      break;
    }
  }
}

inline void store_tile(DType dtype, const float* src, void* dst, size_t begin, size_t n) {
  switch (dtype) {
    case DType::kF32: std::memcpy(static_cast<float*>(dst) + begin, src, n * sizeof(float)); break;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst) + begin;
      for (size_t i = 0; i < n; ++i) d[i] = fp32_to_bf16_bits(src[i]);
      break;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst) + begin;
      for (size_t i = 0; i < n; ++i) d[i] = fp32_to_fp16_bits(src[i]);
      break;
    }
  }
}

inline void accumulate_sum(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

inline void accumulate_sum_f32(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += x[i];
}

// max with NaN propagation: a NaN in any input makes the result NaN.
inline void accumulate_max(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float a = acc[i];
    const float b = x[i];
    acc[i] = (b > a || std::isnan(b)) && !std::isnan(a) ? b : a;
  }
}

}  // namespace

void reduce_elements(DType dtype, ReduceOp op, const void* const* inputs, int n, size_t count, void* out,
                     int divisor) {
  alignas(64) float acc[kTile];
  alignas(64) float tmp[kTile];
  for (size_t begin = 0; begin < count; begin += kTile) {
    const size_t len = count - begin < kTile ? count - begin : kTile;
    load_tile(dtype, inputs[0], begin, len, acc);
    for (int p = 1; p < n; ++p) {
      if (dtype == DType::kF32 && op != ReduceOp::kMax) {
        accumulate_sum_f32(acc, static_cast<const float*>(inputs[p]) + begin, len);
        continue;
      }
      load_tile(dtype, inputs[p], begin, len, tmp);
      if (op == ReduceOp::kMax) {
        accumulate_max(acc, tmp, len);
      } else {
        accumulate_sum(acc, tmp, len);
      }
    }
    if (op == ReduceOp::kAvg) {
      const auto d = static_cast<float>(divisor);
      for (size_t i = 0; i < len; ++i) acc[i] /= d;
    }
    store_tile(dtype, acc, out, begin, len);
  }
}

void to_fp32(DType dtype, const void* src, float* dst, size_t count) {
  for (size_t begin = 0; begin < count; begin += kTile) {
    const size_t len = count - begin < kTile ? count - begin : kTile;
    load_tile(dtype, src, begin, len, dst + begin);
  }
}

void from_fp32(DType dtype, const float* src, void* dst, size_t count) {
  for (size_t begin = 0; begin < count; begin += kTile) {
    const size_t len = count - begin < kTile ? count - begin : kTile;
    store_tile(dtype, src + begin, dst, begin, len);
  }
}

std::string format_rank_list(const std::vector<int>& ranks) {
  std::string out;
  size_t i = 0;
  while (i < ranks.size()) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j > i + 1 ? fmt::format("{}-{}", ranks[i], ranks[j])
                     : (j == i + 1 ? fmt::format("{}, {}", ranks[i], ranks[j]) : fmt::format("{}", ranks[i]));
    i = j + 1;
  }
  return out;
}

}  // namespace strata::comm::detail
