// Every bad-input rule: the error names the JSON path and says the fix.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using testing::check_text;
using testing::expect_error;
using testing::expect_warning;

TEST(ConfigBad, UnknownKeySuggestsNearestSibling) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "cpu", "pin_memroy": true}}})");
  expect_error(check, "zero_optimization.offload_optimizer.pin_memroy", "unknown key 'pin_memroy'",
               "did you mean 'pin_memory'?");
}

TEST(ConfigBad, Int8OptimizerStatesNeedOffloadedAdamState) {
  // On the device: no int8 kernel there.
  auto check = check_text(R"({"zero_optimization": {"stage": 2}, "strata": {"optimizer_state_dtype": "int8"}})");
  expect_error(check, "strata.optimizer_state_dtype", "offload_optimizer.device is none",
               "set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
  // Part of the state kept on the device.
  check = check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
    "strata": {"optimizer_state_dtype": "int8"}})");
  expect_error(check, "strata.optimizer_state_dtype", "ratio 0.5", "set offload_optimizer.ratio to 1");
  // Optimizers without the 8-bit kernel.
  check = check_text(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}, "strata": {"optimizer_state_dtype": "int8"}})");
  expect_error(check, "strata.optimizer_state_dtype", "not optimizer.type Lion", "use fp32 or bf16 states");
  // A moment dtype that does not exist.
  check = check_text(R"({"strata": {"optimizer_state_dtype": "fp8"}})");
  EXPECT_FALSE(check.ok());
  EXPECT_NE(check.format().find("int8"), std::string::npos) << check.format();
}

TEST(ConfigBad, GradientShardsOnNvmeNeedAFolderOnNvme) {
  auto check = check_text(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "strata": {"gradient_shards": "nvme"}})");
  expect_error(check, "strata.gradient_shards", "offload_optimizer.device is cpu and offload_param.device is none",
               "set zero_optimization.offload_optimizer.device to \"nvme\"");
  // The state in host memory with the parameters on NVMe: their folder holds the shards.
  EXPECT_TRUE(check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
    "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"gradient_shards": "nvme"}})").ok());
  // The state on the device: refused.
  check = check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
    "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"gradient_shards": "nvme"}})");
  expect_error(check, "strata.gradient_shards", "offload_optimizer.device is none", "strata.gradient_shards to");
  check = check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
    "ratio": 0.5}}, "strata": {"gradient_shards": "nvme"}})");
  expect_error(check, "strata.gradient_shards", "ratio 0.5", "set offload_optimizer.ratio to 1");
  check = check_text(R"({"strata": {"gradient_shards": "disk"}})");
  EXPECT_FALSE(check.ok());
  EXPECT_NE(check.format().find("pinned"), std::string::npos) << check.format();
  // auto never errs: it stays pinned where NVMe is not possible.
  EXPECT_TRUE(check_text(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "strata": {"gradient_shards": "auto"}})").ok());
}

TEST(ConfigBad, UnknownTopLevelAndAioKeys) {
  const auto check = check_text(R"({"train_batch_sise": 8, "aio": {"queue_dept": 4, "thread_cnt": 2}})");
  expect_error(check, "train_batch_sise", "unknown key", "did you mean 'train_batch_size'?");
  expect_error(check, "aio.queue_dept", "unknown key", "did you mean 'queue_depth'?");
  expect_error(check, "aio.thread_cnt", "unknown key", "did you mean 'thread_count'?");
}

TEST(ConfigBad, MisspelledKeyOfAnotherSectionIsFoundThere) {
  const auto check = check_text(R"({"offload_optimzer": {"device": "cpu"}})");
  expect_error(check, "offload_optimzer", "unknown key", "did you mean 'zero_optimization.offload_optimizer'?");
}

TEST(ConfigBad, UnknownKeyWithNoNeighbourListsTheKnownKeys) {
  const auto check = check_text(R"({"bf16": {"zzzzzz": 1}})");
  expect_error(check, "bf16.zzzzzz", "unknown key", "known keys of 'bf16': 'enabled', 'immediate_grad_update'");
}

