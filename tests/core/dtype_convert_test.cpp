// Every available bulk conversion path against the scalar reference of
// dtype.h, bit for bit: all 65,536 16-bit patterns, a large set of fp32
// patterns (every NaN/Inf/subnormal class, rounding ties, a sweep and
// random values), odd lengths and unaligned starts.
#include "strata/core/dtype_convert.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace strata {
namespace {

class ConvertPathTest : public ::testing::TestWithParam<ConvertPath> {
 protected:
  void SetUp() override {
    if (!convert_path_available(GetParam()))
      GTEST_SKIP() << "conversion path " << convert_path_name(GetParam()) << " not supported by this CPU";
  }
  void TearDown() override { force_convert_path(ConvertPath::kAuto).ignore(); }
};

std::vector<uint16_t> all_16bit_patterns() {
  std::vector<uint16_t> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

// fp32 bit patterns covering every class and rounding case.
std::vector<uint32_t> fp32_patterns() {
  std::vector<uint32_t> v;
  const uint32_t mantissas[] = {0x000000, 0x000001, 0x000002, 0x000fff, 0x001000, 0x001001, 0x002000, 0x003000,
                                0x001fff, 0x007fff, 0x008000, 0x008001, 0x018000, 0x010000, 0x00ffff, 0x3fffff,
                                0x400000, 0x400001, 0x7f8000, 0x7fe000, 0x7ff000, 0x7fffff, 0x7fdfff, 0x5a5a5a};
  for (uint32_t sign : {0u, 1u}) {
    for (uint32_t exponent = 0; exponent < 256; ++exponent) {
      for (uint32_t m : mantissas) v.push_back(sign << 31 | exponent << 23 | m);
    }
  }
  // Every fp16 rounding boundary: halfway points between adjacent fp16 values
  // (ties), and one ulp either side, incl. the overflow boundary 65520.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const uint32_t lo = std::bit_cast<uint32_t>(fp16_bits_to_fp32(static_cast<uint16_t>(h)));
    const uint32_t hi = std::bit_cast<uint32_t>(fp16_bits_to_fp32(static_cast<uint16_t>(h + 1)));
    const float mid = (std::bit_cast<float>(lo) + std::bit_cast<float>(hi)) / 2;  // exact in fp32
    const uint32_t m = std::bit_cast<uint32_t>(mid);
    for (uint32_t x : {m - 1, m, m + 1}) {
      v.push_back(x);
      v.push_back(x | 0x80000000u);
    }
  }
  for (uint32_t x : {0x477fefffu, 0x477ff000u, 0x477ff001u, 0x33000000u, 0x33000001u, 0x32ffffffu})
    v.insert(v.end(), {x, x | 0x80000000u});  // fp16 overflow tie 65520 and the smallest-subnormal tie
  for (uint64_t x = 0; x <= 0xffffffffull; x += 4099) v.push_back(static_cast<uint32_t>(x));  // sweep
  std::mt19937 rng(20261130);
  for (int i = 0; i < (1 << 18); ++i) v.push_back(rng());
  return v;
}

std::string hex(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", x);
  return buf;
}

TEST_P(ConvertPathTest, Bf16ToFp32AllPatterns) {
  const auto in = all_16bit_patterns();
  std::vector<float> out(in.size());
  ASSERT_TRUE(convert(in.data(), DType::kBF16, out.data(), DType::kF32, in.size(), GetParam()).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(bf16_bits_to_fp32(in[i])))
        << "bf16 " << hex(in[i]);
  }
}

TEST_P(ConvertPathTest, Fp16ToFp32AllPatterns) {
  const auto in = all_16bit_patterns();
  std::vector<float> out(in.size());
  ASSERT_TRUE(convert(in.data(), DType::kF16, out.data(), DType::kF32, in.size(), GetParam()).ok());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(fp16_bits_to_fp32(in[i])))
        << "fp16 " << hex(in[i]);
  }
}

