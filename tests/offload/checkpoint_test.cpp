// Checkpoints of the engine (engine.h save/load, checkpoint.h):
//  - saving (asynchronously, every other step) does not change training;
//  - resume parity: K steps, save, a fresh engine loads, K more: the losses
//    and the validation loss are bit-identical to 2K straight steps, for
//    every placement of the engine's matrix (NVMe included) and fp16;
//  - reshard 2 -> 1, 1 -> 4, 4 -> 2 with stage and placement changed:
//    within the cross-world tolerance of an unsharded continuation;
//  - damage: a flipped byte (verify and load name the file), a truncated
//    file, a newer format version, another model shape, an existing tag;
//  - host memory does not grow with the number of saves.
#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>

#include <unistd.h>

#include "engine_harness.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/offload/checkpoint.h"
#include "scratch_folders.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) { return testing_scratch::fresh_scratch_folder("ckpt-", name); }

// Saves into `dir` after every `every`-th step (asynchronously), waits at the end.
void save_every(TrainRun& r, const fs::path& dir, int every, int keep = 0) {
  r.on_step = [dir, every, keep](Engine& e, int, int64_t step) -> Status {
    if (step % every != 0) return Status::Ok();
    CheckpointSaveOptions o;
    o.dir = dir.string();
    o.keep = keep;
    o.app = {{"test", "checkpoint"}};
    return e.save_checkpoint(o).status();
  };
  r.on_end = [](Engine& e, int) { return e.wait_checkpoint().status(); };
}

void resume_from(TrainRun& r, const fs::path& what) {
  r.on_start = [what](Engine& e, int) { return e.load_checkpoint(what.string()).status(); };
}

class ResumeParity : public ::testing::TestWithParam<DType> {};

