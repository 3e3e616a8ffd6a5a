// The strict JSON reader (strata/core/json_file.h): duplicate keys with their
// path, parse errors with line and column, bounded files, byte counts.
#include "strata/core/json_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace strata {
namespace {

const JsonLimits kLimits{.max_bytes = 1 << 20, .max_depth = 8, .what = "row file"};

TEST(JsonText, ADuplicateKeyNamesItsPathThroughArrays) {
  const ParsedJson parsed = parse_json_text(R"({"rows": [{"stage": 3}, {"stage": 3, "stage": 1}]})", kLimits);
  ASSERT_FALSE(parsed.error);
  ASSERT_EQ(parsed.duplicate_keys.size(), 1u);
  EXPECT_EQ(parsed.duplicate_keys[0].path, "rows[1].stage");
  EXPECT_NE(parsed.duplicate_keys[0].message.find("duplicate key"), std::string::npos);
}

TEST(JsonText, ArrayIndicesCountScalarsAndContainers) {
  const ParsedJson parsed = parse_json_text(R"({"a": [1, [2, 3], "x", {"b": 1, "b": 2}], "c": {"d": {"e": 0, "e": 1}}})",
                                            kLimits);
  ASSERT_FALSE(parsed.error);
  ASSERT_EQ(parsed.duplicate_keys.size(), 2u);
  EXPECT_EQ(parsed.duplicate_keys[0].path, "a[3].b");
  EXPECT_EQ(parsed.duplicate_keys[1].path, "c.d.e");
}

TEST(JsonText, TheSameKeyInTwoObjectsIsNoDuplicate) {
  const ParsedJson parsed = parse_json_text(R"({"rows": [{"stage": 3}, {"stage": 1}], "stage": 2})", kLimits);
  EXPECT_FALSE(parsed.error);
  EXPECT_TRUE(parsed.duplicate_keys.empty());
  EXPECT_EQ(parsed.document["rows"][1]["stage"], 1);
}

TEST(JsonText, AParseErrorSaysItsLineAndColumnAndHowToFixIt) {
  const ParsedJson parsed = parse_json_text("{\n  \"stage\": 3,\n}\n", kLimits);
  ASSERT_TRUE(parsed.error);
  EXPECT_NE(parsed.error->message.find("not valid JSON: parse error at line 3, column 1"), std::string::npos)
      << parsed.error->message;
  EXPECT_EQ(parsed.error->message.find("json.exception"), std::string::npos) << parsed.error->message;
  EXPECT_NE(parsed.error->hint.find("no trailing commas"), std::string::npos) << parsed.error->hint;
  EXPECT_TRUE(parsed.document.is_null());
}

TEST(JsonText, ANumberNoDoubleHoldsNamesItsPath) {
  const ParsedJson parsed = parse_json_text(R"({"a": {"b": [0, 1e400]}})", kLimits);
  ASSERT_TRUE(parsed.error);
  EXPECT_EQ(parsed.error->path, "a.b[1]");
  EXPECT_NE(parsed.error->message.find("1e400"), std::string::npos) << parsed.error->message;
}

TEST(JsonText, NulBytesDeepNestingAndSizeAreRefusedBeforeParsing) {
  std::string nul = R"({"a": 1})";
  nul += '\0';
  const ParsedJson with_nul = parse_json_text(nul, kLimits);
  ASSERT_TRUE(with_nul.error);
  EXPECT_NE(with_nul.error->message.find("NUL byte at offset 8"), std::string::npos) << with_nul.error->message;

  const ParsedJson deep = parse_json_text(std::string(9, '[') + std::string(9, ']'), kLimits);
  ASSERT_TRUE(deep.error);
  EXPECT_NE(deep.error->message.find("nesting deeper than 8 levels at offset 8"), std::string::npos);
  EXPECT_FALSE(parse_json_text(std::string(8, '[') + std::string(8, ']'), kLimits).error);
  // Brackets inside strings are no nesting.
  EXPECT_FALSE(parse_json_text("[\"" + std::string(100, '[') + "\"]", kLimits).error);

  const JsonLimits small{.max_bytes = 10, .max_depth = 8, .what = "row file"};
  const ParsedJson big = parse_json_text(R"({"a": 12345})", small);
  ASSERT_TRUE(big.error);
  EXPECT_NE(big.error->message.find("the row file is 12 bytes, more than the 10 a row file may have"),
            std::string::npos)
      << big.error->message;
}

class JsonFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / fmt::format("strata-json-file-{}", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const auto path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path.string();
  }
  static Result<nlohmann::ordered_json> read(const std::string& path) {
    return read_json_file(path, {.what = "row file", .flag = "--configs", .hint = "give a row file"}, kLimits);
  }
  std::filesystem::path dir_;
};

