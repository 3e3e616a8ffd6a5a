// Checkpoints of a model with a frozen layer (Note [Frozen layers in
// checkpoints] in checkpoint.h), the MLP of mlp_model.h driven from the test:
//  - the frozen layer is listed as frozen and not stored; a run resumed
//    from the checkpoint (the frozen values put again, as a caller that
//    rebuilds its model does) has the losses, evaluation losses (which check
//    the frozen layer's bytes) and master weights of the run that never
//    stopped, bit for bit, across world sizes, stages and placements;
//  - a checkpoint whose frozen layers are not the model's is refused naming
//    the layer; so is a load before the frozen values are put;
//  - a manifest that gives a frozen layer extents, or a "frozen" that is not
//    a boolean, is refused;
//  - a load that fails part-way (a damaged extent of a later layer) leaves
//    the engine refusing every step, save and use of a trained layer until
//    a load succeeds (Note [A failed load] in engine.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "driven_harness.h"
#include "strata/offload/checkpoint.h"

namespace strata::offload {
namespace {

struct ResumeCase {
  std::string name;
  int save_world, load_world;
  int save_stage, load_stage;
  OffloadDevice save_optimizer, save_param, load_optimizer, load_param;
};

void place(EngineOptions& o, int stage, OffloadDevice optimizer, OffloadDevice param) {
  o.stage = stage;
  o.offload_optimizer = optimizer;
  o.offload_param = param;
  if (optimizer == OffloadDevice::kNvme) {
    o.nvme.path = ::testing::TempDir();
    o.nvme.buffer_count = 2;
  }
  if (param == OffloadDevice::kNvme) {
    o.nvme_param.path = ::testing::TempDir();
    o.nvme_param.buffer_count = 2;
    o.nvme_param.max_in_cpu = 0;
  }
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/strata_driven_ckpt_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

class DrivenFrozenResume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(DrivenFrozenResume, TheFrozenLayerIsNotStoredAndTheResumedRunIsBitIdentical) {
  const ResumeCase& c = GetParam();
  const std::string dir = fresh_dir(c.name);
  DrivenRun whole;
  whole.world = c.save_world;
  whole.steps = 8;
  whole.eval_every = 4;
  whole.save_dir = dir;
  whole.save_at = 4;
  whole.label = c.name + " (whole run)";
  place(whole.opt, c.save_stage, c.save_optimizer, c.save_param);
  const DrivenOutcome a = drive(whole);
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();

  Result<CheckpointReader> reader = CheckpointReader::open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  const CheckpointManifest& m = reader->manifest();
  ASSERT_EQ(m.layers.size(), mlp::kLayerCount);
  for (size_t li = 0; li < mlp::kLayerCount; ++li) EXPECT_EQ(m.layers[li].frozen, li == mlp::kFrozen) << li;
  for (const CheckpointExtent& e : m.extents) EXPECT_NE(e.layer, mlp::kFrozen) << "an extent of the frozen layer";
  std::vector<float> out(4);
  const Status frozen_read = reader->read(mlp::kFrozen, CheckpointState::kMaster, 0, out);
  EXPECT_EQ(frozen_read.code(), StatusCode::kFailedPrecondition) << frozen_read.to_string();
  EXPECT_NE(frozen_read.message().find("'frozen'"), std::string::npos) << frozen_read.to_string();

  DrivenRun resumed;
  resumed.world = c.load_world;
  resumed.steps = 8;
  resumed.eval_every = 4;
  resumed.load_dir = dir;
  resumed.first_step = 5;
  resumed.label = c.name + " (resumed)";
  place(resumed.opt, c.load_stage, c.load_optimizer, c.load_param);
  const DrivenOutcome b = drive(resumed);
  ASSERT_TRUE(b.status.ok()) << b.status.to_string();
  if (c.save_world == c.load_world) {
    ASSERT_EQ(b.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b.losses[i], a.losses[4 + i]) << "step " << 5 + i;
    EXPECT_EQ(b.evals.back(), a.evals.back());
    for (size_t li = 0; li < mlp::kLayerCount; ++li) EXPECT_EQ(b.masters[li], a.masters[li]) << "layer " << li;
  } else {
    // Another world size sums the gradients of other batch splits: the resumed run is its own (and its
    // evaluations checked the frozen layer's bytes); it trains on from the saved state.
    ASSERT_EQ(b.losses.size(), 4u);
    EXPECT_LT(std::abs(b.losses[0] - a.losses[4]), 0.05 * std::abs(a.losses[4]));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, DrivenFrozenResume,
    ::testing::Values(
        ResumeCase{"stage0_world1", 1, 1, 0, 0, OffloadDevice::kNone, OffloadDevice::kNone, OffloadDevice::kNone,
                   OffloadDevice::kNone},
        ResumeCase{"stage3_nvme_world2_to_stage1_cpu", 2, 2, 3, 1, OffloadDevice::kNvme, OffloadDevice::kNvme,
                   OffloadDevice::kCpu, OffloadDevice::kNone},
        ResumeCase{"stage2_cpu_world2_to_stage3_cpu_world1", 2, 1, 2, 3, OffloadDevice::kCpu, OffloadDevice::kNone,
                   OffloadDevice::kCpu, OffloadDevice::kCpu}),
    [](const ::testing::TestParamInfo<ResumeCase>& info) { return info.param.name; });

// A two-layer model whose layer "b" is frozen or not; its initial values put.
struct SmallModel {
  std::unique_ptr<Device> device;
  std::unique_ptr<SpecModel> spec;
  std::unique_ptr<Engine> engine;
};

Result<SmallModel> small_model(bool b_frozen, comm::Communicator& comm, bool put_b = true) {
  SmallModel s;
  DeviceOptions dopt;
  dopt.device_memory_bytes = uint64_t{16} << 20;
  STRATA_ASSIGN_OR_RETURN(s.device, make_device(DeviceKind::kCpu, dopt));
  STRATA_ASSIGN_OR_RETURN(SpecModel m, SpecModel::create({{"a", {mlp::tensor("a.weight", {8, 8}, DType::kF32)}},
                                                           {"b", {mlp::tensor("b.weight", {8, 8}, DType::kF32,
                                                                              /*trainable=*/!b_frozen)}}}));
  s.spec = std::make_unique<SpecModel>(std::move(m));
  EngineOptions o = base_options();
  STRATA_ASSIGN_OR_RETURN(s.engine, Engine::create(o, *s.spec, *s.device, comm));
  std::vector<float> values(64, 0.25f);
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(values.data()), 64 * sizeof(float));
  STRATA_RETURN_IF_ERROR(s.engine->put_initial_layer(0, bytes, values));
  if (put_b) STRATA_RETURN_IF_ERROR(s.engine->put_initial_layer(1, bytes, values));
  return s;
}

TEST(DrivenFrozenCheckpoint, ACheckpointWhoseFrozenLayersAreNotTheModelsIsRefusedNamingTheLayer) {
  auto comms = comm::create_local_group(1).value();
  const std::string dir = fresh_dir("mismatch");
  {
    Result<SmallModel> saver = small_model(/*b_frozen=*/true, *comms[0]);
    ASSERT_TRUE(saver.ok()) << saver.status().to_string();
    Result<CheckpointSaveInfo> saved = saver->engine->save_checkpoint(sync_save(dir));
    ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  }
  {
    Result<SmallModel> trained_here = small_model(/*b_frozen=*/false, *comms[0]);
    ASSERT_TRUE(trained_here.ok());
    const Status st = trained_here->engine->load_checkpoint(dir).status();
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find("layer 1 ('b') is frozen there and trained in this model"), std::string::npos)
        << st.to_string();
  }
  {
    Result<SmallModel> not_put = small_model(/*b_frozen=*/true, *comms[0], /*put_b=*/false);
    ASSERT_TRUE(not_put.ok());
    const Status st = not_put->engine->load_checkpoint(dir).status();
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
    EXPECT_NE(st.message().find("is frozen and has no values yet"), std::string::npos) << st.to_string();
  }
  // The other way: saved with "b" trained, loaded where it is frozen.
  const std::string dir2 = fresh_dir("mismatch_trained");
  {
    Result<SmallModel> saver = small_model(/*b_frozen=*/false, *comms[0]);
    ASSERT_TRUE(saver.ok());
    ASSERT_TRUE(saver->engine->save_checkpoint(sync_save(dir2)).ok());
  }
  Result<SmallModel> frozen_here = small_model(/*b_frozen=*/true, *comms[0]);
  ASSERT_TRUE(frozen_here.ok());
  const Status st = frozen_here->engine->load_checkpoint(dir2).status();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("is trained there and frozen in this model"), std::string::npos) << st.to_string();
}

TEST(DrivenFrozenCheckpoint, AManifestGivingAFrozenLayerExtentsOrABadFrozenIsRefused) {
  auto comms = comm::create_local_group(1).value();
  const std::string dir = fresh_dir("manifest");
  {
    Result<SmallModel> saver = small_model(/*b_frozen=*/true, *comms[0]);
    ASSERT_TRUE(saver.ok());
    ASSERT_TRUE(saver->engine->save_checkpoint(sync_save(dir)).ok());
  }
  Result<CheckpointReader> reader = CheckpointReader::open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  const nlohmann::json good = reader->manifest().to_json();
  ASSERT_TRUE(good["layers"][1].value("frozen", false));
  ASSERT_FALSE(good["layers"][0].contains("frozen"));  // trained layers keep the older form
  {
    nlohmann::json bad = good;
    bad["layers"][1]["frozen"] = "yes";
    const Status st = CheckpointManifest::from_json(bad, "m.json").status();
    EXPECT_NE(st.message().find("layers[1].frozen is not true or false"), std::string::npos) << st.to_string();
  }
  {
    nlohmann::json bad = good;
    bad["layers"][0]["frozen"] = true;  // layer 0's extents now belong to a frozen layer
    const Status st = CheckpointManifest::from_json(bad, "m.json").status();
    EXPECT_NE(st.message().find("layer 0 is frozen, which a checkpoint stores no extents of"), std::string::npos)
        << st.to_string();
  }
}

// Note [A failed load] in engine.h: a byte flipped in a later layer's extent
// fails the load after the layers before it were written. The error names
// the file, the offset and the layer; from then on every step, save, and use
// of a trained layer is refused saying that a load failed (the frozen
// layer, which no load writes, stays readable), until a load of an intact
// checkpoint succeeds, after which the run is the one that never stopped.
class DrivenFailedLoad : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(DrivenFailedLoad, ADamagedLaterLayerIsRefusedAndEveryUseWaitsForALoadThatSucceeds) {
  const ResumeCase& c = GetParam();
  const std::string good = fresh_dir("failed_load_good_" + c.name);
  DrivenRun whole;
  whole.steps = 6;
  whole.eval_every = 0;
  whole.save_dir = good;
  whole.save_at = 3;
  whole.label = c.name + " (whole run)";
  place(whole.opt, c.save_stage, c.save_optimizer, c.save_param);
  const DrivenOutcome a = drive(whole);
  ASSERT_TRUE(a.status.ok()) << a.status.to_string();