TEST_P(ResumeParity, EveryPlacementContinuesBitForBit) {
  const DType dtype = GetParam();
  TrainRun base;
  base.world = 2;
  base.steps = 8;
  base.gpt = small_gpt(dtype);
  base.opt.grad_dtype = dtype;
  base.opt.fp16.enabled = dtype == DType::kF16;
  const Outcome straight = train(base);
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  std::vector<Placement> placements = matrix();
  placements.insert(placements.begin(), Placement{0, OffloadDevice::kNone, OffloadDevice::kNone});
  for (const Placement& p : placements) {
    const std::string what = fmt::format("{} {}", dtype_name(dtype), p.name());
    const fs::path dir = fresh_dir("parity");
    TrainRun saving = base;
    apply_placement(saving, p);
    save_every(saving, dir, 2, /*keep=*/3);
    const Outcome with_saves = train(saving);
    expect_same_losses(straight, with_saves, what + " (saving every 2 steps)");
    if (::testing::Test::HasFatalFailure()) return;
    // --keep 3: the tags of steps 4, 6 and 8 remain, `latest` names step 8.
    EXPECT_FALSE(fs::exists(dir / "global_step2")) << what;
    ASSERT_TRUE(fs::exists(dir / "global_step4" / "manifest.json")) << what;
    TrainRun resumed = base;
    apply_placement(resumed, p);
    resume_from(resumed, dir / "global_step4");
    const Outcome cont = train(resumed);
    ASSERT_TRUE(cont.status.ok()) << what << ": " << cont.status.to_string();
    ASSERT_EQ(cont.losses.size(), 4u) << what;
    for (size_t i = 0; i < 4; ++i)
      ASSERT_EQ(std::bit_cast<uint64_t>(cont.losses[i]), std::bit_cast<uint64_t>(straight.losses[4 + i]))
          << what << ": resumed step " << 5 + i << " loss " << cont.losses[i] << " vs " << straight.losses[4 + i];
    ASSERT_EQ(cont.val, straight.val) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ResumeParity, ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// fp16 with an overflow before the save: the loss scale, its hysteresis and
// the skipped-step count travel with the checkpoint.
TEST(CheckpointResume, Fp16LossScaleStateContinues) {
  TrainRun base;
  base.world = 2;
  base.steps = 8;
  base.gpt = small_gpt(DType::kF16);
  base.opt.grad_dtype = DType::kF16;
  base.opt.fp16.enabled = true;
  base.opt.fp16.hysteresis = 2;
  base.faults.gradient = testing::GradientFault{.step = 2, .rank = 1, .value = std::numeric_limits<float>::infinity()};
  base.opt.stage = 2;
  base.opt.offload_optimizer = OffloadDevice::kCpu;
  const fs::path dir = fresh_dir("fp16");
  TrainRun saving = base;
  save_every(saving, dir, 3);
  const Outcome a = train(saving);
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();
  TrainRun resumed = base;
  resume_from(resumed, dir);  // `latest`: step 6
  const Outcome b = train(resumed);
  ASSERT_TRUE(b.status.ok()) << b.status.to_string();
  ASSERT_EQ(b.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::bit_cast<uint64_t>(b.losses[i]), std::bit_cast<uint64_t>(a.losses[6 + i])) << "step " << 7 + i;
    EXPECT_EQ(b.metrics[i].loss_scale, a.metrics[6 + i].loss_scale);
    EXPECT_EQ(b.metrics[i].step, a.metrics[6 + i].step);  // skipped steps are not counted twice
  }
  CheckpointReader rd = CheckpointReader::open(dir).value();
  EXPECT_EQ(rd.manifest().scalars.scaler_overflow_count, 1);
  EXPECT_EQ(rd.manifest().scalars.steps_begun, 6);
  EXPECT_EQ(rd.manifest().scalars.optimizer_steps, 5);
}

// Reshard: saved at one world size, stage and placement; loaded at another.
TEST(CheckpointReshard, AnyWorldSizeStageAndPlacement) {
  struct Case {
    int from_world, to_world;
    Placement from, to;
  };
  using D = OffloadDevice;
  const Case cases[] = {
      {2, 1, {3, D::kCpu, D::kCpu}, {0, D::kNone, D::kNone}},
      {1, 4, {0, D::kNone, D::kNone}, {3, D::kNvme, D::kNone, true, 4096}},
      {4, 2, {2, D::kCpu, D::kNone, true, 4096}, {1, D::kNone, D::kNone}},
  };
  TrainRun ref;  // the unsharded continuation
  ref.world = 1;
  ref.steps = 8;
  const Outcome straight = train(ref);
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  for (const Case& c : cases) {
    const std::string what = fmt::format("{} -> {} ranks", c.from_world, c.to_world);
    const fs::path dir = fresh_dir("reshard");
    TrainRun a = ref;
    a.world = c.from_world;
    a.steps = 4;
    apply_placement(a, c.from);
    save_every(a, dir, 4);
    ASSERT_TRUE(train(a).status.ok()) << what;
    TrainRun b = ref;
    b.world = c.to_world;
    apply_placement(b, c.to);
    resume_from(b, dir);
    const Outcome cont = train(b);
    ASSERT_TRUE(cont.status.ok()) << what << ": " << cont.status.to_string();
    ASSERT_EQ(cont.losses.size(), 4u) << what;
    for (size_t i = 0; i < 4; ++i)
      EXPECT_LE(std::abs(cont.losses[i] - straight.losses[4 + i]) / std::abs(straight.losses[4 + i]), 1e-5)
          << what << " step " << 5 + i;
  }
}

// One rank-2 save of the small GPT at step 2, for the damage tests.
fs::path saved_checkpoint(const std::string& name) {
  const fs::path dir = fresh_dir(name);
  TrainRun a;
  a.world = 2;
  a.steps = 2;
  a.opt.stage = 3;
  a.opt.offload_optimizer = OffloadDevice::kCpu;
  save_every(a, dir, 2);
  const Outcome o = train(a);
  EXPECT_TRUE(o.status.ok()) << o.status.to_string();
  return dir;
}

Status load_into_fresh(const fs::path& what, GptConfig gpt = small_gpt()) {
  TrainRun b;
  b.world = 1;
  b.steps = 3;
  b.gpt = gpt;
  resume_from(b, what);
  return train(b).status;
}

TEST(CheckpointDamage, FlippedByteIsNamedByVerifyAndLoad) {
  const fs::path dir = saved_checkpoint("flip");
  CheckpointReader ok = CheckpointReader::open(dir).value();
  EXPECT_TRUE(ok.verify().ok());
  const fs::path victim = dir / "global_step2" / "rank00001.optim";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.read(&c, 1);
    f.seekp(100);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  CheckpointReader rd = CheckpointReader::open(dir).value();
  const Status v = rd.verify();
  EXPECT_TRUE(v.is_data_loss()) << v.to_string();
  EXPECT_NE(v.message().find("rank00001.optim"), std::string::npos) << v.to_string();
  EXPECT_NE(v.message().find("layer 0"), std::string::npos) << v.to_string();
  const Status l = load_into_fresh(dir);
  EXPECT_TRUE(l.is_data_loss()) << l.to_string();
  EXPECT_NE(l.message().find("rank00001.optim"), std::string::npos) << l.to_string();
}

TEST(CheckpointDamage, TruncatedFileNewerVersionOtherShapeExistingTag) {
  const fs::path dir = saved_checkpoint("refuse");
  const fs::path tag = dir / "global_step2";
  // Another model shape: refused naming the layer.
  GptConfig other = small_gpt();
  other.n_embd = 64;
  const Status shape = load_into_fresh(dir, other);
  EXPECT_EQ(shape.code(), StatusCode::kFailedPrecondition) << shape.to_string();
  EXPECT_NE(shape.message().find("another model shape"), std::string::npos) << shape.to_string();
  // A newer format version.
  const std::string text = [&] {
    std::ifstream f(tag / "manifest.json");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();
  nlohmann::json j = nlohmann::json::parse(text);
  j["version"] = kCheckpointFormatVersion + 1;
  { std::ofstream(tag / "manifest.json") << j.dump(); }
  Result<CheckpointReader> newer = CheckpointReader::open(dir);
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(newer.status().message().find("newer"), std::string::npos) << newer.status().to_string();
  // An extent pointing outside its file; a layer not tiled.
  nlohmann::json bad = nlohmann::json::parse(text);
  bad["extents"][0][4] = uint64_t{1} << 40;
  { std::ofstream(tag / "manifest.json") << bad.dump(); }
  Result<CheckpointReader> outside = CheckpointReader::open(dir);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("extents[0]"), std::string::npos) << outside.status().to_string();
  bad = nlohmann::json::parse(text);
  bad["extents"].erase(0);
  { std::ofstream(tag / "manifest.json") << bad.dump(); }
  Result<CheckpointReader> gap = CheckpointReader::open(dir);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("layer 0"), std::string::npos) << gap.status().to_string();
  { std::ofstream(tag / "manifest.json") << text; }
  // A truncated shard: refused at open, naming the file.
  fs::resize_file(tag / "rank00000.model", 8);
  Result<CheckpointReader> trunc = CheckpointReader::open(dir);
  ASSERT_FALSE(trunc.ok());
  EXPECT_TRUE(trunc.status().is_data_loss());
  EXPECT_NE(trunc.status().message().find("rank00000.model"), std::string::npos) << trunc.status().to_string();
  // Saving over an existing tag: refused on every rank, nothing touched.
  const auto before = fs::last_write_time(tag / "manifest.json");
  TrainRun again;
  again.world = 2;
  again.steps = 2;
  save_every(again, dir, 2);
  const Outcome o = train(again);
  ASSERT_FALSE(o.status.ok());
  EXPECT_NE(o.status.message().find("already exists"), std::string::npos) << o.status.to_string();
  EXPECT_EQ(fs::last_write_time(tag / "manifest.json"), before);
  // Bad requests.
  TrainRun badtag;
  badtag.steps = 1;
  badtag.on_step = [&](Engine& e, int, int64_t) {
    CheckpointSaveOptions so;
    so.dir = dir.string();
    so.tag = "a/../../escape";
    return e.save_checkpoint(so).status();
  };
  const Outcome bt = train(badtag);
  ASSERT_FALSE(bt.status.ok());
  EXPECT_NE(bt.status.message().find("may hold only"), std::string::npos) << bt.status.to_string();
  const Status missing = load_into_fresh(fresh_dir("nothing-here") / "x");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.to_string();
}

