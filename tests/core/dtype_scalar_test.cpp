#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "strata/core/dtype.h"

namespace strata {
namespace {

TEST(DTypeScalar, Bf16RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16_bits(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(fp32_to_bf16_bits(1.00390625f), 0x3f80);
  // 1.0078125 + 2^-8 is halfway, rounds up to the even 1.015625.
  EXPECT_EQ(fp32_to_bf16_bits(1.01171875f), 0x3f82);
  EXPECT_EQ(fp32_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_bits_to_fp32(fp32_to_bf16_bits(std::nanf("")))));
  EXPECT_EQ(fp32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to Inf
}

TEST(DTypeScalar, Fp16KnownValues) {
  EXPECT_EQ(fp32_to_fp16_bits(1.0f), 0x3c00);
  EXPECT_EQ(fp32_to_fp16_bits(-2.0f), 0xc000);
  EXPECT_EQ(fp32_to_fp16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(fp32_to_fp16_bits(65520.0f), 0x7c00);  // halfway to 65536 rounds to even: Inf
  EXPECT_EQ(fp32_to_fp16_bits(5.9604644775390625e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(fp32_to_fp16_bits(2.98023223876953125e-8f), 0x0000);  // half of it ties to 0
  EXPECT_EQ(fp32_to_fp16_bits(6.103515625e-05f), 0x0400);        // smallest normal
  EXPECT_EQ(fp16_bits_to_fp32(0x0001), 5.9604644775390625e-8f);
  EXPECT_EQ(fp16_bits_to_fp32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(fp16_bits_to_fp32(0x7e00)));
  EXPECT_EQ(fp32_to_fp16_bits(-0.0f), 0x8000);
}

TEST(DTypeScalar, Fp16RoundTripsEveryHalfValue) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float f = fp16_bits_to_fp32(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_bits_to_fp32(fp32_to_fp16_bits(f)))) << bits;
      continue;
    }
    EXPECT_EQ(fp32_to_fp16_bits(f), h) << "bits 0x" << std::hex << bits;
  }
}

TEST(DTypeScalar, ParseDType) {
  EXPECT_EQ(*parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(*parse_dtype("half"), DType::kF16);
  EXPECT_FALSE(parse_dtype("fp8").ok());
}

}  // namespace
}  // namespace strata
