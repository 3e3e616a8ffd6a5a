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
    EXPECT_EQ(keys, (std::vector<std::string>{"step", "loss", "val_loss", "lr", "loss_scale", "grad_norm", "skipped",
                                              "tokens_per_s", "step_ms", "forward_ms", "backward_ms", "optimizer_ms",
                                              "early_updates", "exposed_ms", "optimizer_waits", "bytes", "save",
                                              "peak_bytes"}));
    EXPECT_EQ(j["exposed_ms"].size(), 5u);  // reduce, optimizer, gather, gather_backward, nvme
    // Each pass that waited for its layer's update: the waits add up to exposed_ms.optimizer.
    ASSERT_TRUE(j["optimizer_waits"].is_array());
    double waited = 0;
    for (const auto& w : j["optimizer_waits"]) {
      EXPECT_LT(w["layer"].get<size_t>(), 4u);  // the tiny preset's layers: embeddings, 2 blocks, final
      EXPECT_GT(w["ms"].get<double>(), 0);
      waited += w["ms"].get<double>();
    }
    EXPECT_NEAR(waited, j["exposed_ms"]["optimizer"].get<double>(), 1e-9);
    EXPECT_EQ(j["bytes"].size(), 6u);  // h2d, d2h, gather, reduce, nvme_read, nvme_write
    EXPECT_GT(j["grad_norm"].get<double>(), 0);
    EXPECT_EQ(j["loss_scale"].get<double>(), 1.0);
    EXPECT_EQ(j["step"].get<int>(), lines);
    EXPECT_TRUE(j["save"].is_null());  // no --save-dir
    EXPECT_TRUE(j["loss"].is_number());
    EXPECT_EQ(j["val_loss"].is_null(), lines % 2 == 1) << line;
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(j["step_ms"].get<double>(), 0);
    const auto& pb = j["peak_bytes"];
    EXPECT_EQ(pb.size(), 4u);
    EXPECT_GT(pb["device"].get<uint64_t>(), 0u);
    // Stage 0 without offload: every byte of training state is device memory.
    EXPECT_EQ(pb["pinned"].get<uint64_t>(), 0u);
    EXPECT_EQ(pb["host"].get<uint64_t>(), 0u);
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
  const std::string cfg = temp_path("nvme.json");
  std::ofstream(cfg) << R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
    "offload_optimizer": {"device": "cpu"}}})";
  CliRun r = run("--config " + cfg);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("offload_param.nvme_path: device is nvme but nvme_path is not set"), std::string::npos) << r.out;
  r = run("--stage 3 --offload-param nvme --offload-optimizer cpu");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--offload-param nvme needs a folder"), std::string::npos) << r.out;
  r = run("--stage 3 --offload-param cpu --offload-optimizer none");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--offload-param cpu needs the optimizer off the device"), std::string::npos) << r.out;
  r = run("--stage 2 --offload-optimizer nvme");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("give --nvme-path DIR"), std::string::npos) << r.out;
  r = run("--stage 2 --offload-param cpu");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--offload-param needs stage 3"), std::string::npos) << r.out;
  r = run("--stage 4");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--stage 4"), std::string::npos) << r.out;
  r = run("--offload-optimizer disk");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--offload-optimizer 'disk'"), std::string::npos) << r.out;
  r = run("--ranks 0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--ranks 0"), std::string::npos) << r.out;
  r = run("--ranks 2 --backend mpi");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("mpirun -np N"), std::string::npos) << r.out;
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

// --device-threads D --optimizer-threads K are meant to keep the compute and
// the optimizer on separate cores; when D + K is more than the cores, the run
// says they share them. (A 4096-thread request exceeds any machine's cores.)
TEST(TrainCli, ThreadCountsBeyondTheCoresAreNamed) {
  CliRun r = run("--steps 1 --batch 2 --seq 16 --eval-batches 1 --device-threads 1024 --optimizer-threads 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("note     --device-threads 1024 + --optimizer-threads 1 per rank x 1 rank(s) in this process "
                       "is more than"),
            std::string::npos)
      << r.out;
  r = run("--steps 1 --batch 2 --seq 16 --eval-batches 1 --device-threads 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("note     --device-threads"), std::string::npos) << r.out;
}

// The NVMe optimizer tier without both pipelines keeps its I/O on the
// step's path: the run says which key to set; with both on it says nothing.
TEST(TrainCli, NvmeStateWithoutPipelinesIsNamed) {
  const std::string dir = ::testing::TempDir();
  const std::string config = temp_path("pipelines.json");
  const std::string base = "--steps 1 --batch 2 --seq 16 --eval-every 0 --config " + config;
  auto write_config = [&](const char* pipelines) {
    std::ofstream(config) << "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"nvme\", "
                          << "\"nvme_path\": " << nlohmann::json(dir).dump() << ", " << pipelines
                          << "}}, \"train_micro_batch_size_per_gpu\": 2}";
  };
  write_config("\"pipeline_read\": true");
  CliRun r = run(base);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("note     zero_optimization.offload_optimizer.pipeline_read true and pipeline_write false "
                       "(DeepSpeed's defaults are false): each write of the optimizer state is waited for"),
            std::string::npos)
      << r.out;
  write_config("\"pipeline_read\": true, \"pipeline_write\": true");
  r = run(base);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("pipeline_read"), std::string::npos) << r.out;
}

}  // namespace

namespace strata {
namespace {

// Two local ranks at stage 3 with both offloads: the engine line says so,
// the losses equal stage 0's on the same two ranks (bit for bit, as printed
// in the JSON log), and the optimizer state sits in pinned host memory.
TEST(TrainCli, RanksAndZeroStagesFromFlags) {
  const std::string a = temp_path("s0.jsonl"), b = temp_path("s3.jsonl");
  CliRun r0 = run("--steps 3 --seq 16 --batch 2 --eval-every 0 --ranks 2 --stage 0 --json-log " + a);
  ASSERT_EQ(r0.rc, 0) << r0.out;
  CliRun r3 = run("--steps 3 --seq 16 --batch 2 --eval-every 0 --ranks 2 --stage 3 --offload-optimizer cpu "
                  "--offload-param cpu --json-log " + b);
  ASSERT_EQ(r3.rc, 0) << r3.out;
  EXPECT_NE(r3.out.find("engine   stage 3, optimizer cpu (pinned host memory), params cpu"), std::string::npos)
      << r3.out;
  EXPECT_NE(r3.out.find("x ranks 2"), std::string::npos) << r3.out;
  std::ifstream fa(a), fb(b);
  std::string la, lb;
  int n = 0;
  while (std::getline(fa, la) && std::getline(fb, lb)) {
    auto ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
    EXPECT_EQ(ja["loss"].get<double>(), jb["loss"].get<double>()) << "step " << ja["step"];
    EXPECT_GT(jb["peak_bytes"]["pinned"].get<uint64_t>(), 0u);
    EXPECT_GT(jb["bytes"]["h2d"].get<uint64_t>(), 0u);
    EXPECT_GT(jb["bytes"]["d2h"].get<uint64_t>(), 0u);
    ++n;
  }
  EXPECT_EQ(n, 3);
}

}  // namespace
}  // namespace strata
