// The step-time model (strata/offload/step_time_model.h) and hardware
// profiles (hardware_profile.h) on their own: the overlap rules of Note [The
// engine's schedule, as a model], the bytes per link, and profile checks.
#include <gtest/gtest.h>

#include <algorithm>

#include <limits>

#include <nlohmann/json.hpp>

#include "strata/offload/hardware_profile.h"
#include "strata/offload/step_time_model.h"

namespace strata::offload {
namespace {

// Round numbers: 1 GFLOP per token and 1000 tokens at 1000 GFLOP/s is 1 s of compute.
HardwareProfile gpu_profile() {
  HardwareProfile p;
  p.gpus_per_node = 4;
  p.shared_cores = false;
  p.device_memory_bytes = p.host_memory_bytes = p.nvme_bytes = uint64_t{1} << 40;
  p.compute_gflops = 1000;
  p.h2d_gb_per_s = p.d2h_gb_per_s = 10;
  p.collective_bus_gb_per_s = 100;
  p.nvme_read_gb_per_s = 4;
  p.nvme_write_gb_per_s = 2;
  p.cpu_adam_params_per_s_fp32 = p.cpu_adam_params_per_s_bf16 = 4e9;
  p.device_adam_params_per_s = 100e9;
  return p;
}

StepTimeInput input(uint64_t params, int stage, OffloadDevice opt, OffloadDevice param = OffloadDevice::kNone) {
  StepTimeInput in;
  in.params = params;
  in.layers = 10;
  in.world = 1;
  in.tokens_per_rank = 1000;
  in.flops_per_token = 1e9;
  in.placement = {stage, opt, param};
  return in;
}

TEST(StepTimeModel, LinkBytesFollowTheEngine) {
  StepTimeInput in = input(1'000'000, 2, OffloadDevice::kCpu);
  in.world = 4;
  const LinkBytes b = predict_link_bytes(in);
  EXPECT_EQ(b.reduce, 2'000'000u);  // the full bf16 gradient, once
  EXPECT_EQ(b.gather, 2'000'000u);  // the updated parameters, all-gathered
  EXPECT_EQ(b.d2h, 500'000u);       // this rank's quarter of the gradient
  EXPECT_EQ(b.h2d, 500'000u);       // and of the updated parameters
  EXPECT_EQ(b.nvme_read, 0u);
  in.placement.stage = 0;
  in.placement.optimizer = OffloadDevice::kNone;
  EXPECT_EQ(predict_link_bytes(in).reduce, 4'000'000u);  // reduce-scatter and gather back
  EXPECT_EQ(predict_link_bytes(in).gather, 0u);
  in.placement.stage = 3;
  in.placement.optimizer = OffloadDevice::kNvme;
  EXPECT_EQ(predict_link_bytes(in).nvme_read, 12u * 250'000);  // master + m + v of the shard
  EXPECT_EQ(predict_link_bytes(in).nvme_write, 12u * 250'000);
  in.ratio = 0.5;
  in.placement.optimizer = OffloadDevice::kCpu;
  EXPECT_EQ(predict_link_bytes(in).d2h, 250'000u);  // only the host part's gradient
}

TEST(StepTimeModel, TheOptimizerHidesUnderTheForwardUntilItIsLonger) {
  const HardwareProfile hw = gpu_profile();
  // 1 s of compute: forward 333 ms. 1e9 parameters at 4e9/s = 250 ms of CPU Adam: hidden but for the
  // first of the 10 layers' update (Note [The first layer's update]): its step and its copy back (2 GB of
  // bf16 parameters at 10 GB/s: 200 ms in all).
  Result<StepTimePrediction> short_opt = predict_step_time(input(1'000'000'000, 1, OffloadDevice::kCpu), hw);
  ASSERT_TRUE(short_opt.ok()) << short_opt.status().to_string();
  EXPECT_NEAR(short_opt->compute_ms, 1000, 1e-9);
  EXPECT_NEAR(short_opt->optimizer_ms, 250, 1e-9);
  EXPECT_NEAR(short_opt->update_ms, 200, 1e-9);
  EXPECT_NEAR(short_opt->exposed_optimizer_ms, (250 + 200) / 10.0, 1e-9);
  // 2e9 parameters: 500 ms of Adam, 167 ms beyond the forward.
  Result<StepTimePrediction> long_opt = predict_step_time(input(2'000'000'000, 1, OffloadDevice::kCpu), hw);
  ASSERT_TRUE(long_opt.ok());
  EXPECT_NEAR(long_opt->exposed_optimizer_ms, 500 - 1000.0 / 3, 1e-6);
  EXPECT_NEAR(long_opt->step_ms, long_opt->compute_ms + long_opt->exposed_optimizer_ms + long_opt->exposed_reduce_ms +
                                     long_opt->exposed_gather_ms,
              1e-9);
  EXPECT_LE(long_opt->ideal_ms, long_opt->step_ms);
}

// Note [Early, exact updates]: the CPU step may start under the backward, so
// it hides under forward + backward; its copies to the device still follow
// the step's end and hide under the forward only.
TEST(StepTimeModel, EarlyUpdatesHideTheCpuStepUnderTheBackwardToo) {
  const HardwareProfile hw = gpu_profile();
  StepTimeInput in = input(2'000'000'000, 1, OffloadDevice::kCpu);
  const StepTimePrediction late = predict_step_time(in, hw).value();
  in.speculation = SpeculationMode::kOn;
  const StepTimePrediction early = predict_step_time(in, hw).value();
  EXPECT_NEAR(early.optimizer_ms, late.optimizer_ms, 1e-9);
  // The forward's first layer is among the last reduced: it still waits for that layer's step and copy.
  EXPECT_NEAR(early.exposed_optimizer_ms,
              std::max({(early.optimizer_ms + early.update_ms) / 10, early.optimizer_ms - early.compute_ms,
                        early.update_ms - early.forward_ms}),
              1e-6);
  EXPECT_LT(early.exposed_optimizer_ms, late.exposed_optimizer_ms);
  EXPECT_TRUE(early_updates_allowed(SpeculationMode::kAuto, Placement{1, OffloadDevice::kCpu}));
  EXPECT_FALSE(early_updates_allowed(SpeculationMode::kOff, Placement{1, OffloadDevice::kCpu}));
  EXPECT_TRUE(early_updates_allowed(SpeculationMode::kOn, Placement{1, OffloadDevice::kNvme}));
  EXPECT_FALSE(early_updates_allowed(SpeculationMode::kOn, Placement{1, OffloadDevice::kNone}));
  // auto runs them off the host's cores only (the engine's rule on the cpu device).
  HardwareProfile shared = hw;
  shared.shared_cores = true;
  in.speculation = SpeculationMode::kAuto;
  EXPECT_TRUE(early_updates_run(in, hw));
  EXPECT_FALSE(early_updates_run(in, shared));
  in.speculation = SpeculationMode::kOn;
  EXPECT_TRUE(early_updates_run(in, shared));
  in.placement.optimizer = OffloadDevice::kNone;
  EXPECT_FALSE(early_updates_run(in, hw));
}

// With offload_optimizer.ratio < 1 only the host part is stepped early; the
// device part starts at the step's end and hides under the forward alone.
TEST(StepTimeModel, WithARatioTheDevicePartHidesUnderTheForwardOnly) {
  HardwareProfile hw = gpu_profile();
  hw.device_adam_params_per_s = 5e9;  // a slow device step, so that its part shows
  hw.h2d_gb_per_s = 1000;             // and the copies do not
  StepTimeInput in = input(4'000'000'000, 3, OffloadDevice::kCpu);
  in.ratio = 0.5;
  const StepTimePrediction late = predict_step_time(in, hw).value();
  in.speculation = SpeculationMode::kOn;
  const StepTimePrediction early = predict_step_time(in, hw).value();
  const double host_ms = 2e9 / 4e9 * 1e3, device_ms = 2e9 / 5e9 * 1e3;  // 500 and 400 ms
  EXPECT_NEAR(late.optimizer_ms, std::max(host_ms, device_ms), 1e-6);
  EXPECT_NEAR(late.exposed_optimizer_ms, host_ms - late.forward_ms, 1e-6);
  // Early: the host part's 500 ms hide under forward + backward (1 s); the
  // device part's 400 ms run past the forward's 333 ms.
  EXPECT_NEAR(early.exposed_optimizer_ms, device_ms - early.forward_ms, 1e-6);
  EXPECT_LT(early.exposed_optimizer_ms, late.exposed_optimizer_ms);
}

TEST(StepTimeModel, RanksOfANodeShareItsCpuOptimizerAndDrives) {
  const HardwareProfile hw = gpu_profile();
  StepTimeInput in = input(4'000'000'000, 2, OffloadDevice::kCpu);
  in.world = 4;  // 1e9 parameters per rank, 4 ranks on the node's 4e9/s: 1 s each
  Result<StepTimePrediction> r = predict_step_time(in, hw);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->optimizer_ms, 1000, 1e-6);
  in.world = 8;  // two nodes: each node's 4 ranks step 0.5e9 each
  r = predict_step_time(in, hw);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->optimizer_ms, 500, 1e-6);
}

TEST(StepTimeModel, StageThreeRunsTheForwardBehindTheUpdates) {
  const HardwareProfile hw = gpu_profile();
  // 1e8 parameters: 1.2 GB of state read at 4 GB/s (300 ms) and written at 2 (600 ms) + 25 ms of Adam.
  Result<StepTimePrediction> s2 = predict_step_time(input(100'000'000, 2, OffloadDevice::kNvme), hw);
  Result<StepTimePrediction> s3 = predict_step_time(input(100'000'000, 3, OffloadDevice::kNvme), hw);
  ASSERT_TRUE(s2.ok() && s3.ok());
  EXPECT_NEAR(s2->optimizer_ms, 925, 1e-6);
  EXPECT_NEAR(s2->exposed_optimizer_ms, 925 - 1000.0 / 3, 1e-6);  // beyond the forward only
  // Stage 3: the forward gathers each layer after its update, so it waits
  // for the first layer's share of the host phase and then runs behind the
  // rest: longer than the forward, the same as stage 2.
  EXPECT_NEAR(s3->exposed_optimizer_ms, 925 - 1000.0 / 3, 1e-6);
  EXPECT_EQ(s3->bound, "nvme (optimizer state)");
  // Shorter than the forward (1e7 parameters: 90 ms of NVMe, 2.5 of Adam, 2
  // of copies back): at every stage the forward waits for the first of the 10
  // layers' share (Note [The first layer's update]), NVMe included without
  // the pipelines, the CPU step and the copy only with both.
  for (int stage : {2, 3}) {
    StepTimeInput in = input(10'000'000, stage, OffloadDevice::kNvme);
    EXPECT_NEAR(predict_step_time(in, hw).value().exposed_optimizer_ms, (90 + 2.5 + 2) / 10, 1e-6) << stage;
    in.nvme_pipeline = true;
    EXPECT_NEAR(predict_step_time(in, hw).value().exposed_optimizer_ms, (2.5 + 2) / 10, 1e-6) << stage;
    // A model whose first compute waits for more than one layer's update (a GPT: embeddings and first block).
    in.first_update_share = 0.25;
    EXPECT_NEAR(predict_step_time(in, hw).value().exposed_optimizer_ms, (2.5 + 2) * 0.25, 1e-6) << stage;
  }
}

TEST(StepTimeModel, Int8MomentsHalveTheNvmeBytesAndUseTheirOwnRate) {
  HardwareProfile hw = gpu_profile();
  StepTimeInput in = input(100'000'000, 3, OffloadDevice::kNvme);
  in.moments = cpu_adam::MomentStorage::int8();
  // 4 + 2 x (1 + 4/256) B per parameter: 603.125 MB read at 4 GB/s and written at 2.
  Result<StepTimePrediction> r = predict_step_time(in, hw);
  ASSERT_TRUE(r.ok());
  const double nvme_ms = 603.125e6 / 4e9 * 1e3 + 603.125e6 / 2e9 * 1e3;
  EXPECT_NEAR(r->exposed_optimizer_ms, nvme_ms + 25 - 1000.0 / 3, 1e-6);  // beyond the forward (stage 3: above)
  // No int8 rate in the profile: the bf16 rate (25 ms of Adam); with one, its own.
  EXPECT_NEAR(r->optimizer_ms, nvme_ms + 25, 1e-6);
  in.placement.optimizer = OffloadDevice::kCpu;
  hw.cpu_adam_params_per_s_int8 = 1e9;
  Result<StepTimePrediction> cpu = predict_step_time(in, hw);
  ASSERT_TRUE(cpu.ok());
  EXPECT_NEAR(cpu->optimizer_ms, 100, 1e-6);
}

// On shared cores the CPU step adds to the step whatever the schedule; the
// state's NVMe reads and writes (DMA) hide under the forward, and with early
// updates under the backward too.
TEST(StepTimeModel, SharedCoresHideTheStatesNvmePhaseUnderTheBackwardWithEarlyUpdates) {
  HardwareProfile hw = gpu_profile();
  hw.shared_cores = true;
  hw.gpus_per_node = 1;
  hw.nvme_read_gb_per_s = hw.nvme_write_gb_per_s = 20;  // 12 GB each way: 600 + 600 ms
  StepTimeInput in = input(1'000'000'000, 2, OffloadDevice::kNvme);
  const StepTimePrediction late = predict_step_time(in, hw).value();
  in.speculation = SpeculationMode::kOn;
  const StepTimePrediction early = predict_step_time(in, hw).value();
  const double nvme_ms = 2 * 12e9 / 20e9 * 1e3;
  const double cpu_ms = late.optimizer_ms - nvme_ms;
  EXPECT_NEAR(cpu_ms, 250, 1e-6);  // 1e9 parameters at 4e9/s
  EXPECT_NEAR(late.exposed_optimizer_ms, cpu_ms + late.update_ms + (nvme_ms - late.forward_ms), 1e-6);
  EXPECT_NEAR(early.exposed_optimizer_ms, cpu_ms + early.update_ms + (nvme_ms - early.compute_ms), 1e-6);
  EXPECT_LT(early.step_ms, late.step_ms);
  // The pipelines overlap the NVMe phase with the CPU step, which saves no
  // time on the cores: the cores' part is still the whole CPU step.
  in.speculation = SpeculationMode::kOff;
  in.nvme_pipeline = true;
  const StepTimePrediction piped = predict_step_time(in, hw).value();
  EXPECT_NEAR(piped.optimizer_ms, std::max(cpu_ms, nvme_ms), 1e-6);
  EXPECT_NEAR(piped.exposed_optimizer_ms, late.exposed_optimizer_ms, 1e-6);
}

TEST(StepTimeModel, SharedCoresHideNothingButNvme) {
  HardwareProfile hw = gpu_profile();
  hw.shared_cores = true;
  hw.gpus_per_node = 1;
  Result<StepTimePrediction> r = predict_step_time(input(1'000'000'000, 1, OffloadDevice::kCpu), hw);
  ASSERT_TRUE(r.ok());
  // Adam (250 ms) and every transfer add to the compute.
  EXPECT_NEAR(r->exposed_optimizer_ms, r->optimizer_ms + r->update_ms, 1e-9);
  EXPECT_NEAR(r->exposed_reduce_ms, r->grad_ms, 1e-9);
  EXPECT_GT(r->step_ms, r->compute_ms + 250);
  // Two local ranks share the cores: the same per-rank tokens take twice the compute.
  StepTimeInput two = input(1'000'000'000, 1, OffloadDevice::kCpu);
  two.world = 2;
  Result<StepTimePrediction> r2 = predict_step_time(two, hw);
  ASSERT_TRUE(r2.ok());
  EXPECT_NEAR(r2->compute_ms, 2 * r->compute_ms, 1e-9);
}

// The cpu device with the optimizer on cores of its own (strata train
// --device-threads D --optimizer-threads K, D + K <= cores): the CPU step and
// the state's NVMe phase hide under the compute as on a GPU machine, while
// the ranks still share the cores (the compute of two local ranks doubles).
TEST(StepTimeModel, AnOptimizerOnItsOwnCoresHidesUnderTheCompute) {
  HardwareProfile shared = gpu_profile();
  shared.shared_cores = true;
  shared.gpus_per_node = 1;
  HardwareProfile own = shared;
  own.optimizer_on_own_cores = true;
  for (OffloadDevice where : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    StepTimeInput in = input(1'000'000'000, 2, where);
    in.speculation = SpeculationMode::kOn;
    const StepTimePrediction serial = predict_step_time(in, shared).value();
    const StepTimePrediction apart = predict_step_time(in, own).value();
    EXPECT_NEAR(apart.compute_ms, serial.compute_ms, 1e-9);
    // Each part alone: the longer of the two, not the sum.
    EXPECT_NEAR(apart.optimizer_ms, serial.optimizer_ms, 1e-6);  // no device part at ratio 1
    EXPECT_LT(apart.exposed_optimizer_ms, serial.exposed_optimizer_ms);
    // The CPU step (250 ms) under the 1 s of forward + backward but for the first layer's step and copy
    // back (200 ms, a tenth of each); the nvme row's 9 s of NVMe do not fit.
    if (where == OffloadDevice::kCpu) {
      EXPECT_NEAR(apart.exposed_optimizer_ms, (250 + 200) / 10.0, 1e-6);
    }
    EXPECT_LT(apart.step_ms, serial.step_ms);
  }
  StepTimeInput two = input(1'000'000'000, 1, OffloadDevice::kCpu);
  two.world = 2;
  EXPECT_NEAR(predict_step_time(two, own).value().compute_ms, predict_step_time(two, shared).value().compute_ms,
              1e-9);
}

TEST(StepTimeModel, SharedCoresAtWorldOneQueueNoCollective) {
  // The engine queues no collective for one rank (the sum over one rank is
  // the gradient itself): nothing to charge. Two local ranks: (N-1)/N of the
  // bytes at the busbw `strata report --calibrate` measured with both ranks
  // running (the sharing of the cores is in that rate already).
  HardwareProfile hw = gpu_profile();
  hw.shared_cores = true;
  hw.gpus_per_node = 1;
  Result<StepTimePrediction> one = predict_step_time(input(100'000'000, 0, OffloadDevice::kNone), hw);
  ASSERT_TRUE(one.ok());
  EXPECT_GT(one->bytes.reduce, 0u);  // the bytes are counted as the collectives would move them
  EXPECT_NEAR(one->grad_ms, 0, 1e-9);
  StepTimeInput two = input(100'000'000, 0, OffloadDevice::kNone);
  two.world = 2;
  Result<StepTimePrediction> both = predict_step_time(two, hw);
  ASSERT_TRUE(both.ok());
  EXPECT_NEAR(both->grad_ms, 0.5 * static_cast<double>(both->bytes.reduce) / (hw.collective_bus_gb_per_s * 1e9) * 1e3,
              1e-9);
}

TEST(StepTimeModel, OutOfRangeInputsNameTheField) {
  const HardwareProfile hw = gpu_profile();
  StepTimeInput in = input(1000, 1, OffloadDevice::kCpu);
  in.ratio = 1.5;
  EXPECT_NE(predict_step_time(in, hw).status().message().find("ratio 1.5"), std::string::npos);
  in = input(0, 1, OffloadDevice::kCpu);
  EXPECT_NE(predict_step_time(in, hw).status().message().find("params"), std::string::npos);
  in = input(1000, 4, OffloadDevice::kCpu);
  EXPECT_NE(predict_step_time(in, hw).status().message().find("stage 4"), std::string::npos);
  in = input(1000, 1, OffloadDevice::kCpu);
  in.first_update_share = 1.5;
  EXPECT_NE(predict_step_time(in, hw).status().message().find("first_update_share 1.5"), std::string::npos);
}

TEST(HardwareProfile, RoundTripsAndRejectsBadRates) {
  const nlohmann::json j = hardware_profile_to_json(gpu_profile());
  Result<HardwareProfile> back = parse_hardware_profile(j, "p.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->gpus_per_node, 4);
  EXPECT_EQ(back->nvme_write_gb_per_s, 2);
  nlohmann::json bad = j;
  bad["h2d_gb_per_s"] = -3;
  EXPECT_NE(parse_hardware_profile(bad, "p.json").status().message().find("p.json: \"h2d_gb_per_s\" is -3"),
            std::string::npos);
  bad = j;
  bad.erase("compute_gflops");
  EXPECT_NE(parse_hardware_profile(bad, "p.json").status().message().find("\"compute_gflops\" is missing"),
            std::string::npos);
  bad = j;
  bad["nvme_read_gbps"] = 1;
  EXPECT_NE(parse_hardware_profile(bad, "p.json").status().message().find("unknown key \"nvme_read_gbps\""),
            std::string::npos);
  bad = j;
  bad["collective_bus_gb_per_s"] = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(parse_hardware_profile(bad, "p.json").ok());
  // The 8-bit moments' rate is optional, and round-trips when given.
  EXPECT_EQ(back->cpu_adam_params_per_s_int8, 0);
  nlohmann::json with_int8 = j;
  with_int8["cpu_adam_params_per_s"]["int8"] = 2.5e9;
  Result<HardwareProfile> eight = parse_hardware_profile(with_int8, "p.json");
  ASSERT_TRUE(eight.ok()) << eight.status().to_string();
  EXPECT_EQ(eight->cpu_adam_params_per_s_int8, 2.5e9);
  EXPECT_EQ(hardware_profile_to_json(*eight)["cpu_adam_params_per_s"]["int8"], 2.5e9);
  with_int8["cpu_adam_params_per_s"]["int8"] = 0;
  EXPECT_NE(parse_hardware_profile(with_int8, "p.json").status().message().find("int8"), std::string::npos);
}

TEST(HardwareProfile, OptimizerOnOwnCoresIsABooleanOfSharedCores) {
  HardwareProfile p = gpu_profile();
  p.shared_cores = true;
  p.optimizer_on_own_cores = true;
  const nlohmann::json j = hardware_profile_to_json(p);
  Result<HardwareProfile> back = parse_hardware_profile(j, "p.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(back->optimizer_on_own_cores);
  EXPECT_FALSE(hardware_profile_to_json(gpu_profile()).contains("optimizer_on_own_cores"));  // absent: false
  nlohmann::json bad = j;
  bad["optimizer_on_own_cores"] = "yes";
  EXPECT_NE(parse_hardware_profile(bad, "p.json").status().message().find("\"optimizer_on_own_cores\" is \"yes\""),
            std::string::npos);
  bad = j;
  bad["shared_cores"] = false;
  EXPECT_NE(parse_hardware_profile(bad, "p.json").status().message().find("needs \"shared_cores\": true"),
            std::string::npos);
}

// bench offload's note when the rows run other thread counts than the profile was timed at.
TEST(HardwareProfile, ThreadCountNoteNamesTheRecalibration) {
  HardwareProfile p = gpu_profile();
  p.shared_cores = true;
  EXPECT_EQ(thread_count_note(p, 1, 1), "");  // no calibration section: nothing to compare
  p.calibration = {{"compute", {{"device_threads", 1}}}, {"cpu_adam", {{"optimizer_threads", 1}}}};
  p.name = "vm";
  EXPECT_EQ(thread_count_note(p, 1, 1), "");
  const std::string note = thread_count_note(p, 0, 1);
  EXPECT_NE(note.find("compute on 1 and the optimizer on 1 thread(s), these rows run every core and 1"),
            std::string::npos)
      << note;
  EXPECT_NE(note.find("--calibrate-device-threads 0 --calibrate-optimizer-threads 1"), std::string::npos) << note;
  // A profile from before these keys: both on every core.
  p.calibration = {{"compute", {{"dtype", "fp32"}}}};
  EXPECT_EQ(thread_count_note(p, 0, 0), "");
  EXPECT_NE(thread_count_note(p, 1, 1), "");
  p.shared_cores = false;  // a GPU machine: the cpu device's threads do not apply
  EXPECT_EQ(thread_count_note(p, 1, 1), "");
}

}  // namespace
}  // namespace strata::offload
