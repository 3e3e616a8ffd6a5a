#include "reduce_kernels.h"

#include <cmath>
#include <cstring>
#include <type_traits>

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
    case DType::kF64:
    case DType::kI64: STRATA_CHECK(false, "64-bit types take reduce_wide"); break;
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
    case DType::kF64:
    case DType::kI64: STRATA_CHECK(false, "64-bit types take reduce_wide"); break;
  }
}

// fp64 and int64: accumulate in the element type, rank order 0..n-1 (a tile
// of every input is read before the tile of `out` is written, so `out` may
// be one of the inputs). int64 sums wrap modulo 2^64 (unsigned arithmetic,
// no undefined overflow).
template <typename T>
void reduce_wide(ReduceOp op, const void* const* inputs, int n, size_t count, void* out, int divisor) {
  alignas(64) T acc[kTile / 2];
  constexpr size_t kWideTile = kTile / 2;
  for (size_t begin = 0; begin < count; begin += kWideTile) {
    const size_t len = count - begin < kWideTile ? count - begin : kWideTile;
    std::memcpy(acc, static_cast<const T*>(inputs[0]) + begin, len * sizeof(T));
    for (int p = 1; p < n; ++p) {
      const T* x = static_cast<const T*>(inputs[p]) + begin;
      if (op == ReduceOp::kMax) {
        for (size_t i = 0; i < len; ++i) {
          if constexpr (std::is_floating_point_v<T>) {
            acc[i] = (x[i] > acc[i] || std::isnan(x[i])) && !std::isnan(acc[i]) ? x[i] : acc[i];
          } else {
            acc[i] = x[i] > acc[i] ? x[i] : acc[i];
          }
        }
      } else if constexpr (std::is_floating_point_v<T>) {
        for (size_t i = 0; i < len; ++i) acc[i] += x[i];
      } else {
        for (size_t i = 0; i < len; ++i) {
          acc[i] = static_cast<T>(static_cast<uint64_t>(acc[i]) + static_cast<uint64_t>(x[i]));
        }
      }
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (op == ReduceOp::kAvg) {
        const auto d = static_cast<T>(divisor);
        for (size_t i = 0; i < len; ++i) acc[i] /= d;
      }
    }
    std::memcpy(static_cast<T*>(out) + begin, acc, len * sizeof(T));
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
  if (dtype == DType::kF64) return reduce_wide<double>(op, inputs, n, count, out, divisor);
  if (dtype == DType::kI64) {
    STRATA_CHECK(op != ReduceOp::kAvg, "avg of int64 is rejected at issue");
    return reduce_wide<int64_t>(op, inputs, n, count, out, divisor);
  }
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