TEST(ConfigBad, KnownKeyInTheWrongSectionSaysWhereItBelongs) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3, "pin_memory": true}})");
  expect_error(check, "zero_optimization.pin_memory", "is not a key of 'zero_optimization'",
               "'zero_optimization.offload_optimizer' or 'zero_optimization.offload_param'");
}

TEST(ConfigBad, AioInsideZeroOptimizationMustMoveToTopLevel) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3, "aio": {"block_size": 1048576}}})");
  expect_error(check, "zero_optimization.aio", "'aio' is not a key of 'zero_optimization'", "move it to the top level");
}

TEST(ConfigBad, StringsWhereBooleansAndNumbersBelong) {
  const auto check = check_text(R"({"zero_optimization": {"stage": "3", "overlap_comm": "false",
    "reduce_bucket_size": "1e9", "contiguous_gradients": 1}})");
  expect_error(check, "zero_optimization.stage", "is the string \"3\", not a number", "write 3 without quotes");
  expect_error(check, "zero_optimization.overlap_comm", "is the string \"false\", not a boolean",
               "write false without quotes");
  expect_error(check, "zero_optimization.reduce_bucket_size", "not a number", "write 1e9 without quotes");
  expect_error(check, "zero_optimization.contiguous_gradients", "is not a boolean", "true or false");
  EXPECT_EQ(check.error_count(), 4u) << check.format();
}

TEST(ConfigBad, FractionalValueForIntegerKey) {
  const auto check = check_text(R"({"zero_optimization": {"sub_group_size": 1.5e0}})");
  expect_error(check, "zero_optimization.sub_group_size", "not a whole number", "give an integer");
}

TEST(ConfigBad, RangesAreChecked) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 4, "offload_optimizer": {"ratio": 1.5,
    "buffer_count": 0}}, "aio": {"queue_depth": 0}, "optimizer": {"type": "Adam", "params": {"eps": 0,
    "betas": [0.9, 1.2]}}, "gradient_clipping": -1})");
  expect_error(check, "zero_optimization.stage", "4 is out of range", "0 <= value <= 3");
  expect_error(check, "zero_optimization.offload_optimizer.ratio", "out of range", "0 <= value <= 1");
  expect_error(check, "zero_optimization.offload_optimizer.buffer_count", "out of range", "1 <= value <= 1024");
  expect_error(check, "aio.queue_depth", "out of range", "1 <= value");
  expect_error(check, "optimizer.params.eps", "out of range", "value > 0");
  expect_error(check, "optimizer.params.betas[1]", "1.2 is out of range", "0 <= value < 1");
  expect_error(check, "gradient_clipping", "out of range", "value >= 0");
  // Every engine wait is bounded: no zero, no negative, at most a week.
  for (const char* bad : {"0", "-1", "604801"})
    expect_error(check_text(fmt::format(R"({{"strata": {{"wait_timeout_s": {}}}}})", bad)), "strata.wait_timeout_s",
                 "out of range", "0.001 <= value <= 604800");
}

TEST(ConfigBad, EnumsSuggestTheChoice) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "CPU"}, "offload_param": {"device": "disk"}}, "aio": {"engine": "iouring"}})");
  expect_error(check, "zero_optimization.offload_optimizer.device", "not one of 'none', 'cpu' or 'nvme'",
               "did you mean 'cpu'?");
  expect_error(check, "zero_optimization.offload_param.device", "\"disk\" is not one of", "");
  expect_error(check, "aio.engine", "not one of", "did you mean 'io_uring'?");
}

TEST(ConfigBad, UnsupportedDeepSpeedOptimizer) {
  const auto check = check_text(R"({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}})");
  expect_error(check, "optimizer.type", "DeepSpeed optimizer that Strata does not implement", "'AdamW'");
}

