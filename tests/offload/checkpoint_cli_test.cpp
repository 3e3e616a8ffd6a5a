// Checkpoints through the binary: `strata train --save-dir/--resume` and
// `strata checkpoint inspect|verify|export`.
//  - kill -9 at every point of a save's commit (STRATA_CHECKPOINT_CRASH_AT,
//    read only by the test-only strata-testing binary): `latest` still names
//    a complete checkpoint, no half-written tag is visible, and --resume
//    (with the release `strata`) continues with the losses of the straight
//    run; the release `strata` ignores the variable;
//  - a synchronous save gives the same losses, the step log says how long
//    each save blocked;
//  - bad flags, a damaged shard, a changed seed: clear refusals.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "scratch_folders.h"

namespace {

namespace fs = std::filesystem;

struct CliRun {
  int rc;
  std::string out;
  bool killed = false;
};

// `binary`: the release `strata`, or STRATA_TESTING_CLI_PATH (strata-testing:
// the same CLI that also reads the test-only fault variables).
CliRun run(const std::string& args, const std::string& env = "", const char* binary = STRATA_CLI_PATH) {
  const std::string cmd = env + " " + std::string(binary) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, ""};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  CliRun r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
  // sh reports a child killed by signal 9 as exit status 128 + 9.
  r.killed = r.rc == 137 || (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  return r;
}

fs::path fresh(const std::string& name) {
  return strata::offload::testing_scratch::fresh_scratch_folder("strata_ckcli_", name, /*create=*/true);
}

// step -> loss (exact text of the JSON number) from a --json-log file.
std::map<int, double> losses(const fs::path& log) {
  std::map<int, double> m;
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    m[j["step"].get<int>()] = j["loss"].get<double>();
  }
  return m;
}

const std::string kTrain = "train --preset tiny --batch 4 --seq 32 --eval-every 0 --eval-batches 1 --quiet --ranks 2 "
                           "--stage 3 --offload-optimizer cpu --lr 0.003 ";

TEST(CheckpointCli, KillDuringEveryCommitStepLeavesALoadableLatest) {
  const fs::path work = fresh("kill");
  ASSERT_EQ(run(kTrain + "--steps 6 --json-log " + (work / "straight.jsonl").string()).rc, 0);
  const auto straight = losses(work / "straight.jsonl");
  ASSERT_EQ(straight.size(), 6u);
  for (const std::string point : {"after-rank-files", "before-manifest", "before-rename", "before-latest",
                                  "after-latest"}) {
    const fs::path dir = work / point;
    // Killed while committing the second save (step 4); the first (step 2) is complete.
    const CliRun k = run(kTrain + "--steps 6 --save-every 2 --save-dir " + dir.string(),
                         "STRATA_CHECKPOINT_CRASH_AT=" + point + "@global_step4", STRATA_TESTING_CLI_PATH);
    ASSERT_TRUE(k.killed) << point << ": rc " << k.rc << "\n" << k.out;
    const bool committed = std::string(point) == "after-latest";
    std::ifstream latest(dir / "latest");
    std::string tag;
    latest >> tag;
    EXPECT_EQ(tag, committed ? "global_step4" : "global_step2") << point;
    // A tag folder exists only once complete (renamed after its manifest).
    const bool renamed = std::string(point) == "before-latest" || committed;
    EXPECT_EQ(fs::exists(dir / "global_step4"), renamed) << point;
    if (renamed) {
      EXPECT_TRUE(fs::exists(dir / "global_step4" / "manifest.json")) << point;
    }
    const CliRun v = run("checkpoint verify " + dir.string());
    EXPECT_EQ(v.rc, 0) << point << ": " << v.out;
    // The killed save's temporary folder (if it was not renamed yet) is
    // listed by inspect and removed by clean; nothing else is touched.
    const CliRun i = run("checkpoint inspect " + dir.string());
    EXPECT_EQ(i.out.find("interrupted save of tag global_step4") != std::string::npos, !renamed) << point << i.out;
    const CliRun c = run("checkpoint clean " + dir.string());
    EXPECT_EQ(c.rc, 0) << c.out;
    EXPECT_NE(c.out.find(renamed ? "0 interrupted save(s) removed" : "1 interrupted save(s) removed"),
              std::string::npos)
        << point << c.out;
    for (const auto& e : fs::directory_iterator(dir))
      EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << point << ": " << e.path();
    EXPECT_EQ(run("checkpoint verify " + dir.string()).rc, 0) << point;
    // Resume from `latest` and finish: the same losses as the straight run.
    const fs::path log = dir / "resumed.jsonl";
    const CliRun r = run(kTrain + "--steps 6 --resume " + dir.string() + " --json-log " + log.string());
    ASSERT_EQ(r.rc, 0) << point << ": " << r.out;
    const auto resumed = losses(log);
    const int first = committed ? 5 : 3;
    ASSERT_EQ(resumed.size(), static_cast<size_t>(7 - first)) << point;
    for (const auto& [step, loss] : resumed) {
      EXPECT_GE(step, first) << point;
      EXPECT_EQ(loss, straight.at(step)) << point << " step " << step;
    }
  }
}