TEST_F(JsonFiles, ADuplicateKeyIsAnErrorNamingTheFileTheFlagAndThePath) {
  const Result<nlohmann::ordered_json> r = read(write("rows.json", R"({"rows": [{"stage": 3, "stage": 1}]})"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("row file '"), std::string::npos) << m;
  EXPECT_NE(m.find("rows.json' (--configs): rows[0].stage: duplicate key"), std::string::npos) << m;
  EXPECT_NE(m.find("delete one of the two"), std::string::npos) << m;
}

TEST_F(JsonFiles, AParseErrorInAFileSaysTheLine) {
  const Result<nlohmann::ordered_json> r = read(write("bad.json", "{\n\"rows\": [\n  {stage: 3}\n]}"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("(--configs): not valid JSON: parse error at line 3"), std::string::npos)
      << r.status().message();
}

TEST_F(JsonFiles, ControlCharactersOfAKeyAreEscapedInTheMessage) {
  const Result<nlohmann::ordered_json> r = read(write("esc.json", "{\"a\\u001b[31m\": 1, \"a\\u001b[31m\": 2}"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().find('\x1b'), std::string::npos);
  EXPECT_NE(r.status().message().find("a\\x1b[31m: duplicate key"), std::string::npos) << r.status().message();
}

TEST_F(JsonFiles, FoldersAndFifosAreRefusedWithoutHanging) {
  const Result<nlohmann::ordered_json> folder = read(dir_.string());
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.status().message().find("(--configs) is not a regular file (a directory)"), std::string::npos)
      << folder.status().message();
  const auto fifo = dir_ / "fifo.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const Result<nlohmann::ordered_json> from_fifo = read(fifo.string());
  ASSERT_FALSE(from_fifo.ok());
  EXPECT_NE(from_fifo.status().message().find("is not a regular file (a FIFO)"), std::string::npos);
}

TEST_F(JsonFiles, AFileLargerThanTheCapIsRefused) {
  const Result<nlohmann::ordered_json> r = read(write("big.json", "[" + std::string(2 << 20, ' ') + "]"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is larger than 1048576 bytes"), std::string::npos) << r.status().message();
}

TEST_F(JsonFiles, AGoodFileKeepsItsKeyOrder) {
  const Result<nlohmann::ordered_json> r = read(write("ok.json", R"({"z": 1, "a": [true, null]})"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->begin().key(), "z");
  EXPECT_EQ((*r)["a"][0], true);
}

TEST(JsonByteCount, EveryUint64IsExactAndNothingElseIsACount) {
  using nlohmann::json;
  EXPECT_EQ(json_byte_count(json::parse("18446744073709551615")).bytes, UINT64_MAX);
  EXPECT_EQ(json_byte_count(json::parse("9223372036854775808")).bytes, uint64_t{1} << 63);
  EXPECT_EQ(json_byte_count(json::parse("1e19")).bytes, uint64_t{10000000000000000000u});
  EXPECT_EQ(json_byte_count(json::parse("80e9")).bytes, uint64_t{80000000000});
  EXPECT_EQ(json_byte_count(json(int64_t{5})).bytes, 5u);
  EXPECT_EQ(json_byte_count(json::parse("0")).bytes, 0u);
  EXPECT_NE(json_byte_count(json::parse("18446744073709551616")).problem.find("more than 18446744073709551615"),
            std::string::npos);
  EXPECT_NE(json_byte_count(json::parse("1e30")).problem.find("more than"), std::string::npos);
  EXPECT_NE(json_byte_count(json::parse("-1")).problem.find("negative"), std::string::npos);
  EXPECT_NE(json_byte_count(json::parse("-0.5")).problem.find("negative"), std::string::npos);
  EXPECT_NE(json_byte_count(json::parse("0.5")).problem.find("not a whole number"), std::string::npos);
  EXPECT_FALSE(json_byte_count(json("64GiB")).bytes);
  EXPECT_FALSE(json_byte_count(json(true)).bytes);
  EXPECT_FALSE(json_byte_count(std::numeric_limits<double>::infinity()).bytes);
  EXPECT_FALSE(json_byte_count(std::numeric_limits<double>::quiet_NaN()).bytes);
}

}  // namespace
}  // namespace strata