// All 65,536 values widened to fp32 and narrowed back (the round trip).
TEST_P(ConvertPathTest, RoundTripAll16BitValues) {
  const auto in = all_16bit_patterns();
  std::vector<float> wide(in.size());
  std::vector<uint16_t> back(in.size());
  for (DType half : {DType::kBF16, DType::kF16}) {
    ASSERT_TRUE(convert(in.data(), half, wide.data(), DType::kF32, in.size(), GetParam()).ok());
    ASSERT_TRUE(convert(wide.data(), DType::kF32, back.data(), half, in.size(), GetParam()).ok());
    for (size_t i = 0; i < in.size(); ++i) {
      const float w = half == DType::kBF16 ? bf16_bits_to_fp32(in[i]) : fp16_bits_to_fp32(in[i]);
      const uint16_t expect = half == DType::kBF16 ? fp32_to_bf16_bits(w) : fp32_to_fp16_bits(w);
      ASSERT_EQ(back[i], expect) << dtype_name(half) << " " << hex(in[i]);
      // Non-NaN values survive the round trip exactly.
      if (!std::isnan(w)) {
        ASSERT_EQ(back[i], in[i]) << dtype_name(half) << " " << hex(in[i]);
      }
    }
  }
}

TEST_P(ConvertPathTest, Fp32ToHalfTypesManyPatterns) {
  const auto bits = fp32_patterns();
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<uint16_t> out(in.size());
  ASSERT_TRUE(convert(in.data(), DType::kF32, out.data(), DType::kBF16, in.size(), GetParam()).ok());
  for (size_t i = 0; i < in.size(); ++i)
    ASSERT_EQ(out[i], fp32_to_bf16_bits(in[i])) << "fp32 " << hex(bits[i]) << " -> bf16";
  ASSERT_TRUE(convert(in.data(), DType::kF32, out.data(), DType::kF16, in.size(), GetParam()).ok());
  for (size_t i = 0; i < in.size(); ++i)
    ASSERT_EQ(out[i], fp32_to_fp16_bits(in[i])) << "fp32 " << hex(bits[i]) << " -> fp16";
}

