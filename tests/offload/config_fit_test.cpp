// The config fit (offload/config_fit.h): the search over placements and
// knobs against the engine's own memory plan, on GPT-shaped layer specs of
// several sizes, caps and world sizes, and its refusals of bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "strata/offload/config_fit.h"
#include "strata/offload/partition.h"
#include "strata/offload/state_placement.h"

namespace strata::offload {
namespace {

// The reference GPT's layers (model/gpt.h): the embedding, the blocks, the final norm, one flat tensor each.
std::vector<LayerSpec> gpt_layers(int64_t vocab, int64_t max_seq, int64_t embd, int blocks) {
  auto layer = [](std::string name, int64_t count) {
    LayerSpec l;
    l.name = name;
    ParamTensorSpec t;
    t.name = name;
    t.name += ".flat";
    t.shape = {count};
    t.dtype = DType::kF32;
    l.params.push_back(t);
    l.param_count = static_cast<size_t>(count);
    l.param_bytes = l.param_count * 4;
    return l;
  };
  const int64_t C = embd;
  std::vector<LayerSpec> out{layer("embedding", (vocab + max_seq) * C)};
  for (int i = 0; i < blocks; ++i) {
    std::string name = "h";
    name += std::to_string(i);
    out.push_back(layer(name, 12 * C * C + 13 * C));
  }
  out.push_back(layer("final_norm", 2 * C));
  return out;
}

uint64_t elements(const std::vector<LayerSpec>& layers) {
  uint64_t n = 0;
  for (const LayerSpec& l : layers) n += l.param_count;
  return n;
}

HardwareProfile cpu_profile() {
  HardwareProfile p;
  p.name = "test cpu";
  p.shared_cores = true;
  p.device_memory_bytes = p.host_memory_bytes = p.nvme_bytes = uint64_t{1} << 40;
  p.compute_gflops = 20;
  p.h2d_gb_per_s = p.d2h_gb_per_s = p.collective_bus_gb_per_s = 5;
  p.nvme_read_gb_per_s = 1;
  p.nvme_write_gb_per_s = 0.5;
  p.cpu_adam_params_per_s_fp32 = 4e8;
  p.cpu_adam_params_per_s_bf16 = 3e8;
  p.device_adam_params_per_s = 4e8;
  return p;
}

FitRequest request(std::vector<LayerSpec> layers, Config config, int world, uint64_t reserve = 0) {
  FitRequest r;
  r.layers = std::move(layers);
  r.config = std::move(config);
  r.world = world;
  r.micro_batch = 1;
  r.seq = 64;
  r.flops_per_token = 6.0 * static_cast<double>(elements(r.layers));
  r.device_reserve = [reserve](DType, DType, int) { return reserve; };
  r.profile = cpu_profile();
  return r;
}

Config stage3_nvme() {
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.nvme_path = "/nvme";
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_param.nvme_path = "/nvme";
  return c;
}

// The fitted config's plan, recomputed here for every rank from the
// candidate's options, against the caps (the fit's own claim re-checked).
void expect_plan_within_caps(const FitRequest& req, const FitCaps& caps, const FitCandidate& c, uint64_t reserve) {
  const DType dtype = c.config.precision_dtype();
  std::vector<LayerSpec> layers = req.layers;
  for (LayerSpec& l : layers)
    for (ParamTensorSpec& t : l.params) {
      t.dtype = dtype;
      t.offset_bytes = t.offset_elements * dtype_size(dtype);
    }
  for (int r = 0; r < req.world; ++r) {
    Result<EngineMemory> m = plan_engine_memory(c.options, layers, req.world, r, PlannedDevice::cpu());
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_LE(m->device + reserve, caps.device_bytes) << c.label << " rank " << r;
    EXPECT_LE(m->pinned * caps.ranks_per_node, caps.host_bytes) << c.label << " rank " << r;
    if (m->nvme != 0) {
      ASSERT_TRUE(caps.nvme_bytes.has_value());
      EXPECT_LE(m->nvme * caps.ranks_per_node, *caps.nvme_bytes) << c.label;
    }
  }
}

// The issue's case: a 113M-parameter GPT (gpt2 widths, 16 blocks, byte
// vocabulary), the device capped at 1/8 and the host at 1/2 of its
// training state (16 B/param), stage 3 with optimizer and parameters on
// NVMe and DeepSpeed's default knobs.
TEST(ConfigFit, IssueCase113MOnNvmeFitsWithBf16) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 1024, 768, 16);
  const uint64_t state = 16 * elements(layers);
  ASSERT_GT(elements(layers), 113'000'000u);
  FitCaps caps;
  caps.device_bytes = state / 8;
  caps.host_bytes = state / 2;
  caps.nvme_bytes = uint64_t{64} << 30;
  caps.nvme_path = "/nvme";
  const uint64_t reserve = 50ull << 20;
  FitRequest req = request(layers, stage3_nvme(), 1, reserve);
  req.dtypes = {DType::kF32, DType::kBF16};
  Result<FitResult> r = fit_config(req, caps);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->ok()) << r->missing;
  const FitCandidate& best = r->fitting.front();
  EXPECT_EQ(best.config.zero_optimization.stage, 3);
  EXPECT_TRUE(best.fits);
  expect_plan_within_caps(req, caps, best, reserve);
  // DeepSpeed's default bucket (5e8) cannot stay: the device holds 1/8 of the state.
  auto changed = [&](const std::string& key) {
    return std::any_of(best.changes.begin(), best.changes.end(), [&](const FitChange& c) { return c.key == key; });
  };
  EXPECT_TRUE(changed("zero_optimization.reduce_bucket_size"));
  EXPECT_LT(best.config.zero_optimization.reduce_bucket_size, 500'000'000);
  for (const FitChange& c : best.changes) EXPECT_FALSE(c.reason.empty()) << c.key;
  // Ranked by the step-time model.
  for (size_t i = 1; i < r->fitting.size(); ++i)
    EXPECT_LE(r->fitting[i - 1].predicted.step_ms, r->fitting[i].predicted.step_ms);
  for (const FitCandidate& c : r->fitting) expect_plan_within_caps(req, caps, c, reserve);
}