// The recovery path for a failed step (issue 12): an EIO while the
// optimizer writes its NVMe state back fails the run; the latest checkpoint
// (saved asynchronously after every step) is a completed step's state, and
// resuming from it gives the losses of a run that never failed.
TEST(CheckpointRecovery, NvmeWriteErrorMidStepThenResumeFromLatest) {
  TrainRun base;
  base.world = 2;
  base.steps = 6;
  base.opt.stage = 2;
  base.opt.offload_optimizer = OffloadDevice::kNvme;
  base.opt.nvme.path = ::testing::TempDir();
  base.opt.nvme.pipeline_read = base.opt.nvme.pipeline_write = true;
  const Outcome straight = train(base);
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();

  FaultyEngines faults(2, /*reads=*/false, /*writes=*/true);
  const fs::path dir = fresh_dir("recovery");
  TrainRun faulty = base;
  save_every(faulty, dir, 1);
  faulty.after_step = [&](Engine& e, int64_t step) {
    if (step == 3) faults.counters[e.rank()]->arm(3);  // a few clean writes, then EIO
  };
  faulty.engine_for_rank = [&](int rank) { return faults[rank]; };
  const Outcome failed = train(faulty);
  ASSERT_FALSE(failed.status.ok());
  EXPECT_NE(failed.status.to_string().find("Input/output error"), std::string::npos) << failed.status.to_string();
  CheckpointReader latest = CheckpointReader::open(dir).value();
  const int64_t at = latest.manifest().scalars.steps_begun;
  EXPECT_GE(at, 2);  // the saves before the fault committed (step 3's write-backs may already fail)
  EXPECT_LT(at, 6);
  EXPECT_TRUE(latest.verify().ok());
  TrainRun resumed = base;
  resume_from(resumed, dir);
  const Outcome cont = train(resumed);
  ASSERT_TRUE(cont.status.ok()) << cont.status.to_string();
  ASSERT_EQ(cont.losses.size(), static_cast<size_t>(6 - at));
  for (size_t i = 0; i < cont.losses.size(); ++i)
    EXPECT_EQ(std::bit_cast<uint64_t>(cont.losses[i]), std::bit_cast<uint64_t>(straight.losses[at + i]))
        << "step " << at + 1 + i;
}

