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

TEST(Units, Format) {
  EXPECT_EQ(format_bytes(112'000'000'000u), "112.00 GB");
  EXPECT_EQ(format_bytes(1u << 30, true), "1.00 GiB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_count(7'000'000'000u), "7.00B");
}

}  // namespace
}  // namespace strata
