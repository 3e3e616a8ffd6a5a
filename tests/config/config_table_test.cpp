// The key table is the one source of truth: struct defaults, docs and the
// parser must agree with it.
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "strata/core/config.h"
#include "strata/core/config_schema.h"

namespace strata {
namespace {

TEST(ConfigTable, StructDefaultsEqualTableDefaults) {
  const Config defaults;
  size_t compared = 0;
  for (const ConfigKey& key : config_keys()) {
    if (key.get == nullptr) continue;
    const nlohmann::json actual = key.get(defaults);
    nlohmann::json expected = key.default_value();
    if (key.path == "zero_optimization.overlap_comm") expected = false;  // unset resolves to false at stage 0
    if (expected.is_number() && actual.is_number()) {
      EXPECT_DOUBLE_EQ(actual.get<double>(), expected.get<double>()) << key.path;
    } else {
      EXPECT_EQ(actual, expected) << key.path;
    }
    ++compared;
  }
  EXPECT_GT(compared, 60u);
}

TEST(ConfigTable, EveryKeyIsDocumentedAndUnique) {
  std::set<std::string_view> paths;
  for (const ConfigKey& key : config_keys()) {
    EXPECT_TRUE(paths.insert(key.path).second) << "duplicate " << key.path;
    EXPECT_FALSE(key.meaning.empty()) << key.path;
    EXPECT_NO_THROW(key.default_value()) << key.path;
    if (!key.parent().empty()) {
      const ConfigKey* parent = find_config_key(key.parent());
      ASSERT_NE(parent, nullptr) << key.path;
      EXPECT_EQ(parent->type, KeyType::kSection) << key.path;
    }
    if (key.type == KeyType::kEnum) {
      EXPECT_FALSE(key.choices.empty()) << key.path;
    }
    // Acted-upon, non-deprecated leaves are bound to the struct (scheduler
    // parameters live in a JSON map by design).
    if (key.type != KeyType::kSection && !key.has(kKeyIgnored) && key.parent() != "scheduler.params") {
      EXPECT_NE(key.set, nullptr) << key.path;
      if (!key.has(kKeyDeprecated)) {
        EXPECT_NE(key.get, nullptr) << key.path;
      }
    }
  }
}

// Each default, written into a config on its own, is accepted by the parser.
TEST(ConfigTable, EveryDefaultPassesItsOwnCheck) {
  for (const ConfigKey& key : config_keys()) {
    if (key.type == KeyType::kSection || key.has(kKeyRequired)) continue;
    nlohmann::json doc = nlohmann::json::object();
    nlohmann::json* node = &doc;
    std::string path(key.path);
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      node = &(*node)[path.substr(start, dot == std::string::npos ? std::string::npos : dot - start)];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    *node = key.default_value();
    if (key.parent() == "scheduler.params") {
      std::string type = key.applies_to.empty() ? "WarmupLR" : std::string(key.applies_to.substr(0, key.applies_to.find('|')));
      doc["scheduler"]["type"] = type;
      if (type == "WarmupDecayLR" || type == "WarmupCosineLR") doc["scheduler"]["params"]["total_num_steps"] = 100000;
      if (type == "OneCycle") {
        doc["scheduler"]["params"]["cycle_min_lr"] = 0.0;
        doc["scheduler"]["params"]["cycle_max_lr"] = 1.0;
      }
    }
    if (key.parent() == "optimizer.params" || key.path == "optimizer.type") {
      doc["optimizer"]["type"] = key.applies_to.empty() ? "Adam" : std::string(key.applies_to.substr(0, key.applies_to.find('|')));
      if (key.path == "optimizer.type") doc["optimizer"]["type"] = key.default_value();
    }
    const ConfigCheck check = check_config(doc);
    EXPECT_TRUE(check.ok()) << key.path << ": " << doc.dump() << "\n" << check.format();
  }
}

TEST(ConfigTable, DefaultsJsonIsAValidConfig) {
  const ConfigCheck check = check_config(nlohmann::json::parse(config_defaults_json().dump()));
  EXPECT_TRUE(check.ok()) << check.format();
  EXPECT_EQ(config_defaults_json()["zero_optimization"]["offload_param"]["buffer_size"], 100000000);
  EXPECT_EQ(config_defaults_json()["aio"]["intra_op_parallelism"], 1);
}

TEST(ConfigDocs, MarkdownIsUpToDate) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/docs/config.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << " is missing; run: strata config defaults --markdown > docs/config.md";
  std::stringstream committed;
  committed << in.rdbuf();
  EXPECT_TRUE(committed.str() == config_keys_markdown())
      << path << " is out of date with the key table; regenerate it with: strata config defaults --markdown > docs/config.md";
}

TEST(ConfigDocs, MarkdownListsEveryKey) {
  const std::string md = config_keys_markdown();
  for (const ConfigKey& key : config_keys()) {
    if (key.type == KeyType::kSection) {
      EXPECT_NE(md.find(fmt::format("## `{}`", key.path)), std::string::npos) << key.path;
    } else {
      EXPECT_NE(md.find(fmt::format("| `{}` |", key.name())), std::string::npos) << key.path;
    }
  }
}

}  // namespace
}  // namespace strata