TEST(CheckpointMemory, HostMemoryDoesNotGrowWithSaves) {
  const fs::path dir = fresh_dir("memory");
  TrainRun r;
  r.world = 1;
  r.steps = 12;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  save_every(r, dir, 1, /*keep=*/2);
  const Outcome o = train(r);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  // The engine's host peaks (pinned, and pageable: the snapshot slots) are
  // the same after the 1st save as after the 11th.
  ASSERT_EQ(o.metrics.size(), 12u);
  EXPECT_GT(o.metrics[1].peak_host_bytes, o.metrics[0].peak_host_bytes);  // the slots exist
  EXPECT_EQ(o.metrics[1].peak_host_bytes, o.metrics.back().peak_host_bytes);
  EXPECT_EQ(o.metrics[1].peak_pinned_bytes, o.metrics.back().peak_pinned_bytes);
  // --keep 2: two tags and `latest` remain, no temporary folder.
  size_t tags = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
    if (e.is_directory()) ++tags;
  }
  EXPECT_EQ(tags, 2u);
}

// ------------------------------------------------------------ concurrency

// Every layer's state of the given kind, as gather_state returns it (a collective).
using LayerStates = std::vector<std::array<std::vector<float>, 3>>;
Result<LayerStates> gather_everything(Engine& e) {
  const size_t n = e.partition().layer_count();
  LayerStates out(n);
  // Last layer first: the snapshot walks the pieces the other way, so the two
  // meet on some piece.
  for (size_t li = n; li-- > 0;)
    for (int k = 0; k < 3; ++k) {
      STRATA_ASSIGN_OR_RETURN(out[li][k], e.gather_state(li, static_cast<Engine::StateKind>(k)));
    }
  return out;
}

