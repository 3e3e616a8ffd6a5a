// DeepSpeed's keys (docs/deepspeed-keys.md): every key of the pinned
// release is known; keys without effect load with a warning, features that
// change what training computes are refused when on; every JSON config that
// DeepSpeed 0.19.6 ships, and Hugging Face's ZeRO-3 test config, give the
// outcome asserted here.
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"
#include "strata/core/config_schema.h"
#include "strata/core/deepspeed_keys.h"

namespace strata {
namespace {

using testing::check_text;
using testing::expect_error;
using testing::expect_warning;

std::string data_path(std::string_view rel) {
  return fmt::format("{}/tests/config/data/{}", STRATA_SOURCE_DIR, rel);
}

// --- the table -------------------------------------------------------------------

TEST(DeepSpeedKeys, EveryKeyIsClassifiedOnceAndAgreesWithStratasTable) {
  std::set<std::string_view> paths;
  for (const DeepSpeedKey& key : deepspeed_keys()) {
    EXPECT_TRUE(paths.insert(key.path).second) << "duplicate " << key.path;
    const DeepSpeedFeature* feature = find_deepspeed_feature(key.feature);
    ASSERT_NE(feature, nullptr) << key.path << ": feature " << key.feature;
    // "strata" keys are exactly the ones Strata's own table has.
    if (feature->cls == DeepSpeedKeyClass::kStrata) {
      EXPECT_NE(find_config_key(key.path), nullptr) << key.path << " is marked strata but config_schema.cpp lacks it";
    } else {
      EXPECT_EQ(find_config_key(key.path), nullptr) << key.path << " is in config_schema.cpp but classified "
                                                    << deepspeed_key_class_name(feature->cls);
    }
    // A trigger only on refused features; every parent listed first (or in Strata's table).
    if (feature->cls != DeepSpeedKeyClass::kUnsupported) {
      EXPECT_TRUE(key.off.empty()) << key.path;
    }
    const size_t dot = key.path.rfind('.');
    if (dot != std::string_view::npos) {
      const std::string_view parent = key.path.substr(0, dot);
      EXPECT_TRUE(paths.count(parent) == 1 || find_config_key(parent) != nullptr) << key.path;
    }
  }
  for (const DeepSpeedFeature& f : deepspeed_features()) {
    EXPECT_FALSE(f.why.empty()) << f.id;
    EXPECT_FALSE(f.source.empty()) << f.id;
  }
  // Every refused feature can be switched on by some key (else it could never be refused).
  for (const DeepSpeedFeature& f : deepspeed_features()) {
    if (f.cls != DeepSpeedKeyClass::kUnsupported) continue;
    bool has_trigger = false;
    for (const DeepSpeedKey& key : deepspeed_keys()) has_trigger |= key.feature == f.id && !key.off.empty();
    EXPECT_TRUE(has_trigger) << f.id;
  }
  EXPECT_EQ(kDeepSpeedRelease, "0.19.6");
}

TEST(DeepSpeedKeys, MarkdownIsUpToDate) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/docs/deepspeed-keys.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << " is missing; run: strata config defaults --deepspeed-keys > docs/deepspeed-keys.md";
  std::stringstream committed;
  committed << in.rdbuf();
  EXPECT_TRUE(committed.str() == deepspeed_keys_markdown())
      << path << " is out of date; regenerate it with: strata config defaults --deepspeed-keys > docs/deepspeed-keys.md";
}

// --- every shipped config of DeepSpeed 0.19.6 ------------------------------------------

struct Expected {
  std::string file;  // under tests/config/data/deepspeed-0.19.6/
  bool ok;
  // Issues that must be there: "path: message fragment" (errors when !ok, else warnings).
  std::vector<std::pair<std::string, std::string>> issues;
};

const std::vector<Expected>& shipped() {
  static const std::vector<Expected> all = {
      {"csrc/aio/py_test/single_process_config.json", false,
       {{"block_size", "is not a key of the top level"}, {"io_parallel", "unknown key"}}},
      {"deepspeed/autotuning/config_templates/template_zero0.json", true, {{"train_batch_size", "no batch size"}}},
      {"deepspeed/autotuning/config_templates/template_zero1.json", true,
       {{"zero_optimization.allgather_bucket_size", "has no effect in Strata"}}},
      {"deepspeed/autotuning/config_templates/template_zero2.json", true,
       {{"zero_optimization.allgather_bucket_size", "has no effect in Strata"}}},
      {"deepspeed/autotuning/config_templates/template_zero3.json", true,
       {{"zero_optimization.allgather_bucket_size", "has no effect in Strata"}}},
      {"examples/sdma_allgather/ds_config_zero3.json", true,
       {{"zero_optimization.allgather_bucket_size", "has no effect in Strata"}}},
      {"tests/accelerator/ds_config.json", true, {}},
      // DeepSpeed ignores offload_param below stage 3, and so does Strata (a warning).
      {"tests/hybrid_engine/hybrid_engine_config.json", true,
       {{"zero_optimization.offload_param.device", "has no effect below ZeRO stage 3"}}},
      {"tests/model/BingBertSquad/deepspeed_bsz24_fp16_config.json", true, {}},
      {"tests/model/BingBertSquad/deepspeed_bsz24_fp16_eigenvalue_quantize_config.json", false,
       {{"eigenvalue.enabled", "turns on DeepSpeed's eigenvalue computation (MoQ), which Strata does not support"}}},
      {"tests/model/BingBertSquad/deepspeed_bsz24_fp16_zero2_config.json", true, {}},
      {"tests/model/BingBertSquad/deepspeed_bsz24_fp32_config.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs4_zero1.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs4_zero2.json", true,
       {{"zero_optimization.allgather_bucket_size", "has no effect in Strata"}}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs4_zero2_offload.json", true,
       {{"zero_optimization.cpu_offload", "deprecated key"}}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_no_zero.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_zero0_gas3.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_zero1.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_zero2.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_zero2_gas3.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_func_bs8_zero2_offload.json", true,
       {{"zero_optimization.cpu_offload", "deprecated key"}}},
      {"tests/model/Megatron_GPT2/ds_config_func_scheduler.json", true, {}},
      {"tests/model/Megatron_GPT2/ds_config_perf_bs16.json", true,
       {{"disable_allgather", "DeepSpeed's disable_allgather has no effect in Strata"}}},
      {"tests/model/Megatron_GPT2/ds_config_perf_bs32.json", true,
       {{"disable_allgather", "DeepSpeed's disable_allgather has no effect in Strata"}}},
      {"tests/model/Megatron_GPT2/ds_config_perf_bs8.json", true,
       {{"disable_allgather", "DeepSpeed's disable_allgather has no effect in Strata"}}},
      {"tests/torch_compile/ds_config_z2.json", true, {}},
      {"tests/torch_compile/ds_config_z3.json", true, {}},
      {"tests/torch_compile/ds_config_z3_deepcompile_no_persist.json", false,
       {{"compile.deepcompile", "turns on DeepSpeed's DeepCompile, which Strata does not support"}}},
      {"tests/unit/ds_batch_config.json", true, {}},
  };
  return all;
}

TEST(DeepSpeedConfigs, ShippedConfigsOfTheRelease) {
  ASSERT_EQ(shipped().size(), 29u);
  size_t refused = 0;
  for (const Expected& e : shipped()) {
    SCOPED_TRACE(e.file);
    const ConfigCheck check = check_config_file(data_path("deepspeed-0.19.6/" + e.file));
    EXPECT_EQ(check.ok(), e.ok) << check.format();
    refused += check.ok() ? 0 : 1;
    for (const auto& [path, message] : e.issues) {
      const ConfigIssue* issue =
          testing::issue_at(check, path, e.ok ? IssueSeverity::kWarning : IssueSeverity::kError);
      ASSERT_NE(issue, nullptr) << "no issue at " << path << ":\n" << check.format();
      EXPECT_NE(issue->message.find(message), std::string::npos) << issue->message;
    }
    // None of them is refused for a key DeepSpeed defines.
    for (const ConfigIssue& issue : check.issues) {
      if (issue.severity != IssueSeverity::kError || issue.message.rfind("unknown key", 0) != 0) continue;
      EXPECT_EQ(e.file, "csrc/aio/py_test/single_process_config.json") << issue.path << ": " << issue.message;
    }
  }
  EXPECT_EQ(refused, 3u);  // the aio sweep (not a training config), eigenvalue on, DeepCompile on
}

TEST(DeepSpeedConfigs, EigenvalueConfigSaysWhatToRemoveAndWarnsOnTheRest) {
  const ConfigCheck check =
      check_config_file(data_path("deepspeed-0.19.6/tests/model/BingBertSquad/"
                                  "deepspeed_bsz24_fp16_eigenvalue_quantize_config.json"));
  expect_error(check, "eigenvalue.enabled", "Hessian eigenvalues",
               "remove 'eigenvalue', or set enabled to false to train with Strata");
  EXPECT_EQ(check.error_count(), 1u) << check.format();
  expect_warning(check, "tensorboard", "Strata does not act on it");
  // quantize_training has no enabled: true, so it is off (as in DeepSpeed).
  expect_warning(check, "quantize_training", "accepted because it is off");
}

// Hugging Face transformers' tests/deepspeed/ds_config_zero3.json: DeepSpeed's value domains.
TEST(DeepSpeedConfigs, HuggingFaceZero3TestConfigLoadsWithDeepSpeedsMeaning) {
  const ConfigCheck check = check_config_file(data_path("transformers/ds_config_zero3.json"));
  ASSERT_TRUE(check.ok()) << check.format();
  const ZeroConfig& z = check.config.zero_optimization;
  EXPECT_EQ(z.reduce_bucket_size, 0);  // each layer's gradients reduced on their own (engine: cap of one layer)
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 0);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 0);
  EXPECT_EQ(z.sub_group_size, 100'000'000'000'000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  expect_warning(check, "zero_optimization.stage3_gather_fp16_weights_on_model_save", "legacy name");
}