// The crash point is a test hook of strata-testing only: the installed
// `strata` does not read the variable (an unknown variable, ignored like any
// other), so the same run completes and commits every save.
TEST(CheckpointCli, ReleaseBinaryIgnoresTheCrashVariable) {
  const fs::path dir = fresh("release") / "ck";
  const CliRun r = run(kTrain + "--steps 4 --save-every 2 --save-dir " + dir.string(),
                       "STRATA_CHECKPOINT_CRASH_AT=after-rank-files");
  ASSERT_FALSE(r.killed) << r.out;
  ASSERT_EQ(r.rc, 0) << r.out;
  std::ifstream latest(dir / "latest");
  std::string tag;
  latest >> tag;
  EXPECT_EQ(tag, "global_step4");
  EXPECT_EQ(run("checkpoint verify " + dir.string()).rc, 0);
}

TEST(CheckpointCli, CleanKeepsSavesOfRunningProcessesAndNeverFollowsLinks) {
  const fs::path work = fresh("clean");
  const fs::path dir = work / "ck", outside = work / "outside";
  fs::create_directories(dir);
  fs::create_directories(outside);
  std::ofstream(outside / "precious") << "keep me";
  fs::create_directories(dir / (".tmp-global_step3-" + std::to_string(::getpid())));  // this process: running
  fs::create_directory_symlink(outside, dir / ".tmp-global_step4-999999999");         // a link: never followed
  fs::create_directories(dir / ".tmp-global_step5-2147483646");                       // no such process
  std::ofstream(dir / ".tmp-global_step5-2147483646" / "rank00000.model") << "half";
  CliRun r = run("checkpoint clean --dry-run " + dir.string());
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("would remove .tmp-global_step5-2147483646"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir / ".tmp-global_step5-2147483646"));
  r = run("checkpoint clean " + dir.string());
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("kept     .tmp-global_step3-"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 interrupted save(s) removed, 1 kept"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir / ".tmp-global_step5-2147483646"));
  EXPECT_TRUE(fs::exists(dir / (".tmp-global_step3-" + std::to_string(::getpid()))));
  EXPECT_TRUE(fs::is_symlink(dir / ".tmp-global_step4-999999999"));
  EXPECT_TRUE(fs::exists(outside / "precious"));
  r = run("checkpoint clean " + (work / "missing").string());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("not a checkpoint folder"), std::string::npos) << r.out;
}