  // A copy of the tag with one byte of the head's master weights flipped (the last layer: every layer before
  // it is written by the time its extent is read).
  Result<CheckpointReader> reader = CheckpointReader::open(good);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  const CheckpointManifest& m = reader->manifest();
  const std::string bad = fresh_dir("failed_load_bad_" + c.name);
  std::filesystem::create_directories(bad);
  std::filesystem::copy(reader->folder(), bad + "/" + m.tag);
  const CheckpointExtent* head = nullptr;
  for (const CheckpointExtent& e : m.extents)
    if (e.layer == mlp::kHead && m.files[e.file].model) head = &e;
  ASSERT_NE(head, nullptr);
  const std::string damaged = bad + "/" + m.tag + "/" + m.files[head->file].name;
  {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(head->offset + 5));
    const char byte = static_cast<char>(f.get() ^ 0x40);
    f.seekp(static_cast<std::streamoff>(head->offset + 5));
    f.put(byte);
  }

  auto comms = comm::create_local_group(1).value();
  EngineOptions opt = base_options();
  place(opt, c.load_stage, c.load_optimizer, c.load_param);
  Result<std::unique_ptr<DrivenRank>> made = DrivenRank::create(opt, whole.spec, *comms[0]);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  DrivenRank& d = **made;
  Engine& e = d.engine();
  ASSERT_TRUE(d.put_all().ok());
  const Status failed = e.load_checkpoint(bad + "/" + m.tag).status();
  ASSERT_EQ(failed.code(), StatusCode::kDataLoss) << failed.to_string();
  for (const std::string& part : {std::string(m.files[head->file].name), fmt::format("extent at byte {}", head->offset),
                                  fmt::format("layer {} '{}'", mlp::kHead, m.layers[mlp::kHead].name)})
    EXPECT_NE(failed.message().find(part), std::string::npos) << part << " in " << failed.to_string();