// The issue's case in fp32 only: the host holds half the training state
// (8 B/param), which the NVMe placements fit since an NVMe shard's update is
// staged in a parameter slot (Note [Update staging]). At a quarter (4 B/param,
// the fp32 gradient shard's size alone) they still fit: the fit's budget makes
// strata.gradient_shards auto put the shards on NVMe (Note [Gradient shards on
// NVMe]). At 1/128 nothing fits, and the fit says it is the host.
TEST(ConfigFit, IssueCaseFp32FitsAQuarterOfTheStateWithGradientShardsOnNvme) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 1024, 768, 16);
  const uint64_t state = 16 * elements(layers);
  FitCaps caps;
  caps.device_bytes = state / 8;
  caps.host_bytes = state / 2;
  caps.nvme_bytes = uint64_t{64} << 30;
  caps.nvme_path = "/nvme";
  const uint64_t reserve = 50ull << 20;
  const FitRequest req = request(layers, stage3_nvme(), 1, reserve);
  Result<FitResult> r = fit_config(req, caps);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->ok()) << r->missing;
  EXPECT_EQ(r->fitting.front().options.offload_param, OffloadDevice::kNvme);
  for (const FitCandidate& c : r->fitting) expect_plan_within_caps(req, caps, c, reserve);

  caps.host_bytes = state / 4;
  r = fit_config(req, caps);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->ok()) << r->missing;
  const FitCandidate& best = r->fitting.front();
  EXPECT_EQ(best.options.offload_optimizer, OffloadDevice::kNvme);
  EXPECT_EQ(best.options.grad_dtype, DType::kF32);  // no gradient dtype was allowed
  for (const FitCandidate& c : r->fitting) expect_plan_within_caps(req, caps, c, reserve);
  const Partition part = Partition::create(layers, 1, best.options.sub_group_size).value();
  const StatePlacement placed = StatePlacement::compute(best.options, layers, part, 0, PlannedDevice::cpu()).value();
  EXPECT_NE(placed.gradient_slot_count, 0u) << placed.gradient_shards_why;
  // The written config says so, with its reason.
  EXPECT_EQ(best.config.strata.gradient_shards, "nvme");
  const auto change = std::find_if(best.changes.begin(), best.changes.end(),
                                   [](const FitChange& c) { return c.key == "strata.gradient_shards"; });
  ASSERT_NE(change, best.changes.end());
  EXPECT_EQ(change->after, "\"nvme\"");
  EXPECT_FALSE(change->reason.empty());
  // The gradients' extra NVMe write and read are in the prediction.
  // 12 B of state and 4 B of fp32 gradient per parameter, at least (parameter shards on NVMe add to it).
  EXPECT_GE(best.predicted.bytes.nvme_write, 16 * elements(layers));

  caps.host_bytes = state / 128;
  r = fit_config(req, caps);
  ASSERT_TRUE(r.ok());
  ASSERT_FALSE(r->ok()) << r->fitting.front().label;
  EXPECT_NE(r->missing.find("host needs"), std::string::npos) << r->missing;
}