// A checkpoint's state of every layer, in gather_state's form.
LayerStates read_checkpoint(const fs::path& tag, const LayerStates& shape) {
  CheckpointReader rd = CheckpointReader::open(tag).value();
  EXPECT_TRUE(rd.verify().ok()) << tag;
  LayerStates out = shape;
  for (size_t li = 0; li < out.size(); ++li)
    for (int k = 0; k < 3; ++k) {
      Status st = rd.read(li, static_cast<CheckpointState>(k), 0, out[li][k]);
      EXPECT_TRUE(st.ok()) << tag << ": " << st.to_string();
    }
  return out;
}

// save_checkpoint() queues its snapshot on the optimizer thread and returns;
// gather_state() and evaluate() right after it read the optimizer state from
// the driving thread while the snapshot reads it. The NVMe tier serializes
// the two (a piece open on one thread is waited for by the other): no piece
// is opened twice (that aborted the process), and every checkpoint holds
// exactly the state gather_state() read after the same step.
TEST(CheckpointConcurrency, GatherStateAndEvaluateRightAfterASaveOpenNoPieceTwice) {
  for (int world : {1, 2}) {
    SCOPED_TRACE(fmt::format("{} rank(s)", world));
    const fs::path dir = fresh_dir(fmt::format("concurrent-{}", world));
    TrainRun r;
    r.world = world;
    r.steps = 12;
    apply_placement(r, Placement{3, OffloadDevice::kNvme, OffloadDevice::kCpu, true, 1024});
    r.opt.nvme.buffer_count = 2;
    std::map<int64_t, LayerStates> gathered;  // rank 0's, per step
    std::mutex mu;
    r.on_step = [&](Engine& e, int rank, int64_t step) -> Status {
      CheckpointSaveOptions o;
      o.dir = dir.string();
      o.snapshot_slots = 1;  // the snapshot waits for the writer: it runs longer
      STRATA_RETURN_IF_ERROR(e.save_checkpoint(o).status());
      if (step % 3 == 0) STRATA_RETURN_IF_ERROR(e.evaluate().status());
      STRATA_ASSIGN_OR_RETURN(LayerStates states, gather_everything(e));
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        gathered[step] = std::move(states);
      }
      return Status::Ok();
    };
    r.on_end = [](Engine& e, int) { return e.wait_checkpoint().status(); };
    const Outcome o = train(r);
    ASSERT_TRUE(o.status.ok()) << o.status.to_string();
    ASSERT_EQ(gathered.size(), 12u);
    for (const auto& [step, states] : gathered) {
      const LayerStates saved = read_checkpoint(dir / default_checkpoint_tag(step), states);
      for (size_t li = 0; li < states.size(); ++li)
        for (int k = 0; k < 3; ++k)
          ASSERT_EQ(saved[li][k], states[li][k]) << "step " << step << " layer " << li << " state " << k;
    }
  }
}

