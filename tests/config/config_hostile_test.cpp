// Hostile config input (issue 16, items 3-6): every case is a reproducer of a
// finding: deep nesting, huge keys, wrapped integers, overflowing products,
// numbers no double holds, control characters, NUL bytes, special files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using testing::check_text;
using testing::expect_error;

TEST(ConfigHostile, DeepArrayNestingIsABoundedErrorNotAStackOverflow) {
  std::string text = R"({"zero_optimization": {"stage": )";
  text += std::string(70000, '[') + "1" + std::string(70000, ']') + "}}";
  const auto check = check_text(text);
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("nesting deeper than 64 levels"), std::string::npos) << check.format().substr(0, 400);
}

TEST(ConfigHostile, DeepObjectNestingWithLongKeysIsRefusedBeforeParsing) {
  std::string text;
  const std::string key(100, 'k');
  for (int i = 0; i < 10000; ++i) text += fmt::format(R"({{"{}":)", key);
  text += "1" + std::string(10000, '}');
  const auto t0 = std::chrono::steady_clock::now();
  const auto check = check_text(text);
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("nesting deeper"), std::string::npos);
  // Linear, not quadratic: no full path string per level is ever built.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "not a timing goal: a hang guard";
}

TEST(ConfigHostile, BracketsInsideStringsDoNotCountAsNesting) {
  const std::string text = R"({"zero_optimization": {"offload_optimizer": {"nvme_path": ")" + std::string(200, '[') +
                           R"("}}})";
  const auto check = check_text(text);
  EXPECT_EQ(check.format().find("nesting"), std::string::npos) << check.format();
}

TEST(ConfigHostile, AMegabyteUnknownKeyIsReportedQuicklyAndCut) {
  const std::string key(1 << 20, 'x');
  const auto check = check_text(fmt::format(R"({{"{}": 1}})", key));
  ASSERT_FALSE(check.ok());
  const std::string printed = check.format();
  EXPECT_LT(printed.size(), 8000u);
  EXPECT_NE(printed.find("cut, 1048576 bytes in all"), std::string::npos) << printed.substr(0, 600);
}

TEST(ConfigHostile, IntegersThatWouldWrapAreErrorsNamingTheKey) {
  expect_error(check_text(R"({"zero_optimization": {"stage": 3, "sub_group_size": 18446744073709551615}})"),
               "zero_optimization.sub_group_size", "does not fit in a 64-bit signed integer", "allowed");
  expect_error(check_text(R"({"zero_optimization": {"stage": 3, "sub_group_size": 9223372036854775808}})"),
               "zero_optimization.sub_group_size", "does not fit", "allowed");
  expect_error(check_text(R"({"zero_optimization": {"stage": 3, "sub_group_size": 1e30}})"),
               "zero_optimization.sub_group_size", "does not fit", "allowed");
}

TEST(ConfigHostile, BatchProductsThatOverflowAreErrors) {
  const auto check = check_text(
      R"({"train_micro_batch_size_per_gpu": 4611686018427387904, "gradient_accumulation_steps": 4})", 8);
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("overflows a 64-bit integer"), std::string::npos) << check.format();
  const auto check2 = check_text(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4611686018427387904})", 4);
  ASSERT_FALSE(check2.ok());
  EXPECT_NE(check2.format().find("overflows"), std::string::npos) << check2.format();
}

// Byte keys are uint64: 2^63 and up once wrapped to 0 (unlimited), and 1e19
// or 1e30 clamped to 2^63 - 1, both with `config check` OK.
TEST(ConfigHostile, ByteKeysKeepEveryUint64Exactly) {
  for (const auto& [text, bytes] : std::vector<std::pair<std::string, uint64_t>>{
           {"9223372036854775808", uint64_t{1} << 63},
           {"12345678901234567890", uint64_t{12345678901234567890u}},
           {"18446744073709551615", UINT64_MAX},
           {"1e19", uint64_t{10000000000000000000u}},
           {"9.3e18", uint64_t{9300000000000000000u}}}) {
    const auto check = check_text(fmt::format(R"({{"strata": {{"host_memory_budget": {0}, "device_memory": {0}}}}})", text));
    ASSERT_TRUE(check.ok()) << text << ":\n" << check.format();
    EXPECT_EQ(check.config.strata.host_memory_budget, bytes) << text;
    EXPECT_EQ(check.config.strata.device_memory, bytes) << text;
  }
}