TEST(DeepSpeedConfigs, ZeroBucketsAreDeepSpeedsDomain) {
  const auto check = check_text(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0,
    "allgather_bucket_size": 0, "sub_group_size": 1e14}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.config.zero_optimization.reduce_bucket_size, 0);
  const auto negative = check_text(R"({"zero_optimization": {"reduce_bucket_size": -1}})");
  expect_error(negative, "zero_optimization.reduce_bucket_size", "out of range", "value >= 0");
  const auto fraction = check_text(R"({"zero_optimization": {"reduce_bucket_size": 5.5e0}})");
  expect_error(fraction, "zero_optimization.reduce_bucket_size", "not a whole number", "");
}

// --- features that change what training computes ------------------------------------

TEST(DeepSpeedFeatures, RefusedWhenOnNamingTheKeyAndWhatToRemove) {
  struct Case {
    const char* json;
    const char* path;
    const char* feature;
    const char* hint;
  };
  const Case cases[] = {
      {R"({"pipeline": {"stages": 4, "partition": "uniform"}})", "pipeline.stages", "pipeline parallelism",
       "remove 'pipeline', or set stages to \"auto\""},
      {R"({"sparse_attention": {"mode": "fixed", "block": 16}})", "sparse_attention", "sparse attention",
       "remove 'sparse_attention'"},
      {R"({"progressive_layer_drop": {"enabled": true, "theta": 0.5}})", "progressive_layer_drop.enabled",
       "progressive layer drop", "remove 'progressive_layer_drop', or set enabled to false"},
      {R"({"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen"}})", "curriculum_learning.enabled",
       "curriculum learning", "set enabled to false"},
      {R"({"data_efficiency": {"enabled": true, "data_sampling": {"enabled": true}}})", "data_efficiency.enabled",
       "data efficiency", "remove 'data_efficiency'"},
      {R"({"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": true, "method": "l1"},
          "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.self"]}}}}})",
       "compression_training.sparse_pruning.shared_parameters.enabled", "compression training",
       "remove 'compression_training'"},
      {R"({"hybrid_engine": {"enabled": true}})", "hybrid_engine.enabled", "hybrid engine", "remove 'hybrid_engine'"},
      {R"({"torch_autocast": {"enabled": true, "dtype": "bfloat16"}})", "torch_autocast.enabled", "torch autocast",
       "remove 'torch_autocast'"},
      {R"({"elasticity": {"enabled": true, "max_train_batch_size": 2000}})", "elasticity.enabled", "elastic training",
       "remove 'elasticity'"},
      {R"({"weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8}}}})", "weight_quantization",
       "weight quantization", "remove 'weight_quantization'"},
      {R"({"tensor_parallel": {"autotp_size": 4}})", "tensor_parallel.autotp_size", "tensor parallelism",
       "set autotp_size to 0"},
      {R"({"expert_parallel": {"enabled": true, "autoep_size": 8}})", "expert_parallel.enabled",
       "expert parallelism", "remove 'expert_parallel'"},
      {R"({"sequence_parallel_size": 2})", "sequence_parallel_size", "sequence parallelism",
       "set sequence_parallel_size to 1"},
      {R"({"gradient_allreduce_op": "sum"})", "gradient_allreduce_op", "gradient sum", "set gradient_allreduce_op"},
      {R"({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.05}}})", "zero_optimization.zenflow",
       "ZenFlow", "remove 'zero_optimization.zenflow'"},
      {R"({"bf16": {"enabled": true, "bf16_optimizer_states": true}})", "bf16.bf16_optimizer_states",
       "bf16 optimizer states", "set bf16_optimizer_states to false"},
      {R"({"data_types": {"param_dtype": "bf16"}})", "data_types.param_dtype", "parameter / buffer dtype override",
       "remove 'data_types.param_dtype'"},
      {R"({"compile": {"deepcompile": true}})", "compile.deepcompile", "DeepCompile", "remove 'compile'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    const auto check = check_text(c.json);
    expect_error(check, c.path, fmt::format("turns on DeepSpeed's {}", c.feature), c.hint);
    const ConfigIssue* issue = testing::issue_at(check, c.path);
    ASSERT_NE(issue, nullptr);
    EXPECT_NE(issue->message.find("which Strata does not support"), std::string::npos) << issue->message;
  }
}