TEST(ConfigBad, OffloadParamBelowStage3HasNoEffectAsInDeepSpeed) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})");
  EXPECT_TRUE(check.ok()) << check.format();
  expect_warning(check, "zero_optimization.offload_param.device", "has no effect below ZeRO stage 3");
  // Resolved to what runs: no parameter offload.
  EXPECT_EQ(check.config.zero_optimization.offload_param.device, OffloadDevice::kNone);
}

TEST(ConfigBad, OptimizerOffloadAtStage0) {
  const auto check = check_text(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  expect_error(check, "zero_optimization.offload_optimizer.device", "needs ZeRO stage 1, 2 or 3",
               "set zero_optimization.stage to 1, 2 or 3");
  for (int stage = 1; stage <= 3; ++stage) {
    const auto ok = check_text(fmt::format(R"({{"zero_optimization": {{"stage": {},
      "offload_optimizer": {{"device": "nvme", "nvme_path": "/nvme"}}}}}})", stage));
    EXPECT_TRUE(ok.ok()) << stage << ok.format();
  }
}

TEST(ConfigBad, NvmeWithoutPath) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
    "offload_param": {"device": "nvme", "nvme_path": null}}})");
  expect_error(check, "zero_optimization.offload_optimizer.nvme_path", "device is nvme but nvme_path is not set",
               "set nvme_path to a directory");
  expect_error(check, "zero_optimization.offload_param.nvme_path", "device is nvme but nvme_path is not set",
               "local NVMe");
}

TEST(ConfigBad, NvmePathWithoutNvmeWarns) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "cpu", "nvme_path": "/nvme"}}})");
  EXPECT_TRUE(check.ok());
  expect_warning(check, "zero_optimization.offload_optimizer.nvme_path", "ignored: device is cpu");
}

TEST(ConfigBad, PartialOffloadOutsideStage3) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 2,
    "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})");
  expect_error(check, "zero_optimization.offload_optimizer.ratio", "needs ZeRO stage 3", "set ratio to 1.0");
  EXPECT_TRUE(check_text(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})").ok());
}

TEST(ConfigBad, Fp16AndBf16BothEnabled) {
  const auto check = check_text(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  expect_error(check, "bf16.enabled", "fp16 and bf16 are both enabled", "enable only one");
}

TEST(ConfigBad, BatchTripleThatDoesNotMultiplyOutShowsArithmetic) {
  const auto check = check_text(
      R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})", 2);
  expect_error(check, "train_batch_size",
               "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 4 x world size 2 = 32",
               "set train_batch_size to 32");
}

// strata train under mpirun checks the batch keys against the communicator's
// world and says where that world size came from (not "pass --world-size N").
TEST(ConfigBad, BatchErrorNamesWhereTheWorldSizeCameFrom) {
  ConfigOptions options;
  options.world_size = 2;
  options.world_size_origin = "the MPI communicator (mpirun -np 2)";
  options.source = "ds.json";
  const auto check = check_config_text(
      R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1})", options);
  expect_error(check, "train_batch_size",
               "train_batch_size 8 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x world size 2 "
               "= 4 (world size 2 from the MPI communicator (mpirun -np 2))",
               "set train_batch_size to 4");
  EXPECT_EQ(check.format().find("--world-size"), std::string::npos) << check.format();
  // The same keys are consistent with that world.
  const auto good = check_config_text(
      R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})", options);
  EXPECT_TRUE(good.ok()) << good.format();
  // Without an origin (strata config check), world size 1 still says how to pass another.
  const auto one = check_text(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2})");
  expect_error(one, "train_batch_size", "(world size 1; pass --world-size N)", "set train_batch_size to 4");
}

TEST(ConfigBad, BatchThatDoesNotDivide) {
  const auto check = check_text(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})", 2);
  expect_error(check, "train_batch_size", "30 is not a multiple of train_micro_batch_size_per_gpu 4 x world size 2 = 8",
               "multiple of 8");
  const auto alone = check_text(R"({"gradient_accumulation_steps": 4})");
  expect_error(alone, "gradient_accumulation_steps", "alone does not determine the batch", "train_micro_batch_size_per_gpu");
}