TEST(ConfigHostile, ByteCountsNoUint64HoldsAreErrorsNamingTheKeyAndTheMost) {
  for (const char* key : {"host_memory_budget", "device_memory"}) {
    const std::string path = fmt::format("strata.{}", key);
    for (const char* text : {"18446744073709551616", "1e30", "1.8446744073709552e19"})
      expect_error(check_text(fmt::format(R"({{"strata": {{"{}": {}}}}})", key, text)), path,
                   "is more than 18446744073709551615 (2^64 - 1)", "\"64GiB\"");
    expect_error(check_text(fmt::format(R"({{"strata": {{"{}": -1}}}})", key)), path, "-1 is negative", "64GiB");
    expect_error(check_text(fmt::format(R"({{"strata": {{"{}": 0.5}}}})", key)), path, "0.5 is not a whole number",
                 "64GiB");
  }
}

TEST(ConfigHostile, ANumberNoDoubleHoldsNamesItsPath) {
  const auto check = check_text(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e400}}})");
  ASSERT_FALSE(check.ok());
  const std::string printed = check.format();
  EXPECT_NE(printed.find("optimizer.params.lr"), std::string::npos) << printed;
  EXPECT_EQ(printed.find("json.exception"), std::string::npos) << printed;
  EXPECT_NE(printed.find("test.json: error: "), std::string::npos) << printed;
}

TEST(ConfigHostile, ControlCharactersInKeysCannotForgeOutputLines) {
  const auto check = check_text("{\"bad\\nOK: ZeRO stage 3\\u001b[32m\": 1}");
  ASSERT_FALSE(check.ok());
  const std::string printed = check.format();
  EXPECT_EQ(printed.find('\n' + std::string("OK: ZeRO")), std::string::npos) << printed;
  EXPECT_EQ(printed.find('\x1b'), std::string::npos);
  EXPECT_NE(printed.find("\\x0a"), std::string::npos) << printed;
  EXPECT_NE(printed.find("\\x1b"), std::string::npos) << printed;
}

TEST(ConfigHostile, NulBytesAreRefusedWithTheirOffset) {
  std::string text = R"({"train_batch_size": 8})";
  text += std::string(1, '\0') + R"({"garbage": true})";
  const auto check = check_text(text);
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("NUL byte at offset 23"), std::string::npos) << check.format();
}

class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / fmt::format("strata-config-hostile-{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(ConfigFiles, AFifoIsRefusedWithoutHanging) {
  const auto fifo = dir_ / "ds.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto check = check_config_file(fifo.string());
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("not a regular file (a FIFO)"), std::string::npos) << check.format();
}

TEST_F(ConfigFiles, DevZeroAndFoldersAreRefused) {
  auto zero = check_config_file("/dev/zero");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.format().find("character device"), std::string::npos) << zero.format();
  const auto link = dir_ / "link.json";
  std::filesystem::create_symlink("/dev/zero", link);
  EXPECT_FALSE(check_config_file(link.string()).ok());
  auto folder = check_config_file(dir_.string());
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.format().find("directory"), std::string::npos) << folder.format();
}

TEST_F(ConfigFiles, OversizedFilesAreRefusedAfterABoundedRead) {
  const auto big = dir_ / "big.json";
  {
    std::ofstream out(big, std::ios::binary);
    out << "{\"train_batch_size\": 8, \"x\": \"";
    const std::string chunk(1 << 20, 'a');
    for (size_t i = 0; i <= kMaxConfigBytes / chunk.size(); ++i) out << chunk;
    out << "\"}";
  }
  auto check = check_config_file(big.string());
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.format().find("larger than"), std::string::npos) << check.format().substr(0, 300);
  EXPECT_TRUE(load_config(big.string()).status().message().find("larger than") != std::string::npos);
}

}  // namespace
}  // namespace strata