TEST(DeepSpeedFeatures, SwitchedOffTheyLoadWithAWarning) {
  for (const char* json : {R"({"hybrid_engine": {"enabled": false, "max_out_tokens": 512}})",
                           R"({"torch_autocast": {"enabled": false}})", R"({"compile": {"deepcompile": false}})",
                           R"({"pipeline": {"stages": "auto", "partition": "best"}})",
                           R"({"weight_quantization": {"enabled": false}})",
                           R"({"tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}}})",
                           R"({"sequence_parallel_size": 1, "gradient_allreduce_op": "mean"})",
                           R"({"compression_training": {"weight_quantization": {"shared_parameters":
                               {"enabled": false}}, "layer_reduction": {"enabled": false}}})"}) {
    SCOPED_TRACE(json);
    const auto check = check_text(json);
    EXPECT_TRUE(check.ok()) << check.format();
    bool warned = false;
    for (const ConfigIssue& issue : check.issues) {
      warned |= issue.message.find("accepted because it is off") != std::string::npos;
    }
    EXPECT_TRUE(warned) << check.format();
  }
}

TEST(DeepSpeedFeatures, NoEffectKeysLoadWithOneWarningEach) {
  const auto check = check_text(R"({"comet": {"enabled": true, "project": "p"}, "timers": {"throughput":
    {"enabled": true}}, "autotuning": {"enabled": true, "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}},
    "graph_harvesting": true, "dataloader_drop_last": true, "zero_optimization": {"stage": 3,
    "mics_shard_size": 8, "stage3_module_granularity_threshold": 100,
    "offload_optimizer": {"device": "cpu", "super_offload": true}}, "checkpoint": {"writer": {"type": "fast"}},
    "nebula": {"enabled": false}})");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_warning(check, "comet", "DeepSpeed's Comet monitor has no effect in Strata");
  expect_warning(check, "timers", "has no effect in Strata");
  expect_warning(check, "autotuning", "autotuner has no effect in Strata");
  expect_warning(check, "graph_harvesting", "has no effect in Strata");
  expect_warning(check, "zero_optimization.mics_shard_size", "MiCS has no effect in Strata");
  expect_warning(check, "zero_optimization.stage3_module_granularity_threshold", "has no effect in Strata");
  expect_warning(check, "zero_optimization.offload_optimizer.super_offload", "has no effect in Strata");
  expect_warning(check, "checkpoint.writer", "has no effect in Strata");
  expect_warning(check, "nebula", "has no effect in Strata");
}