// The step being saved is rolled back while its snapshot is taken: a
// write-back of the optimizer state fails (EIO) and evaluate(), called right
// after save_checkpoint(), reaches the commit point, which rolls every piece
// back to the step before while the snapshot may still read. The save fails
// (a checkpoint of half one step and half the other, or of the step before
// under this step's tag, is never committed), the repeated step saves the
// same tag again, and every committed checkpoint is bit for bit the one a
// run without faults saved. Who sees the write's error first (the snapshot
// or the commit point) is a race, so the fault comes back every other step.
TEST(CheckpointConcurrency, AStepRolledBackWhileItsSnapshotIsTakenIsNotSaved) {
  const int steps = 24;
  TrainRun base;
  base.world = 1;
  base.steps = steps;
  apply_placement(base, Placement{3, OffloadDevice::kNvme, OffloadDevice::kNone, true, 1024});
  base.opt.nvme.buffer_count = 2;
  // Saves after every step, then an evaluation; errors of saves and evaluations collected.
  struct Log {
    std::vector<std::string> failed_saves, failed_evals;
  };
  auto saving = [](TrainRun& r, const fs::path& dir, Log& log, std::function<void(Engine&)> before) {
    r.on_step = [dir, &log, before](Engine& e, int, int64_t) -> Status {
      if (before) before(e);
      Result<std::optional<CheckpointSaveDone>> done = e.wait_checkpoint();
      if (!done.ok()) log.failed_saves.push_back(done.status().to_string());
      CheckpointSaveOptions o;
      o.dir = dir.string();
      o.snapshot_slots = 1;  // the snapshot waits for the writer: it runs longer
      STRATA_RETURN_IF_ERROR(e.save_checkpoint(o).status());
      Result<double> v = e.evaluate();
      if (!v.ok()) log.failed_evals.push_back(v.status().to_string());
      return Status::Ok();
    };
    r.on_end = [&log](Engine& e, int) {
      Result<std::optional<CheckpointSaveDone>> done = e.wait_checkpoint();
      if (!done.ok()) log.failed_saves.push_back(done.status().to_string());
      return Status::Ok();
    };
  };
  const fs::path ref_dir = fresh_dir("rollback-ref");
  Log ref_log;
  TrainRun ref = base;
  saving(ref, ref_dir, ref_log, nullptr);
  const Outcome straight = train(ref);
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  ASSERT_TRUE(ref_log.failed_saves.empty() && ref_log.failed_evals.empty());

  FaultyEngines faults(1, /*reads=*/false, /*writes=*/true);
  const fs::path dir = fresh_dir("rollback");
  Log log;
  uint64_t armed = 0;
  TrainRun faulty = base;
  faulty.engine_for_rank = [&](int rank) { return faults[rank]; };
  saving(faulty, dir, log, [&](Engine& e) {
    if (e.steps_begun() % 2 == 0 || faults.eio() != armed) return;
    // This step's write-backs done and committed; of the next step's, all
    // but the last piece's pass.
    ASSERT_TRUE(e.synchronize().ok());
    uint64_t pieces = 0;
    const Partition& part = e.partition();
    for (size_t li = 0; li < part.layer_count(); ++li)
      for (const SubGroup& g : part.layer(li).groups) pieces += part.layer(li).piece_real(g, 0) > 0 ? 1 : 0;
    faults.counters[0]->arm(pieces - 1, 1);
    ++armed;
  });
  const Outcome o = train(faulty);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  const size_t failures = faults.eio();
  EXPECT_GE(failures, 6u);
  // Each failed write-back: one rolled-back step, its save failed.
  ASSERT_EQ(log.failed_evals.size(), failures);
  for (const std::string& e : log.failed_evals) EXPECT_NE(e.find("rolled back"), std::string::npos) << e;
  ASSERT_EQ(log.failed_saves.size(), failures);
  // Each committed tag holds what the run without faults saved under it.
  const int64_t last = steps - static_cast<int64_t>(failures);
  for (int64_t k = 1; k <= last; ++k) {
    const std::string tag = default_checkpoint_tag(k);
    ASSERT_TRUE(fs::exists(dir / tag / "manifest.json")) << tag;
    CheckpointReader want = CheckpointReader::open(ref_dir / tag).value();
    CheckpointReader got = CheckpointReader::open(dir / tag).value();
    EXPECT_TRUE(got.verify().ok()) << tag;
    EXPECT_EQ(got.manifest().scalars.optimizer_steps, want.manifest().scalars.optimizer_steps) << tag;
    for (size_t li = 0; li < want.manifest().layers.size(); ++li)
      for (CheckpointState kind : {CheckpointState::kMaster, CheckpointState::kExpAvg, CheckpointState::kExpAvgSq}) {
        std::vector<float> a(want.manifest().layers[li].elements), b(a.size());
        ASSERT_TRUE(want.read(li, kind, 0, a).ok());
        ASSERT_TRUE(got.read(li, kind, 0, b).ok());
        ASSERT_EQ(a, b) << tag << " layer " << li << " state " << static_cast<int>(kind);
      }
  }
}