  auto expect_refused = [&](const Status& st, const char* call) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << call << ": " << st.to_string();
    EXPECT_NE(st.message().find("load_checkpoint('"), std::string::npos) << call << ": " << st.to_string();
    EXPECT_NE(st.message().find("failed after it had begun to write this engine's state"), std::string::npos)
        << call << ": " << st.to_string();
    EXPECT_NE(st.message().find("does not match its checksum"), std::string::npos) << call << ": " << st.to_string();
  };
  expect_refused(e.begin_step(), "begin_step()");
  expect_refused(e.save_checkpoint(sync_save(fresh_dir("failed_load_save_" + c.name))).status(), "save_checkpoint()");
  expect_refused(e.gather_state(mlp::kEmbedIn).status(), "gather_state(trained layer)");
  EXPECT_TRUE(e.gather_state(mlp::kFrozen).ok()) << "the frozen layer, which no load writes, stays readable";
  ASSERT_TRUE(e.begin_evaluation().ok());
  expect_refused(e.acquire(mlp::kHead, Pass::kEval).status(), "acquire(trained layer) in an evaluation");
  EXPECT_TRUE(e.acquire(mlp::kFrozen, Pass::kEval).ok());
  ASSERT_TRUE(e.release(mlp::kFrozen, Pass::kEval, Completion::ready()).ok());
  ASSERT_TRUE(e.finish_evaluation(0.0, 1).ok());
  expect_refused(e.begin_step(), "begin_step() again");

  // The intact tag loads: the run goes on as the one that never stopped.
  ASSERT_TRUE(e.load_checkpoint(good).ok());
  for (int64_t s = 4; s <= whole.steps; ++s) {
    Result<StepMetrics> step = d.step(s);
    ASSERT_TRUE(step.ok()) << step.status().to_string();
    EXPECT_EQ(step->loss, a.losses[static_cast<size_t>(s - 1)]) << "step " << s;
  }
  ASSERT_TRUE(e.synchronize().ok());
  for (size_t li : {size_t{mlp::kEmbedIn}, size_t{mlp::kCond}, size_t{mlp::kHead}}) {
    Result<std::vector<float>> master = e.gather_state(li);
    ASSERT_TRUE(master.ok()) << master.status().to_string();
    EXPECT_EQ(*master, a.masters[li]) << "layer " << li;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, DrivenFailedLoad,
    ::testing::Values(ResumeCase{"stage2_cpu", 1, 1, 2, 2, OffloadDevice::kCpu, OffloadDevice::kNone,
                                 OffloadDevice::kCpu, OffloadDevice::kNone},
                      ResumeCase{"stage3_nvme", 1, 1, 3, 3, OffloadDevice::kNvme, OffloadDevice::kNvme,
                                 OffloadDevice::kNvme, OffloadDevice::kNvme}),
    [](const ::testing::TestParamInfo<ResumeCase>& info) { return info.param.name; });

}  // namespace
}  // namespace strata::offload
