#pragma once
// Helpers for the config tests: check JSON text and find issues by path.
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "strata/core/config.h"

namespace strata::testing {

inline std::string example_path(std::string_view name) {
  return std::string(STRATA_SOURCE_DIR) + "/examples/configs/" + std::string(name);
}

inline ConfigCheck check_text(std::string_view text, int64_t world_size = 1) {
  ConfigOptions options;
  options.world_size = world_size;
  options.source = "test.json";
  return check_config_text(text, options);
}

// The first issue of `severity` at exactly `path`, or nullptr.
inline const ConfigIssue* issue_at(const ConfigCheck& check, std::string_view path,
                                   IssueSeverity severity = IssueSeverity::kError) {
  for (const ConfigIssue& issue : check.issues) {
    if (issue.path == path && issue.severity == severity) return &issue;
  }
  return nullptr;
}

// Asserts one error at `path` whose message contains `message` and whose
// hint contains `hint`.
inline void expect_error(const ConfigCheck& check, std::string_view path, std::string_view message,
                         std::string_view hint) {
  const ConfigIssue* issue = issue_at(check, path);
  ASSERT_NE(issue, nullptr) << "no error at '" << path << "'; issues:\n" << check.format();
  EXPECT_NE(issue->message.find(message), std::string::npos) << "message: " << issue->message;
  EXPECT_NE(issue->hint.find(hint), std::string::npos) << "hint: " << issue->hint;
  EXPECT_FALSE(check.ok());
}

inline void expect_warning(const ConfigCheck& check, std::string_view path, std::string_view message) {
  const ConfigIssue* issue = issue_at(check, path, IssueSeverity::kWarning);
  ASSERT_NE(issue, nullptr) << "no warning at '" << path << "'; issues:\n" << check.format();
  EXPECT_NE(issue->message.find(message), std::string::npos) << "message: " << issue->message;
}

}  // namespace strata::testing