// A host cap between what fp32 and bf16 gradient shards need beside the
// offloaded state: gradient dtypes are searched only when allowed; allowed,
// bf16 gradients fit and data_types.grad_accum_dtype is written with its
// reason; not allowed, the fit says so and suggests them.
TEST(ConfigFit, GradientDtypesAreSearchedOnlyWhenAllowed) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 64, 256, 4);
  const uint64_t n = elements(layers);
  FitCaps caps;
  caps.device_bytes = 5 * n;  // fp32 parameters, gradients and state (16 B/param) do not stay on the device
  // cpu offload: stage 3 (the device cannot hold the fp32 parameters beside their gradients): 12 B of state, a
  // 4 B fp32 gradient shard and a 4 B parameter shard per parameter > 19 B; with bf16 gradients (a 2 B shard) 18 B.
  caps.host_bytes = 19 * n;
  FitRequest req = request(layers, Config{}, 1);
  Result<FitResult> r = fit_config(req, caps);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_FALSE(r->ok()) << r->fitting.front().label;
  const bool suggests_bf16_grads = std::any_of(r->suggestions.begin(), r->suggestions.end(), [](const std::string& s) {
    return s.find("--grad-dtypes bf16") != std::string::npos;
  });
  EXPECT_TRUE(suggests_bf16_grads) << r->missing;
  for (const FitCandidate& c : r->rejected) EXPECT_EQ(c.config.data_types.grad_accum_dtype, "") << c.label;

  req.grad_dtypes = {DType::kF32, DType::kBF16};
  r = fit_config(req, caps);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->ok()) << r->missing;
  const FitCandidate& best = r->fitting.front();
  EXPECT_EQ(best.config.data_types.grad_accum_dtype, "bf16");
  EXPECT_EQ(best.options.grad_dtype, DType::kBF16);
  EXPECT_EQ(best.config.precision_dtype(), DType::kF32);  // the parameters stay as the config has them
  EXPECT_NE(best.label.find(" g=bf16"), std::string::npos) << best.label;
  const auto change = std::find_if(best.changes.begin(), best.changes.end(),
                                   [](const FitChange& c) { return c.key == "data_types.grad_accum_dtype"; });
  ASSERT_NE(change, best.changes.end());
  EXPECT_EQ(change->after, "\"bf16\"");
  EXPECT_FALSE(change->reason.empty());
  for (const FitCandidate& c : r->fitting) expect_plan_within_caps(req, caps, c, 0);

  // A name that is no gradient dtype is refused naming the flag.
  req.grad_dtypes = {DType::kI64};
  const Result<FitResult> bad = fit_config(req, caps);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--grad-dtypes"), std::string::npos) << bad.status().to_string();
}

