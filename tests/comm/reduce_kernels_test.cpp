// The tiled reduction kernel against a plain per-element loop, elementwise,
// with values that are not exact (so accumulation order and rounding show).
#include <gtest/gtest.h>

#include <algorithm>
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
    case DType::kF64:
    case DType::kI64: break;  // covered by the 64-bit test below
  }
  return 0;
}

uint32_t round_to(DType t, float v) {
  switch (t) {
    case DType::kF32: return std::bit_cast<uint32_t>(v);
    case DType::kBF16: return fp32_to_bf16_bits(v);
    case DType::kF16: return fp32_to_fp16_bits(v);
    case DType::kF64:
    case DType::kI64: break;
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

// fp64 and int64 accumulate in their own type in rank order: bit for bit
// the sequential loop, also in place (out = input 0), int64 wrapping.
TEST(ReduceKernels, WideTypesMatchRankOrderLoopBitForBit) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int n : {1, 2, 3, 4, 7}) {
    const size_t count = 1500;  // several 512-element tiles plus a remainder
    std::vector<std::vector<double>> d(static_cast<size_t>(n), std::vector<double>(count));
    std::vector<std::vector<int64_t>> q(static_cast<size_t>(n), std::vector<int64_t>(count));
    for (auto& v : d) for (double& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
    for (auto& v : q) for (int64_t& x : v) x = static_cast<int64_t>(rng());  // sums overflow: wrap
    d[0][5] = NAN;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      std::vector<const void*> in_d;
      for (auto& v : d) in_d.push_back(v.data());
      std::vector<double> out_d(count);
      reduce_elements(DType::kF64, op, in_d.data(), n, count, out_d.data(), n);
      for (size_t i = 0; i < count; ++i) {
        double acc = d[0][i];
        for (int p = 1; p < n; ++p) {
          const double v = d[static_cast<size_t>(p)][i];
          acc = op == ReduceOp::kMax ? ((v > acc || std::isnan(v)) && !std::isnan(acc) ? v : acc) : acc + v;
        }
        if (op == ReduceOp::kAvg) acc /= n;
        if (std::isnan(acc)) {
          ASSERT_TRUE(std::isnan(out_d[i])) << "i=" << i;
        } else {
          ASSERT_EQ(std::bit_cast<uint64_t>(out_d[i]), std::bit_cast<uint64_t>(acc))
              << reduce_op_name(op) << " n=" << n << " i=" << i;
        }
      }
      if (op == ReduceOp::kAvg) continue;
      std::vector<int64_t> first = q[0];  // in place: out is input 0
      std::vector<const void*> in_q;
      for (auto& v : q) in_q.push_back(v.data());
      in_q[0] = first.data();
      reduce_elements(DType::kI64, op, in_q.data(), n, count, first.data(), n);
      for (size_t i = 0; i < count; ++i) {
        uint64_t sum = static_cast<uint64_t>(q[0][i]);
        int64_t mx = q[0][i];
        for (int p = 1; p < n; ++p) {
          sum += static_cast<uint64_t>(q[static_cast<size_t>(p)][i]);
          mx = std::max(mx, q[static_cast<size_t>(p)][i]);
        }
        ASSERT_EQ(first[i], op == ReduceOp::kMax ? mx : static_cast<int64_t>(sum)) << "n=" << n << " i=" << i;
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
