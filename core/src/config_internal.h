#pragma once
// Internal: the state of one config check, shared by config_parse.cpp
// (walking the document) and config_resolve.cpp (auto, batch arithmetic,
// combination rules).

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/config.h"
#include "strata/core/config_schema.h"
#include "strata/core/deepspeed_keys.h"

namespace strata {

ConfigCheck check_config_ordered(const nlohmann::ordered_json& document, const ConfigOptions& options,
                                 std::vector<ConfigIssue> early_issues);

namespace config_detail {

// Optimal-string-alignment edit distance, case-insensitive.
size_t edit_distance(std::string_view a, std::string_view b);
// The candidate close enough to `word` to be what was meant, if any.
std::optional<std::string> nearest_name(std::string_view word, const std::vector<std::string>& candidates);

struct Checker {
  explicit Checker(const ConfigOptions& o) : options(o) {}

  const ConfigOptions& options;
  std::vector<ConfigIssue> issues;
  // Given (non-auto) values by canonical path, in document order.
  std::vector<std::pair<std::string, nlohmann::ordered_json>> values;
  // Canonical paths given as "auto".
  std::vector<std::string> autos;
  // Canonical path -> the path as written in the file (aliases kept).
  std::map<std::string, std::string> written_as;

  void error(std::string path, std::string message, std::string hint);
  void warn(std::string path, std::string message, std::string hint);

  void walk(const nlohmann::ordered_json& object, const std::string& parent, const std::string& written_parent);
  bool check_value(const ConfigKey& key, const nlohmann::ordered_json& value, const std::string& path);
  bool check_number_range(const ConfigKey& key, double x, const std::string& path, const nlohmann::ordered_json& value);
  void unknown_key(std::string_view parent, std::string_view name, const std::string& path);
  void apply(Config& config) const;

  // DeepSpeed keys that Strata's table lacks (config_deepspeed.cpp): the
  // features a file uses, in file order, and where each is switched on.
  struct DeepSpeedUse {
    const DeepSpeedFeature* feature = nullptr;
    std::string first;  // the first key of the feature, as written
    std::vector<std::pair<std::string, const DeepSpeedKey*>> on;
  };
  std::vector<DeepSpeedUse> deepspeed_uses;
  // True when parent.name is a DeepSpeed key (not in Strata's table): walked
  // against DeepSpeed's names and recorded for report_deepspeed().
  bool deepspeed_key(std::string_view parent, std::string_view name, const nlohmann::ordered_json& value,
                     const std::string& written);
  void walk_deepspeed(const DeepSpeedKey& key, const nlohmann::ordered_json& value, const std::string& written);
  // One warning per feature without effect, one error per feature switched on.
  void report_deepspeed();

  const nlohmann::ordered_json* given(std::string_view canonical) const;
  bool is_auto(std::string_view canonical) const;
  bool present(std::string_view canonical) const { return written_as.count(std::string(canonical)) > 0; }
  std::string written(std::string_view canonical) const;
};

// Resolves "auto", the batch triple, stage-dependent defaults and
// scheduler defaults, then checks the rules that join several keys.
void resolve(Checker& checker, Config& config);

}  // namespace config_detail
}  // namespace strata
