#include "strata/core/units.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(Units, ParseBytes) {
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("1MiB"), 1048576u);
  EXPECT_EQ(*parse_bytes("1M"), 1048576u);
  EXPECT_EQ(*parse_bytes("256mib"), 256u << 20);
  EXPECT_EQ(*parse_bytes("80GB"), 80'000'000'000u);
  EXPECT_EQ(*parse_bytes("1e9"), 1'000'000'000u);
  EXPECT_EQ(*parse_bytes("1.5GiB"), 1610612736u);
  EXPECT_EQ(*parse_bytes(" 2 KiB "), 2048u);
}

TEST(Units, ParseBytesRejectsBadInputWithTheCulprit) {
  auto r = parse_bytes("12XB", "--size");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--size"), std::string::npos);
  EXPECT_NE(r.status().message().find("xb"), std::string::npos);
  EXPECT_FALSE(parse_bytes("-1").ok());
  EXPECT_FALSE(parse_bytes("").ok());
  EXPECT_FALSE(parse_bytes("abc").ok());
  EXPECT_FALSE(parse_bytes("0.5").ok());
}

TEST(Units, ParseCount) {
  EXPECT_EQ(*parse_count("7B"), 7'000'000'000u);
  EXPECT_EQ(*parse_count("7e9"), 7'000'000'000u);
  EXPECT_EQ(*parse_count("1.3B"), 1'300'000'000u);
  EXPECT_EQ(*parse_count("350M"), 350'000'000u);
  EXPECT_EQ(*parse_count("125k"), 125'000u);
  EXPECT_FALSE(parse_count("7X").ok());
}

TEST(Units, IntegersStayExactAndNeverWrap) {
  EXPECT_EQ(*parse_bytes("9007199254740993"), 9007199254740993u);  // a double would give ...992
  EXPECT_EQ(*parse_bytes("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(*parse_count("18446744073709551615"), UINT64_MAX);
  auto over = parse_bytes("18446744073709551616", "--device-memory");
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("--device-memory"), std::string::npos);
  EXPECT_NE(over.status().message().find("too large"), std::string::npos);
  EXPECT_FALSE(parse_bytes("16777216TiB").ok());  // 2^24 x 2^40 = 2^64: overflows by one
  EXPECT_EQ(*parse_bytes("16777215TiB"), uint64_t{16777215} << 40);
  EXPECT_FALSE(parse_count("18446744073709551616").ok());
  EXPECT_FALSE(parse_count("1e20").ok());
  EXPECT_FALSE(parse_bytes("1.9e19").ok());
}

TEST(Units, ControlCharactersAndNulAreRefusedAndEscaped) {
  auto nul = parse_bytes(std::string_view("4096\0garbage", 12), "--block-size");
  ASSERT_FALSE(nul.ok());  // strtod would stop at the NUL and accept 4096
  EXPECT_NE(nul.status().message().find("control character"), std::string::npos) << nul.status().message();
  EXPECT_NE(nul.status().message().find("\\x00"), std::string::npos) << nul.status().message();
  auto esc = parse_count("7B\x1b[2K\rOK", "--params");
  ASSERT_FALSE(esc.ok());
  EXPECT_EQ(esc.status().message().find('\x1b'), std::string::npos);
  EXPECT_EQ(esc.status().message().find('\r'), std::string::npos);
}

TEST(Units, Format) {
  EXPECT_EQ(format_bytes(112'000'000'000u), "112.00 GB");
  EXPECT_EQ(format_bytes(1u << 30, true), "1.00 GiB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_count(7'000'000'000u), "7.00B");
}

}  // namespace
}  // namespace strata
