// DeepSpeed keys naming a mechanism Strata's engine does not have (Note [Keys
// without effect], config_resolve.cpp): accepted, stored, and a warning at
// the path as written that says it has no effect and why, only when the file
// sets one to something Strata does not do.
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "config_test_util.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using testing::check_text;
using testing::expect_warning;
using testing::issue_at;

size_t warnings_at(const ConfigCheck& check, std::string_view path) {
  size_t n = 0;
  for (const ConfigIssue& issue : check.issues) n += issue.severity == IssueSeverity::kWarning && issue.path == path;
  return n;
}

void expect_no_effect(const ConfigCheck& check, std::string_view path, std::string_view why) {
  expect_warning(check, path, "has no effect in Strata");
  expect_warning(check, path, why);
  const ConfigIssue* issue = issue_at(check, path, IssueSeverity::kWarning);
  ASSERT_NE(issue, nullptr);
  EXPECT_NE(issue->hint.find("silence this warning"), std::string::npos) << "hint: " << issue->hint;
  EXPECT_EQ(warnings_at(check, path), 1u) << check.format();
}

TEST(ConfigNoEffect, EachKeySetSaysWhyItHasNoEffect) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "allgather_bucket_size": 2e8, "reduce_scatter": false,
                          "round_robin_gradients": true, "stage3_model_persistence_threshold": 1000}})");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_no_effect(check, "zero_optimization.allgather_bucket_size", "all-gathered as one collective");
  expect_no_effect(check, "zero_optimization.reduce_scatter", "always reduce-scattered");
  expect_no_effect(check, "zero_optimization.reduce_scatter", "rank order");
  expect_no_effect(check, "zero_optimization.round_robin_gradients", "as that layer's reduction finishes");
  expect_no_effect(check, "zero_optimization.stage3_model_persistence_threshold",
                   "stage3_param_persistence_threshold");
  EXPECT_EQ(check.warning_count(), 4u) << check.format();
  // Accepted: the values are kept as given (config show prints them).
  const ZeroConfig& z = check.config.zero_optimization;
  EXPECT_EQ(z.allgather_bucket_size, 200'000'000);
  EXPECT_FALSE(z.reduce_scatter);
  EXPECT_TRUE(z.round_robin_gradients);
  EXPECT_EQ(z.stage3_model_persistence_threshold, 1000);
  // The same warnings reach Config::warnings, which strata train prints at start-up.
  EXPECT_EQ(check.config.warnings.size(), 4u);
}

TEST(ConfigNoEffect, UnsetKeysDrawNoWarning) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.warning_count(), 0u) << check.format();
}

TEST(ConfigNoEffect, BooleansSetToWhatStrataDoesDrawNoWarning) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2, "reduce_scatter": true, "round_robin_gradients": false}})");
  ASSERT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(check.warning_count(), 0u) << check.format();
}

TEST(ConfigNoEffect, AliasIsNamedAsWritten) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "model_persistence_threshold": 13}})");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_no_effect(check, "zero_optimization.model_persistence_threshold", "stage3_param_persistence_threshold");
}

TEST(ConfigNoEffect, ModelPersistenceBelowStage3WarnsOnce) {
  // Not also "has no effect below stage 3": it has none at any stage.
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 1, "stage3_model_persistence_threshold": 5, "stage3_max_live_parameters": 7}})");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_no_effect(check, "zero_optimization.stage3_model_persistence_threshold",
                   "stage3_param_persistence_threshold");
  expect_warning(check, "zero_optimization.stage3_max_live_parameters", "has no effect below stage 3");
  EXPECT_EQ(check.warning_count(), 2u) << check.format();
}

// The NVMe tier's pipelines, set for another device: accepted (DeepSpeed
// does), with a warning that they do nothing there.
TEST(ConfigNoEffect, PipelinesWithoutNvmeWarn) {
  for (const char* device : {"cpu", "none"}) {
    const ConfigCheck check = check_text(std::string(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": ")") + device +
                                         R"(", "pipeline_read": true, "pipeline_write": true}}})");
    ASSERT_TRUE(check.ok()) << check.format();
    expect_warning(check, "zero_optimization.offload_optimizer.pipeline_read",
                   std::string("has no effect: offload_optimizer.device is ") + device);
    expect_warning(check, "zero_optimization.offload_optimizer.pipeline_write", "has no effect");
    EXPECT_EQ(check.warning_count(), 2u) << check.format();
  }
  const ConfigCheck nvme = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp",
                          "pipeline_read": true, "pipeline_write": true}}})");
  ASSERT_TRUE(nvme.ok()) << nvme.format();
  EXPECT_EQ(nvme.warning_count(), 0u) << nvme.format();
}

// Early updates forced on without offloaded state: the engine refuses it, so
// the config check warns (a flag may still offload the state).
TEST(ConfigNoEffect, SpeculativeOptimizerOnNeedsOffloadedState) {
  const ConfigCheck check = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2}, "strata": {"speculative_optimizer": "on"}})");
  ASSERT_TRUE(check.ok()) << check.format();
  expect_warning(check, "strata.speculative_optimizer", "offload_optimizer.device is none, so a run with this config");
  EXPECT_NE(issue_at(check, "strata.speculative_optimizer", IssueSeverity::kWarning)->hint.find("--offload-optimizer"),
            std::string::npos);
  for (const char* mode : {"auto", "off"}) {
    const ConfigCheck other = check_text(std::string(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2}, "strata": {"speculative_optimizer": ")") + mode + R"("}})");
    EXPECT_TRUE(other.ok()) << other.format();
  }
  const ConfigCheck offloaded = check_text(R"({"train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "strata": {"speculative_optimizer": "on"}})");
  EXPECT_TRUE(offloaded.ok()) << offloaded.format();
}

}  // namespace
}  // namespace strata
