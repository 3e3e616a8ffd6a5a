// Valid DeepSpeed configs as users have them: typed values, aliases,
// deprecated keys, "auto" resolution and the batch arithmetic.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using testing::check_text;
using testing::example_path;
using testing::expect_warning;

TEST(ConfigGood, ExamplesAreValidAtSeveralWorldSizes) {
  for (const char* name : {"zero3_nvme_offload.json", "zero2_cpu_offload.json", "hf_zero3_auto.json", "zero1_bf16.json"}) {
    for (int64_t world : {1, 8}) {
      ConfigOptions options;
      options.world_size = world;
      const ConfigCheck check = check_config_file(example_path(name), options);
      EXPECT_TRUE(check.ok()) << name << " world " << world << ":\n" << check.format();
    }
  }
}

TEST(ConfigGood, Zero3NvmeOffloadIsTyped) {
  ConfigOptions options;
  options.world_size = 8;
  Result<Config> loaded = load_config(example_path("zero3_nvme_offload.json"), options);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const Config& c = *loaded;
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 500'000'000);  // written 5e8
  EXPECT_EQ(z.sub_group_size, 100'000'000);       // written 1e8
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_EQ(c.aio.engine, AioEngineKind::kAuto);
  EXPECT_EQ(c.precision(), TrainPrecision::kBf16);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_TRUE(c.optimizer.given);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(c.scheduler.params["total_num_steps"].get<int64_t>(), 100000);
  EXPECT_EQ(c.scheduler.params["warmup_type"].get<std::string>(), "log");  // filled-in default
  EXPECT_EQ(*c.batch.train_batch_size, 4 * 8 * 8);                          // derived
  EXPECT_EQ(c.world_size, 8);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 50);
  EXPECT_TRUE(c.unresolved.empty());
}

TEST(ConfigGood, Zero2CpuOffloadDerivesAccumulation) {
  ConfigOptions options;
  options.world_size = 8;
  Result<Config> loaded = load_config(example_path("zero2_cpu_offload.json"), options);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(*loaded->batch.gradient_accumulation_steps, 4);  // 256 / (8 x 8)
  EXPECT_EQ(loaded->precision(), TrainPrecision::kFp16);
  EXPECT_EQ(loaded->zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(loaded->zero_optimization.allgather_bucket_size, 200'000'000);
  EXPECT_EQ(loaded->scheduler.params["warmup_num_steps"].get<int64_t>(), 500);
  EXPECT_DOUBLE_EQ(loaded->fp16.loss_scale, 0.0);
}

TEST(ConfigGood, EmptyConfigIsAllDefaults) {
  const ConfigCheck check = check_text("{}");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_warning(check, "train_batch_size", "no batch size");
  const Config& c = check.config;
  EXPECT_EQ(c.zero_optimization.stage, 0);
  EXPECT_FALSE(c.zero_optimization.overlap_comm);  // unset: false below stage 3
  EXPECT_EQ(c.zero_optimization.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.zero_optimization.offload_param.buffer_count, 5);
  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_EQ(c.precision(), TrainPrecision::kFp32);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_FALSE(c.optimizer.given);
}

TEST(ConfigGood, OverlapCommDefaultsOnAtStage3) {
  EXPECT_TRUE(check_text(R"({"zero_optimization": {"stage": 3}})").config.zero_optimization.overlap_comm);
  EXPECT_FALSE(check_text(R"({"zero_optimization": {"stage": 2}})").config.zero_optimization.overlap_comm);
  EXPECT_FALSE(
      check_text(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})").config.zero_optimization.overlap_comm);
}

TEST(ConfigGood, ShortNamesAndAliases) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "prefetch_bucket_size": 1000, "param_persistence_threshold": 7,
                          "max_live_parameters": 9, "max_reuse_distance": 11, "model_persistence_threshold": 13,
                          "gather_16bit_weights_on_model_save": true},
    "aio": {"thread_count": 4}})");
  ASSERT_TRUE(check.ok()) << check.format();
  const ZeroConfig& z = check.config.zero_optimization;
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 1000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 7);
  EXPECT_EQ(z.stage3_max_live_parameters, 9);
  EXPECT_EQ(z.stage3_max_reuse_distance, 11);
  EXPECT_EQ(z.stage3_model_persistence_threshold, 13);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(check.config.aio.intra_op_parallelism, 4);
  // The one warning: model_persistence_threshold has no effect in Strata (config_no_effect_test.cpp).
  EXPECT_EQ(check.warning_count(), 1u) << check.format();
  expect_warning(check, "zero_optimization.model_persistence_threshold", "has no effect in Strata");
}