// --- names DeepSpeed does not have --------------------------------------------------------

TEST(DeepSpeedFeatures, MisspelledRealKeysGetDidYouMean) {
  expect_error(check_text(R"({"compresion_training": {}})"), "compresion_training", "unknown key",
               "did you mean 'compression_training'?");
  expect_error(check_text(R"({"hybrid_engine": {"enabeld": true}})"), "hybrid_engine.enabeld", "unknown key",
               "did you mean 'enabled'?");
  expect_error(check_text(R"({"zero_optimization": {"mics_shard_sise": 4}})"), "zero_optimization.mics_shard_sise",
               "unknown key", "did you mean 'mics_shard_size'?");
  expect_error(check_text(R"({"eigenvalue": {"max_iters": 50}})"), "eigenvalue.max_iters", "unknown key",
               "did you mean 'max_iter'?");
  expect_error(check_text(R"({"elasticity": {"zzzzzz": 1}})"), "elasticity.zzzzzz", "unknown key",
               "DeepSpeed 0.19.6's keys of 'elasticity': 'enabled', 'max_train_batch_size'");
  // Open sections take any member name.
  EXPECT_TRUE(check_text(R"({"datastates_ckpt": {"anything": {"deep": 1}}})").ok());
  // And a key no DeepSpeed release has stays unknown.
  expect_error(check_text(R"({"turbo_mode": true})"), "turbo_mode", "unknown key", "");
}

}  // namespace
}  // namespace strata