TEST(ConfigBad, MaxGradNormBelongsToGradientClipping) {
  const auto check = check_text(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}})");
  expect_error(check, "optimizer.params.max_grad_norm", "not an optimizer parameter", "\"gradient_clipping\"");
}

TEST(ConfigBad, ParametersMustBelongToTheType) {
  const auto opt = check_text(R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "eps": 1e-8}}})");
  expect_error(opt, "optimizer.params.eps", "'eps' is not a parameter of optimizer.type Lion",
               "it belongs to Adam, AdamW, Adagrad");
  const auto sched = check_text(R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})");
  expect_error(sched, "scheduler.params.total_num_steps", "not a parameter of scheduler.type WarmupLR",
               "WarmupDecayLR, WarmupCosineLR");
}

TEST(ConfigBad, RequiredSchedulerParameter) {
  const auto check = check_text(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})");
  expect_error(check, "scheduler.params.total_num_steps", "required by WarmupDecayLR", "number of optimizer steps");
  const auto shorter = check_text(R"({"scheduler": {"type": "WarmupDecayLR",
    "params": {"warmup_num_steps": 100, "total_num_steps": 10}}})");
  expect_error(shorter, "scheduler.params.total_num_steps", "shorter than warmup_num_steps", "at least");
}

TEST(ConfigBad, SectionsWithoutType) {
  expect_error(check_text(R"({"optimizer": {"params": {"lr": 1}}})"), "optimizer.type", "has no type", "AdamW");
  expect_error(check_text(R"({"scheduler": {"params": {}}})"), "scheduler.type", "has no type", "WarmupLR");
}

TEST(ConfigBad, AmsgradIsRejected) {
  expect_error(check_text(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})"),
               "optimizer.params.amsgrad", "not implemented", "false");
}

TEST(ConfigBad, DeprecatedKeyTogetherWithItsReplacement) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 2, "cpu_offload": true,
    "offload_optimizer": {"device": "cpu"}}})");
  expect_error(check, "zero_optimization.cpu_offload", "given together with 'zero_optimization.offload_optimizer'",
               "remove the deprecated 'cpu_offload'");
  // false next to the new section is harmless (only the warning remains).
  EXPECT_TRUE(check_text(R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": false,
    "offload_optimizer": {"device": "cpu"}}})").ok());
}

TEST(ConfigBad, SameKeyUnderTwoNames) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1,
    "stage3_prefetch_bucket_size": 2}})");
  expect_error(check, "zero_optimization.stage3_prefetch_bucket_size",
               "given twice, also as 'zero_optimization.prefetch_bucket_size'", "keep one");
}

TEST(ConfigBad, DuplicateKeyInTheFile) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 1, "stage": 3}})");
  expect_error(check, "zero_optimization.stage", "duplicate key", "delete one");
}

TEST(ConfigBad, InvalidJsonNamesTheLine) {
  const auto check = check_text("{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": { \"stage\": 2, }\n}\n");
  ASSERT_EQ(check.issues.size(), 1u);
  EXPECT_NE(check.issues[0].message.find("line 3"), std::string::npos) << check.issues[0].message;
  EXPECT_NE(check.issues[0].hint.find("trailing commas"), std::string::npos);
}

TEST(ConfigBad, NotAnObject) {
  expect_error(check_text("[1, 2]"), "", "not an object", "one JSON object");
  expect_error(check_text(R"({"zero_optimization": true})"), "zero_optimization", "is not a section", "write an object");
}

TEST(ConfigBad, NullAndAutoWhereNotAccepted) {
  const auto check = check_text(R"({"zero_optimization": {"stage": null, "sub_group_size": "auto"}})");
  expect_error(check, "zero_optimization.stage", "null is not a valid integer", "remove the key");
  expect_error(check, "zero_optimization.sub_group_size", "\"auto\" is not accepted", "give a integer");
}

TEST(ConfigBad, UnresolvedAutoIsAnErrorWhenAsked) {
  ConfigOptions options;
  options.allow_unresolved_auto = false;
  const auto check = check_config_text(R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})", options);
  expect_error(check, "optimizer.params.lr", "\"auto\" is unresolved", "write a value");
}

