// `strata train` end to end through the binary: progress lines, the JSON
// log's exact shape, config handling and error exits.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

struct CliRun {
  int rc;
  std::string out;
};

CliRun run(const std::string& args) {
  const std::string cmd = std::string(STRATA_CLI_PATH) + " train " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string temp_path(const char* name) { return ::testing::TempDir() + "/strata_model_" + name; }

TEST(TrainCli, ProgressLinesAndJsonLogShape) {
  const std::string log = temp_path("log.jsonl");
  CliRun r = run("--preset tiny --steps 4 --batch 2 --seq 16 --eval-every 2 --eval-batches 1 --json-log " + log);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("unigram baseline"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step     4/4 | loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak device"), std::string::npos) << r.out;
  std::ifstream in(log);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    auto j = nlohmann::ordered_json::parse(line);  // keeps the file's key order
    std::vector<std::string> keys;
    for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
    EXPECT_EQ(keys, (std::vector<std::string>{"step", "loss", "val_loss", "tokens_per_s", "step_ms", "peak_bytes"}));
    EXPECT_EQ(j["step"].get<int>(), lines);
    EXPECT_TRUE(j["loss"].is_number());
    EXPECT_EQ(j["val_loss"].is_null(), lines % 2 == 1) << line;
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["step_ms"].get<double>(), 0);
    const auto& pb = j["peak_bytes"];
    EXPECT_EQ(pb.size(), 4u);
    EXPECT_GT(pb["device"].get<uint64_t>(), 0u);
    EXPECT_EQ(pb["pinned"].get<uint64_t>(), 0u);
    EXPECT_GT(pb["host"].get<uint64_t>(), 0u);
    EXPECT_EQ(pb["nvme"].get<uint64_t>(), 0u);
  }
  EXPECT_EQ(lines, 4);
}

TEST(TrainCli, ConfigAppliesAndFlagsOverride) {
  const std::string cfg = temp_path("ds.json");
  std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.01}}})";
  CliRun r = run("--steps 1 --seq 16 --eval-batches 1 --config " + cfg);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("batch 3 x seq 16 x accum 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("adamw lr 0.002 wd 0.01 clip 0.5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bf16"), std::string::npos) << r.out;
  r = run("--steps 1 --seq 16 --eval-batches 1 --batch 2 --lr 0.01 --config " + cfg);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("batch 2 x seq 16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lr 0.01 "), std::string::npos) << r.out;
}

TEST(TrainCli, BadInputsExitNonZeroWithTheCulprit) {
  const std::string cfg = temp_path("stage2.json");
  std::ofstream(cfg) << R"({"zero_optimization": {"stage": 2}})";
  CliRun r = run("--config " + cfg);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("stage = 2"), std::string::npos) << r.out;
  r = run("--preset huge");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("valid presets"), std::string::npos) << r.out;
  r = run("--seq 100");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--seq 100"), std::string::npos) << r.out;
  r = run("--data /nonexistent/corpus.txt");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("/nonexistent/corpus.txt"), std::string::npos) << r.out;
  r = run("--device-memory 1MiB --steps 1");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--device-memory"), std::string::npos) << r.out;
  r = run("--device tpu");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--device 'tpu'"), std::string::npos) << r.out;
}

// --device auto (and a config's "strata.device": "auto") picks cuda when a
// GPU is usable, else cpu, and says which on a `device` line.
TEST(TrainCli, AutoDeviceSaysWhichItChose) {
  CliRun r = run("--device auto --steps 1 --batch 2 --seq 16 --eval-batches 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  const bool cpu = r.out.find("device   auto: cpu (cuda: ") != std::string::npos;
  const bool cuda = r.out.find("device   auto: cuda (") != std::string::npos;
  EXPECT_TRUE(cpu != cuda) << r.out;
  EXPECT_NE(r.out.find(cpu ? "train    device cpu," : "train    device cuda,"), std::string::npos) << r.out;
  // Without --device and without a config the default stays cpu, with no choice line.
  r = run("--steps 1 --batch 2 --seq 16 --eval-batches 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("device   auto"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train    device cpu,"), std::string::npos) << r.out;
}

}  // namespace