TEST(ConfigGood, LegacyNamesWarn) {
  const ConfigCheck check = check_text(R"({"bfloat16": {"enabled": true},
    "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": true}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_TRUE(check.config.bf16.enabled);
  EXPECT_TRUE(check.config.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  expect_warning(check, "bfloat16", "legacy name");
  expect_warning(check, "zero_optimization.stage3_gather_fp16_weights_on_model_save", "legacy name");
}

TEST(ConfigGood, DeprecatedCpuOffloadKeysMapWithWarnings) {
  const ConfigCheck check = check_text(R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": true,
    "cpu_offload_param": true, "cpu_offload_use_pin_memory": false}})");
  ASSERT_TRUE(check.ok()) << check.format();
  const ZeroConfig& z = check.config.zero_optimization;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_FALSE(z.offload_optimizer.pin_memory);
  EXPECT_FALSE(z.offload_param.pin_memory);
  expect_warning(check, "zero_optimization.cpu_offload", "deprecated");
  expect_warning(check, "zero_optimization.cpu_offload_param", "deprecated");
  expect_warning(check, "zero_optimization.cpu_offload_use_pin_memory", "deprecated");
  EXPECT_EQ(check.config.warnings.size(), 3u);
}

TEST(ConfigGood, ScientificNotationForIntegerKeys) {
  const ConfigCheck check = check_text(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
    "allgather_bucket_size": 2.5e8, "sub_group_size": 1E9}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.config.zero_optimization.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(check.config.zero_optimization.allgather_bucket_size, 250'000'000);
  EXPECT_EQ(check.config.zero_optimization.sub_group_size, 1'000'000'000);
}

TEST(ConfigGood, BatchTripleAnyTwoGiveTheThird) {
  auto batch = [](const char* text, int64_t world) {
    const ConfigCheck check = check_text(text, world);
    EXPECT_TRUE(check.ok()) << check.format();
    const BatchConfig& b = check.config.batch;
    return std::tuple{b.train_batch_size.value_or(-1), b.train_micro_batch_size_per_gpu.value_or(-1),
                      b.gradient_accumulation_steps.value_or(-1)};
  };
  EXPECT_EQ(batch(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", 4), std::tuple(64, 4, 4));
  EXPECT_EQ(batch(R"({"train_batch_size": 64, "gradient_accumulation_steps": 2})", 4), std::tuple(64, 8, 2));
  EXPECT_EQ(batch(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})", 4), std::tuple(24, 2, 3));
  EXPECT_EQ(batch(R"({"train_batch_size": 32})", 8), std::tuple(32, 4, 1));
  EXPECT_EQ(batch(R"({"train_micro_batch_size_per_gpu": 16})", 2), std::tuple(32, 16, 1));
  EXPECT_EQ(batch(R"({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})", 8),
            std::tuple(48, 2, 3));
}

TEST(ConfigGood, HuggingFaceAutoIsReportedUnresolved) {
  const ConfigCheck check = check_config_file(example_path("hf_zero3_auto.json"), {});
  ASSERT_TRUE(check.ok()) << check.format();
  const Config& c = check.config;
  for (const char* path : {"optimizer.params.lr", "optimizer.params.betas", "gradient_clipping", "fp16.enabled",
                           "bf16.enabled", "train_batch_size", "train_micro_batch_size_per_gpu",
                           "gradient_accumulation_steps", "scheduler.params.warmup_max_lr"}) {
    EXPECT_TRUE(c.is_unresolved(path)) << path;
    expect_warning(check, path, "unresolved");
  }
  // Bucket sizes fall back to the defaults without a hidden size.
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 500'000'000);
  expect_warning(check, "zero_optimization.reduce_bucket_size", "resolved to the default");
  EXPECT_EQ(config_to_json(c)["optimizer"]["params"]["lr"], "auto");
}

TEST(ConfigGood, AutoResolvedFromOptions) {
  ConfigOptions options;
  options.world_size = 4;
  options.hidden_size = 4096;
  options.auto_values["optimizer.params.lr"] = 2e-5;
  options.auto_values["train_micro_batch_size_per_gpu"] = 8;
  options.auto_values["gradient_accumulation_steps"] = 2;
  const ConfigCheck check = check_config_file(example_path("hf_zero3_auto.json"), options);
  ASSERT_TRUE(check.ok()) << check.format();
  const Config& c = check.config;
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-5);
  EXPECT_FALSE(c.is_unresolved("optimizer.params.lr"));
  EXPECT_EQ(*c.batch.train_batch_size, 8 * 2 * 4);
  EXPECT_FALSE(c.is_unresolved("train_batch_size"));
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 4096 * 4096);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, static_cast<int64_t>(0.9 * 4096 * 4096));
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 40960);
  EXPECT_TRUE(c.is_unresolved("optimizer.params.eps"));
}