TEST(ConfigBad, AutoValueSuppliedIsCheckedToo) {
  ConfigOptions options;
  options.auto_values["optimizer.params.lr"] = "fast";
  const auto check = check_config_text(R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})", options);
  EXPECT_FALSE(check.ok());
  EXPECT_NE(check.format().find("value supplied for \"auto\""), std::string::npos) << check.format();
}

TEST(ConfigBad, ApexAmpIsRejected) {
  expect_error(check_text(R"({"amp": {"enabled": true, "opt_level": "O2"}})"), "amp.enabled", "apex AMP is not supported",
               "enable bf16");
  EXPECT_TRUE(check_text(R"({"train_batch_size": 8, "amp": {"enabled": false}})").ok());
}

TEST(ConfigBad, BlockSizeMustBeAligned) {
  expect_error(check_text(R"({"aio": {"block_size": 1000000}})"), "aio.block_size", "not a multiple of 4096", "1048576");
}

TEST(ConfigBad, NoEffectKeysWarn) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9,
    "zero_quantized_weights": true}, "aio": {"use_gds": true}})");
  EXPECT_TRUE(check.ok()) << check.format();
  expect_warning(check, "zero_optimization.stage3_max_live_parameters", "no effect below stage 3");
  expect_warning(check, "zero_optimization", "ZeRO++");
  expect_warning(check, "aio.use_gds", "GPUDirect Storage");
}

TEST(ConfigBad, EveryProblemIsReportedNotJustTheFirst) {
  const auto check = check_config_file(std::string(STRATA_SOURCE_DIR) + "/tests/config/data/bad_many.json",
                                       [] {
                                         ConfigOptions o;
                                         o.world_size = 2;
                                         return o;
                                       }());
  EXPECT_EQ(check.error_count(), 5u) << check.format();
  expect_error(check, "optimizer.params.max_grad_norm", "", "gradient_clipping");
  expect_error(check, "zero_optimization.offload_optimizer.pin_memroy", "unknown key", "pin_memory");
  expect_error(check, "zero_optimization.offload_param.pin_memory", "not a boolean", "without quotes");
  expect_error(check, "zero_optimization.aio", "", "top level");
  expect_error(check, "train_batch_size", "= 32", "32");
  // Messages name the file.
  EXPECT_NE(check.format().find("bad_many.json: error: zero_optimization.aio"), std::string::npos) << check.format();
}

TEST(ConfigBad, LoadConfigResultListsEveryErrorAndTheFile) {
  Result<Config> loaded = load_config(std::string(STRATA_SOURCE_DIR) + "/tests/config/data/bad_many.json");
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = loaded.status().message();
  EXPECT_NE(m.find("bad_many.json"), std::string::npos) << m;
  EXPECT_NE(m.find("pin_memroy"), std::string::npos) << m;
  EXPECT_NE(m.find("zero_optimization.aio"), std::string::npos) << m;
}

TEST(ConfigBad, MissingFileNamesThePath) {
  const auto check = check_config_file("/nonexistent/ds_config.json");
  ASSERT_FALSE(check.ok());
  EXPECT_NE(check.issues[0].message.find("/nonexistent/ds_config.json"), std::string::npos) << check.format();
}

TEST(ConfigBad, WorldSizeMustBePositive) {
  ConfigOptions options;
  options.world_size = 0;
  const auto check = check_config_text("{}", options);
  EXPECT_FALSE(check.ok());
}

}  // namespace
}  // namespace strata