// A host cap between what fp32 and 8-bit optimizer states need (no NVMe, a
// device that must offload): only the storages the caller allows are
// searched; allowed, int8 fits and is written with its reason; not allowed,
// the fit says so and suggests it.
TEST(ConfigFit, OptimizerStateStoragesAreSearchedOnlyWhenAllowed) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 64, 256, 4);
  const uint64_t n = elements(layers);
  FitCaps caps;
  caps.device_bytes = 5 * n;  // fp32 parameters, gradients and state (16 B/param) do not stay on the device
  // cpu offload at fp32: 12 B of state and a 4 B gradient shard per parameter (+ 4 B parameter shards at
  // stage 3 with parameters offloaded) > 15 B; with int8 states 6.03 B + 4 B (+ 4 B) < 15 B.
  caps.host_bytes = 15 * n;
  FitRequest req = request(layers, Config{}, 1);
  Result<FitResult> r = fit_config(req, caps);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_FALSE(r->ok()) << r->fitting.front().label;
  const bool suggests_int8 = std::any_of(r->suggestions.begin(), r->suggestions.end(), [](const std::string& s) {
    return s.find("--optimizer-states int8") != std::string::npos;
  });
  EXPECT_TRUE(suggests_int8) << r->missing;
  for (const FitCandidate& c : r->rejected) EXPECT_EQ(c.config.strata.optimizer_state_dtype, "fp32") << c.label;

  req.moment_storages = {cpu_adam::MomentStorage::fp32(), cpu_adam::MomentStorage::int8()};
  r = fit_config(req, caps);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->ok()) << r->missing;
  const FitCandidate& best = r->fitting.front();
  EXPECT_EQ(best.config.strata.optimizer_state_dtype, "int8");
  EXPECT_NE(best.label.find(" m=int8"), std::string::npos) << best.label;
  EXPECT_NE(best.config.zero_optimization.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_TRUE(best.options.moments.blocked());
  const auto change = std::find_if(best.changes.begin(), best.changes.end(),
                                   [](const FitChange& c) { return c.key == "strata.optimizer_state_dtype"; });
  ASSERT_NE(change, best.changes.end());
  EXPECT_EQ(change->after, "\"int8\"");
  EXPECT_FALSE(change->reason.empty());
  for (const FitCandidate& c : r->fitting) {
    expect_plan_within_caps(req, caps, c, 0);
    // int8 only where the state is offloaded, whole.
    if (c.config.strata.optimizer_state_dtype == "int8") {
      EXPECT_NE(c.config.zero_optimization.offload_optimizer.device, OffloadDevice::kNone) << c.label;
      EXPECT_EQ(c.config.zero_optimization.offload_optimizer.ratio, 1.0) << c.label;
    }
  }
  // A row the caller chose: int8 on the device is refused, naming the row.
  Result<FitCandidate> row = fit_placement(req, caps, 2, OffloadDevice::kNone, OffloadDevice::kNone, 1.0,
                                           DType::kF32, cpu_adam::MomentStorage::int8());
  ASSERT_FALSE(row.ok());
  EXPECT_NE(row.status().message().find("s2 opt=none param=none fp32 m=int8"), std::string::npos)
      << row.status().to_string();
}

TEST(ConfigFit, WorldSizesFitOnEveryRank) {
  for (int world : {2, 4, 8}) {
    const std::vector<LayerSpec> layers = gpt_layers(256, 256, 256, 4);
    const uint64_t state = 16 * elements(layers);
    FitCaps caps;
    caps.device_bytes = state / 4;
    caps.host_bytes = 2 * state;  // shared by the node's ranks
    caps.ranks_per_node = world;
    Config c;
    c.bf16.enabled = true;
    Result<FitResult> r = fit_config(request(layers, c, world, 1 << 20), caps);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(r->ok()) << "world " << world << ": " << r->missing;
    for (const FitCandidate& cand : r->fitting) expect_plan_within_caps(request(layers, c, world), caps, cand, 1 << 20);
    // No NVMe folder: no NVMe placement anywhere.
    for (const auto* list : {&r->fitting, &r->rejected})
      for (const FitCandidate& cand : *list) EXPECT_EQ(cand.label.find("nvme"), std::string::npos) << cand.label;
  }
}

TEST(ConfigFit, GenerousCapsKeepTheUsersKnobs) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 64, 64, 2);
  FitCaps caps;
  caps.device_bytes = uint64_t{1} << 30;
  caps.host_bytes = uint64_t{1} << 30;
  Config c;
  c.zero_optimization.stage = 2;
  c.zero_optimization.reduce_bucket_size = 123456;
  Result<FitResult> r = fit_config(request(layers, c, 1), caps);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->ok());
  for (const FitCandidate& cand : r->fitting) EXPECT_EQ(cand.config.zero_optimization.reduce_bucket_size, 123456);
  // Everything fits: the fastest is stage 0-2 with nothing offloaded on this profile.
  EXPECT_EQ(r->fitting.front().options.offload_optimizer, OffloadDevice::kNone);
}