TEST(ConfigGood, ShowRoundTrips) {
  for (const char* name : {"zero3_nvme_offload.json", "zero2_cpu_offload.json", "zero1_bf16.json"}) {
    ConfigOptions options;
    options.world_size = 8;
    const ConfigCheck first = check_config_file(example_path(name), options);
    ASSERT_TRUE(first.ok()) << first.format();
    const auto shown = config_to_json(first.config);
    const ConfigCheck second = check_config(nlohmann::json::parse(shown.dump()), options);
    ASSERT_TRUE(second.ok()) << name << ":\n" << second.format() << shown.dump(2);
    EXPECT_EQ(config_to_json(second.config), shown) << name;
  }
}

TEST(ConfigGood, IgnoredDeepSpeedSectionsAreCheckedAndKept) {
  const ConfigCheck check = check_config_file(example_path("zero1_bf16.json"), {});
  ASSERT_TRUE(check.ok()) << check.format();
  expect_warning(check, "tensorboard", "Strata does not act on it");
  EXPECT_EQ(check.config.ignored["tensorboard.job_name"], "gpt-1b");
  EXPECT_EQ(check.config.data_types.grad_accum_dtype, "fp32");
}

TEST(ConfigGood, OptimizerTypeIsCaseInsensitive) {
  const ConfigCheck check = check_text(R"({"optimizer": {"type": "adamw", "params": {"lr": 0.1}}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.config.optimizer.type, OptimizerType::kAdamW);
}

TEST(ConfigGood, StrataSectionTakesByteSizes) {
  const ConfigCheck check = check_text(R"({"strata": {"device": "cpu", "device_memory": "256MiB",
    "host_memory_budget": 64000000000, "optimizer_state_dtype": "bf16"}, "bf16": {"enabled": true}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.config.strata.device, DeviceKind::kCpu);
  EXPECT_EQ(check.config.strata.device_memory, 256u << 20);
  EXPECT_EQ(check.config.strata.host_memory_budget, 64'000'000'000u);
  EXPECT_EQ(check.config.strata.optimizer_state_dtype, "bf16");
}

TEST(ConfigGood, Int8OptimizerStatesWithOffloadedAdamW) {
  for (const char* device : {"cpu", "nvme"}) {
    const ConfigCheck check = check_text(fmt::format(R"({{"zero_optimization": {{"stage": 3, "offload_optimizer":
      {{"device": "{}", "nvme_path": "/tmp"}}}}, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4}}}},
      "bf16": {{"enabled": true}}, "strata": {{"optimizer_state_dtype": "int8"}}}})", device));
    ASSERT_TRUE(check.ok()) << device << ": " << check.format();
    EXPECT_EQ(check.config.strata.optimizer_state_dtype, "int8");
  }
}

}  // namespace
}  // namespace strata