TEST(CheckpointCli, SyncSaveSameLossesAndTheLogSaysWhatBlocked) {
  const fs::path work = fresh("sync");
  const fs::path a = work / "async.jsonl", b = work / "sync.jsonl";
  ASSERT_EQ(run(kTrain + "--steps 4 --save-every 1 --keep 1 --save-dir " + (work / "a").string() + " --json-log " +
                a.string())
                .rc,
            0);
  const CliRun s = run(kTrain + "--steps 4 --save-every 2 --save-sync --save-dir " + (work / "b").string() +
                       " --json-log " + b.string());
  ASSERT_EQ(s.rc, 0) << s.out;
  EXPECT_EQ(losses(a), losses(b));
  std::ifstream in(b);
  std::string line;
  int saves = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["save"].is_null()) continue;
    ++saves;
    EXPECT_GT(j["save"]["blocked_ms"].get<double>(), 0.0);
    EXPECT_GT(j["save"]["bytes"].get<uint64_t>(), 0u);
  }
  EXPECT_EQ(saves, 2);
  // --keep 1 left one tag.
  size_t tags = 0;
  for (const auto& e : fs::directory_iterator(work / "a")) tags += e.is_directory() ? 1 : 0;
  EXPECT_EQ(tags, 1u);
  const CliRun i = run("checkpoint inspect " + (work / "b").string());
  ASSERT_EQ(i.rc, 0) << i.out;
  EXPECT_NE(i.out.find("tag global_step4: step 4"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("rank00001.optim"), std::string::npos) << i.out;
  const CliRun ij = run("checkpoint inspect --json " + (work / "b" / "global_step2").string());
  ASSERT_EQ(ij.rc, 0) << ij.out;
  EXPECT_EQ(nlohmann::json::parse(ij.out)["step"].get<int>(), 2);
}

TEST(CheckpointCli, RefusalsNameTheCulprit) {
  const fs::path work = fresh("refuse");
  CliRun r = run(kTrain + "--steps 1 --save-every 2");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("need --save-dir"), std::string::npos) << r.out;
  r = run(kTrain + "--steps 1 --resume " + (work / "missing").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("does not exist"), std::string::npos) << r.out;
  ASSERT_EQ(run(kTrain + "--steps 2 --save-dir " + (work / "ck").string()).rc, 0);
  // A run that would save a tag again is refused before it trains.
  r = run(kTrain + "--steps 2 --save-dir " + (work / "ck").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("already holds tag global_step2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step     1/"), std::string::npos) << r.out;
  // Resuming at or past --steps trains nothing and says so.
  r = run(kTrain + "--steps 2 --resume " + (work / "ck").string());
  EXPECT_EQ(r.rc, 0) << r.out;
  r = run(kTrain + "--steps 3 --seed 7 --resume " + (work / "ck").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--seed"), std::string::npos) << r.out;
  std::string other_batch = kTrain;
  other_batch.replace(other_batch.find("--batch 4"), 9, "--batch 3");
  r = run(other_batch + "--steps 3 --resume " + (work / "ck").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("global batch"), std::string::npos) << r.out;
  r = run("checkpoint export " + (work / "ck").string() + " --out " + (work / "hf").string() + " --dtype fp16");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--dtype"), std::string::npos) << r.out;
  // Export works, then refuses to overwrite without --overwrite.
  r = run("checkpoint export " + (work / "ck").string() + " --out " + (work / "hf").string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(fs::exists(work / "hf" / "model.safetensors"));
  r = run("checkpoint export " + (work / "ck").string() + " --out " + (work / "hf").string());
  EXPECT_NE(r.rc, 0) << r.out;
  // A damaged shard: verify fails naming the file, and so does a resume.
  const fs::path shard = work / "ck" / "global_step2" / "rank00000.model";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(40);
    char c = 0;
    f.read(&c, 1);
    f.seekp(40);
    c = static_cast<char>(c ^ 0x01);
    f.write(&c, 1);
  }
  r = run("checkpoint verify " + (work / "ck").string());
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("rank00000.model"), std::string::npos) << r.out;
  r = run(kTrain + "--steps 3 --resume " + (work / "ck").string());
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("rank00000.model"), std::string::npos) << r.out;
}

}  // namespace