// ------------------------------------------------------------ host budget

// The snapshot slots (snapshot_slots x the largest piece's fp32 state) are
// host memory of the engine: a save whose slots do not fit
// strata.host_memory_budget beside the pinned plan is refused before
// anything is written, naming the budget, the slots and the fix, and
// training goes on; a save that fits counts them in the host peak.
TEST(CheckpointMemory, SnapshotSlotsCountInTheHostBudget) {
  TrainRun r;
  r.world = 1;
  r.steps = 3;
  r.opt.stage = 2;
  r.opt.offload_optimizer = OffloadDevice::kCpu;
  // The plan: pinned memory, and one snapshot slot (the largest piece's fp32
  // master and moments, each part 4 KiB-aligned).
  EngineMemory plan;
  uint64_t largest = 0;
  {
    TrainRun probe = r;
    probe.steps = 1;
    probe.on_start = [&](Engine& e, int) -> Status {
      plan = e.predicted_memory();
      const Partition& part = e.partition();
      for (size_t li = 0; li < part.layer_count(); ++li)
        for (const SubGroup& g : part.layer(li).groups)
          largest = std::max<uint64_t>(largest, part.layer(li).piece_real(g, 0));
      return Status::Ok();
    };
    const Outcome o = train(probe);
    ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  }
  const uint64_t slot = (4 * largest + 4095) / 4096 * 4096 + (8 * largest + 4095) / 4096 * 4096;
  ASSERT_GT(plan.pinned, 0u);
  ASSERT_EQ(plan.snapshot_slot_bytes, slot);

  // Room for the plan and one slot, not two: a save with two is refused,
  // nothing is written, training goes on; one slot is saved.
  const fs::path dir = fresh_dir("budget");
  r.opt.host_memory_budget = plan.pinned + slot + slot / 2;
  std::vector<Status> refused;
  r.on_step = [&](Engine& e, int, int64_t step) -> Status {
    CheckpointSaveOptions o;
    o.dir = dir.string();
    o.sync = true;
    o.snapshot_slots = step == 1 ? 2 : 1;
    Result<CheckpointSaveInfo> saved = e.save_checkpoint(o);
    if (step == 1) {
      refused.push_back(saved.status());
      EXPECT_FALSE(fs::exists(dir)) << "a refused save wrote nothing";
      return Status::Ok();
    }
    return saved.status();
  };
  const Outcome o = train(r);
  ASSERT_TRUE(o.status.ok()) << o.status.to_string();
  ASSERT_EQ(o.losses.size(), 3u);
  ASSERT_EQ(refused.size(), 1u);
  const Status& st = refused[0];
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.to_string();
  for (const std::string& want : {std::string("strata.host_memory_budget"), std::string("--save-slots"),
                                  std::string("snapshot_slots"), format_bytes(2 * slot, true),
                                  format_bytes(r.opt.host_memory_budget, true)})
    EXPECT_NE(st.message().find(want), std::string::npos) << want << " in: " << st.message();
  // Step metrics are taken before the step's save: the refused save (step 1)
  // allocated nothing by step 2; the save of one slot counts it from step 3.
  EXPECT_EQ(o.metrics[1].peak_host_bytes, 0u);
  EXPECT_EQ(o.metrics[2].peak_host_bytes, slot);
  EXPECT_TRUE(fs::exists(dir / "global_step2" / "manifest.json"));
  EXPECT_EQ(CheckpointReader::open(dir).value().manifest().scalars.steps_begun, 3);
}

}  // namespace
}  // namespace strata::offload
