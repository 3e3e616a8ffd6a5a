// The tiled reduction kernel against a plain per-element loop, elementwise,
// with values that are not exact (so accumulation order and rounding show).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "reduce_kernels.h"

namespace strata::comm::detail {
namespace {

float load(DType t, const std::vector<uint32_t>& raw, size_t i) {
  switch (t) {
    case DType::kF32: return std::bit_cast<float>(raw[i]);
    case DType::kBF16: return bf16_bits_to_fp32(static_cast<uint16_t>(raw[i]));
    case DType::kF16: return fp16_bits_to_fp32(static_cast<uint16_t>(raw[i]));
  }
  return 0;
}

uint32_t round_to(DType t, float v) {
  switch (t) {
    case DType::kF32: return std::bit_cast<uint32_t>(v);
    case DType::kBF16: return fp32_to_bf16_bits(v);
    case DType::kF16: return fp32_to_fp16_bits(v);
  }
  return 0;
}

TEST(ReduceKernels, MatchScalarReferenceElementwise) {
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (int n : {1, 2, 5, 8}) {
        const size_t count = 3000;  // several tiles plus a remainder
        std::vector<std::vector<uint32_t>> raw(static_cast<size_t>(n), std::vector<uint32_t>(count));
        std::vector<std::vector<unsigned char>> packed(static_cast<size_t>(n),
                                                       std::vector<unsigned char>(count * dtype_size(t)));
        std::vector<const void*> inputs;
        for (int p = 0; p < n; ++p) {
          for (size_t i = 0; i < count; ++i) {
            float v = dist(rng);
            if (i == 77) v = NAN;  // NaN propagates for every op
            const uint32_t bits = round_to(t, v);
            raw[static_cast<size_t>(p)][i] = bits;
            if (t == DType::kF32) {
              reinterpret_cast<uint32_t*>(packed[static_cast<size_t>(p)].data())[i] = bits;
            } else {
              reinterpret_cast<uint16_t*>(packed[static_cast<size_t>(p)].data())[i] = static_cast<uint16_t>(bits);
            }
          }
          inputs.push_back(packed[static_cast<size_t>(p)].data());
        }
        std::vector<unsigned char> out(count * dtype_size(t));
        reduce_elements(t, op, inputs.data(), n, count, out.data(), n);
        for (size_t i = 0; i < count; ++i) {
          float acc = load(t, raw[0], i);
          for (int p = 1; p < n; ++p) {
            const float v = load(t, raw[static_cast<size_t>(p)], i);
            if (op == ReduceOp::kMax) {
              if (std::isnan(acc) || std::isnan(v)) {
                acc = NAN;
              } else {
                acc = v > acc ? v : acc;
              }
            } else {
              acc += v;
            }
          }
          if (op == ReduceOp::kAvg) acc /= static_cast<float>(n);
          const uint32_t want = round_to(t, acc);
          const uint32_t got = t == DType::kF32 ? reinterpret_cast<const uint32_t*>(out.data())[i]
                                                : reinterpret_cast<const uint16_t*>(out.data())[i];
          if (std::isnan(acc)) {
            ASSERT_TRUE(std::isnan(load(t, std::vector<uint32_t>{got}, 0))) << dtype_name(t) << " i=" << i;
          } else {
            ASSERT_EQ(got, want) << dtype_name(t) << " " << reduce_op_name(op) << " n=" << n << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(ReduceKernels, RankListsAreCompressed) {
  EXPECT_EQ(format_rank_list({2}), "2");
  EXPECT_EQ(format_rank_list({1, 3}), "1, 3");
  EXPECT_EQ(format_rank_list({0, 1, 2, 3, 6}), "0-3, 6");
  EXPECT_EQ(format_rank_list({4, 5}), "4, 5");
}

}  // namespace
}  // namespace strata::comm::detail
