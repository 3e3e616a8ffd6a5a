// `strata train` on defaults gives the losses recorded in
// data/tiny_300_losses.json bit for bit: every training and validation loss
// of 300 steps of the tiny preset (seed 1234), and the same progress text
// once the timing fields are masked. The fixture was recorded from the
// stage-0 trainer that lived in model/ before the loop moved to offload/;
// any change of summation order, kernel, data order or initialisation shows
// up here as a failed step number.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

struct CliRun {
  int rc = -1;
  std::string out;
};

CliRun run_cli(const std::string& args) {
  // The recorded losses are bit for bit, so they depend on the order of the
  // matrix products' sums, which OpenBLAS picks per CPU (Haswell kernels
  // when recorded; Cooperlake on an AVX-512 BF16 machine sums differently
  // from step 12 on). Pin the kernel it was recorded with: every x86-64
  // machine that runs these tests has AVX2.
  const std::string cmd = "OPENBLAS_CORETYPE=Haswell " + std::string(STRATA_CLI_PATH) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  CliRun r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

nlohmann::json load_fixture() {
  const std::string path = std::string(STRATA_OFFLOAD_TEST_DATA) + "/tiny_300_losses.json";
  std::ifstream in(path);
  if (!in) return nullptr;
  return nlohmann::json::parse(in);
}

// The recorded values are hex floats ("%a"): exact by construction.
uint64_t bits_of_hex(const std::string& hex) { return std::bit_cast<uint64_t>(std::strtod(hex.c_str(), nullptr)); }

// Progress text without what depends on the machine's speed, on where the
// source tree is (the corpus path) or on the peak-bytes columns (which
// became real measurements in issue 10 and are checked by the CLI tests).
std::string mask(const std::string& line) {
  static const std::regex tok_s(R"(\|\s+[0-9.]+ tok/s \|\s+[0-9.]+ ms \| peak device .*$)");
  static const std::regex done_tail(R"(; median .*$)");
  static const std::regex corpus(R"(^data     \S+ )");
  // The memory line's device cap is a quarter of this machine's RAM.
  static const std::regex memory(R"(^memory   .*$)");
  std::string out = std::regex_replace(line, tok_s, "| <timing>");
  out = std::regex_replace(out, done_tail, "; <timing>");
  out = std::regex_replace(out, memory, "memory   <bytes>");
  return std::regex_replace(out, corpus, "data     <corpus> ");
}

std::vector<std::string> masked_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) out.push_back(mask(line));
  return out;
}

TEST(TrainFixture, Tiny300StepsLossesBitForBit) {
  const nlohmann::json fx = load_fixture();
  ASSERT_FALSE(fx.is_null()) << "missing fixture " << STRATA_OFFLOAD_TEST_DATA << "/tiny_300_losses.json";
  const std::string log = ::testing::TempDir() + "/strata_offload_fixture.jsonl";
  std::remove(log.c_str());
  const CliRun r = run_cli(fx["args"].get<std::string>() + " --json-log " + log);
  ASSERT_EQ(r.rc, 0) << r.out;

  const auto& want = fx["steps"];
  std::ifstream in(log);
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) {
    ASSERT_LT(n, want.size()) << "more steps than the fixture";
    const auto got = nlohmann::json::parse(line);
    const auto& w = want[n];
    ASSERT_EQ(got["step"].get<int>(), w["step"].get<int>());
    EXPECT_EQ(std::bit_cast<uint64_t>(got["loss"].get<double>()), bits_of_hex(w["loss"].get<std::string>()))
        << "step " << w["step"] << ": loss " << got["loss"] << " != recorded " << w["loss_decimal"];
    ASSERT_EQ(got["val_loss"].is_null(), w["val_loss"].is_null()) << "step " << w["step"];
    if (!w["val_loss"].is_null()) {
      EXPECT_EQ(std::bit_cast<uint64_t>(got["val_loss"].get<double>()), bits_of_hex(w["val_loss"].get<std::string>()))
          << "step " << w["step"] << ": val_loss " << got["val_loss"] << " != recorded " << w["val_loss_decimal"];
    }
    ++n;
  }
  EXPECT_EQ(n, want.size());

  std::vector<std::string> want_lines;
  for (const auto& l : fx["stdout"]) want_lines.push_back(mask(l.get<std::string>()));
  EXPECT_EQ(masked_lines(r.out), want_lines);
}

// The fixture itself is sane: a test that could not fail would prove nothing.
TEST(TrainFixture, FixtureHoldsThreeHundredDistinctSteps) {
  const nlohmann::json fx = load_fixture();
  ASSERT_FALSE(fx.is_null());
  ASSERT_EQ(fx["steps"].size(), 300u);
  EXPECT_NE(fx["steps"][0]["loss"], fx["steps"][299]["loss"]);
  EXPECT_FALSE(fx["steps"][49]["val_loss"].is_null());
  EXPECT_TRUE(fx["steps"][48]["val_loss"].is_null());
}

}  // namespace