// Lengths 0..70 at element offsets 0..3 (unaligned), with guard elements
// around the destination that must stay untouched; through the forced
// active path and the typed entry points.
TEST_P(ConvertPathTest, OddLengthsAndUnalignedStarts) {
  ASSERT_TRUE(force_convert_path(GetParam()).ok());
  EXPECT_EQ(active_convert_path(), GetParam());
  std::mt19937 rng(7);
  std::vector<float> src(80);
  for (float& f : src) f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  std::vector<uint16_t> src16(80);
  for (uint16_t& h : src16) h = static_cast<uint16_t>(rng());
  for (size_t offset = 0; offset < 4; ++offset) {
    for (size_t n = 0; n <= 70; ++n) {
      std::vector<uint16_t> d16(80, 0xdead);
      convert_fp32_to_bf16(src.data() + offset, reinterpret_cast<bfloat16*>(d16.data() + offset), n);
      for (size_t i = 0; i < 80; ++i) {
        const bool inside = i >= offset && i < offset + n;
        ASSERT_EQ(d16[i], inside ? fp32_to_bf16_bits(src[i]) : 0xdead) << "bf16 n=" << n << " off=" << offset << " i=" << i;
      }
      std::fill(d16.begin(), d16.end(), 0xdead);
      convert_fp32_to_fp16(src.data() + offset, reinterpret_cast<float16*>(d16.data() + offset), n);
      for (size_t i = 0; i < 80; ++i) {
        const bool inside = i >= offset && i < offset + n;
        ASSERT_EQ(d16[i], inside ? fp32_to_fp16_bits(src[i]) : 0xdead) << "fp16 n=" << n << " off=" << offset;
      }
      const float guard = std::bit_cast<float>(0x7fc0beefu);
      std::vector<float> d32(80, guard);
      convert_bf16_to_fp32(reinterpret_cast<const bfloat16*>(src16.data() + offset), d32.data() + offset, n);
      for (size_t i = 0; i < 80; ++i) {
        const bool inside = i >= offset && i < offset + n;
        ASSERT_EQ(std::bit_cast<uint32_t>(d32[i]),
                  inside ? std::bit_cast<uint32_t>(bf16_bits_to_fp32(src16[i])) : 0x7fc0beefu);
      }
      std::fill(d32.begin(), d32.end(), guard);
      convert_fp16_to_fp32(reinterpret_cast<const float16*>(src16.data() + offset), d32.data() + offset, n);
      for (size_t i = 0; i < 80; ++i) {
        const bool inside = i >= offset && i < offset + n;
        ASSERT_EQ(std::bit_cast<uint32_t>(d32[i]),
                  inside ? std::bit_cast<uint32_t>(fp16_bits_to_fp32(src16[i])) : 0x7fc0beefu);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, ConvertPathTest,
                         ::testing::Values(ConvertPath::kScalar, ConvertPath::kAvx2, ConvertPath::kAvx512,
                                           ConvertPath::kAvx512Bf16),
                         [](const auto& info) { return std::string(convert_path_name(info.param)); });

TEST(ConvertPaths, NamesParseAndAvailability) {
  for (ConvertPath p : {ConvertPath::kAuto, ConvertPath::kScalar, ConvertPath::kAvx2, ConvertPath::kAvx512,
                        ConvertPath::kAvx512Bf16}) {
    auto parsed = parse_convert_path(convert_path_name(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  auto bad = parse_convert_path("sse9");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'sse9'"), std::string::npos);
  const auto paths = available_convert_paths();
  ASSERT_FALSE(paths.empty());
  EXPECT_EQ(paths.front(), ConvertPath::kScalar);
  EXPECT_NE(active_convert_path(), ConvertPath::kAuto);
}

TEST(ConvertPaths, ForcingAnUnavailablePathIsUnsupported) {
  ConvertPath missing = ConvertPath::kAuto;
  for (ConvertPath p : {ConvertPath::kAvx512Bf16, ConvertPath::kAvx512, ConvertPath::kAvx2})
    if (!convert_path_available(p)) missing = p;
  if (missing == ConvertPath::kAuto) GTEST_SKIP() << "every path is available on this CPU";
  const ConvertPath before = active_convert_path();
  Status st = force_convert_path(missing);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find(std::string(convert_path_name(missing))), std::string::npos);
  EXPECT_NE(st.message().find("available: scalar"), std::string::npos) << st.message();
  EXPECT_EQ(active_convert_path(), before);
  float x = 1;
  uint16_t y = 0;
  EXPECT_EQ(convert(&x, DType::kF32, &y, DType::kBF16, 1, missing).code(), StatusCode::kUnsupported);
}

TEST(ConvertPaths, AutoPicksTheBestAvailable) {
  ASSERT_TRUE(force_convert_path(ConvertPath::kScalar).ok());
  EXPECT_EQ(active_convert_path(), ConvertPath::kScalar);
  ASSERT_TRUE(force_convert_path(ConvertPath::kAuto).ok());
  EXPECT_EQ(active_convert_path(), available_convert_paths().back());
}

TEST(ConvertGeneric, RejectsBf16ToFp16AndCopiesSameType) {
  uint16_t a[3] = {1, 2, 3}, b[3] = {0, 0, 0};
  Status st = convert(a, DType::kBF16, b, DType::kF16, 3);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("bf16 -> fp16"), std::string::npos);
  ASSERT_TRUE(convert(a, DType::kBF16, b, DType::kBF16, 3).ok());
  EXPECT_EQ(b[2], 3);
  EXPECT_EQ(convert(nullptr, DType::kF32, b, DType::kBF16, 3).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(convert(nullptr, DType::kF32, nullptr, DType::kBF16, 0).ok());
}

}  // namespace
}  // namespace strata