TEST(ConfigFit, Deterministic) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 1024, 256, 6);
  FitCaps caps;
  caps.device_bytes = 16 * elements(layers) / 6;
  caps.host_bytes = 16 * elements(layers);
  caps.nvme_bytes = uint64_t{8} << 30;
  caps.nvme_path = "/nvme";
  const FitRequest req = request(layers, stage3_nvme(), 2, 1 << 20);
  caps.ranks_per_node = 2;
  Result<FitResult> a = fit_config(req, caps), b = fit_config(req, caps);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->fitting.size(), b->fitting.size());
  for (size_t i = 0; i < a->fitting.size(); ++i) {
    EXPECT_EQ(a->fitting[i].label, b->fitting[i].label);
    ASSERT_EQ(a->fitting[i].changes.size(), b->fitting[i].changes.size());
    for (size_t k = 0; k < a->fitting[i].changes.size(); ++k)
      EXPECT_EQ(describe_fit_change(a->fitting[i].changes[k]), describe_fit_change(b->fitting[i].changes[k]));
  }
}

TEST(ConfigFit, NvmeShortfallNamesTheFolder) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 1024, 256, 6);
  FitCaps caps;
  caps.device_bytes = 16 * elements(layers) / 8;
  caps.host_bytes = 2 * elements(layers);  // too little for any host placement
  caps.nvme_bytes = 1 << 20;               // and 1 MiB of NVMe
  caps.nvme_path = "/mnt/small";
  Result<FitResult> r = fit_config(request(layers, stage3_nvme(), 1, 1 << 20), caps);
  ASSERT_TRUE(r.ok());
  ASSERT_FALSE(r->ok());
  bool named = false;
  for (const FitCandidate& c : r->rejected)
    if (c.bound.find("NVMe needs") != std::string::npos && c.bound.find("/mnt/small has 1.00 MiB free") != std::string::npos)
      named = true;
  EXPECT_TRUE(named);
}

TEST(ConfigFit, CapsBelowAnyPlanSayWhatIsMissing) {
  const Config defaults;
  const std::vector<LayerSpec> layers = gpt_layers(256, 64, 64, 2);
  FitCaps caps;
  caps.device_bytes = 1024;
  caps.host_bytes = 1024;
  Result<FitResult> r = fit_config(request(layers, defaults, 1), caps);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->ok());
  EXPECT_NE(r->missing.find("device needs"), std::string::npos) << r->missing;
}

// One placement the caller chose (a plan row): the knobs that make it fit, or its shortfall.
TEST(ConfigFit, FitPlacementGivesTheKnobsForOneRow) {
  const std::vector<LayerSpec> layers = gpt_layers(256, 1024, 768, 16);
  const uint64_t state = 16 * elements(layers);
  FitCaps caps;
  caps.device_bytes = state / 8;
  caps.host_bytes = state / 2;
  caps.nvme_bytes = uint64_t{64} << 30;
  caps.nvme_path = "/nvme";
  const FitRequest req = request(layers, stage3_nvme(), 1, 50ull << 20);
  Result<FitCandidate> row = fit_placement(req, caps, 3, OffloadDevice::kNvme, OffloadDevice::kCpu, 1.0, DType::kBF16,
                                           cpu_adam::MomentStorage::fp32());
  ASSERT_TRUE(row.ok()) << row.status().to_string();
  EXPECT_TRUE(row->fits) << row->bound;
  EXPECT_EQ(row->label, "s3 opt=nvme param=cpu bf16");
  expect_plan_within_caps(req, caps, *row, 50ull << 20);
  // Stage 0 keeps everything on the device: no knob makes it fit, and the shortfall says the device.
  row = fit_placement(req, caps, 0, OffloadDevice::kNone, OffloadDevice::kNone, 1.0, DType::kBF16,
                      cpu_adam::MomentStorage::fp32());
  ASSERT_TRUE(row.ok());
  EXPECT_FALSE(row->fits);
  EXPECT_NE(row->bound.find("device needs"), std::string::npos) << row->bound;
}

TEST(ConfigFit, BadInputsNameTheFlag) {
  const Config defaults;
  const std::vector<LayerSpec> layers = gpt_layers(256, 64, 64, 2);
  FitCaps caps;
  caps.device_bytes = 0;
  caps.host_bytes = 1 << 20;
  Result<FitResult> r = fit_config(request(layers, defaults, 1), caps);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--device-memory"), std::string::npos);
  caps.device_bytes = 1 << 20;
  caps.host_bytes = 0;
  r = fit_config(request(layers, defaults, 1), caps);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--host-memory"), std::string::npos);
  caps.host_bytes = 1 << 20;
  r = fit_config(request(layers, defaults, 0), caps);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--ranks"), std::string::npos);
}

}  // namespace
}  // namespace strata::offload
