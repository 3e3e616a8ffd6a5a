#pragma once
// The one table of every config key Strata knows: JSON path, type,
// default, range or choices, and meaning. The parser checks files against
// it, `strata config defaults` prints it, and docs/config.md is generated
// from it (a test fails when the committed file is out of date).

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace strata {

struct Config;

enum class KeyType : uint8_t {
  kSection,     // a JSON object holding further keys
  kBool,        // true / false (never the strings "true" / "false")
  kInteger,     // a whole JSON number; 5e8 is fine when integral
  kNumber,      // any JSON number
  kString,      // free text
  kEnum,        // one of `choices`
  kBytes,       // a byte count: a whole number or a string with a unit ("80GB", "256MiB")
  kNumberPair,  // [a, b]
  kStringList,  // ["a", "b"]
};
std::string_view key_type_name(KeyType type);

// Key flags.
inline constexpr uint32_t kKeyAuto = 1u << 0;       // "auto" accepted (Hugging Face style)
inline constexpr uint32_t kKeyNullable = 1u << 1;   // null accepted (means "not set")
inline constexpr uint32_t kKeyIgnored = 1u << 2;    // DeepSpeed key accepted, Strata does not act on it
inline constexpr uint32_t kKeyDeprecated = 1u << 3; // accepted with a warning, mapped to a newer key
inline constexpr uint32_t kKeyRequired = 1u << 4;   // must be given when its section (and applies_to) apply
inline constexpr uint32_t kKeyCaseless = 1u << 5;   // enum matched case-insensitively
inline constexpr uint32_t kKeyMinExclusive = 1u << 6;

struct ConfigKey {
  std::string_view path;           // canonical JSON path: "zero_optimization.offload_optimizer.pin_memory"
  KeyType type = KeyType::kSection;
  std::string_view default_json;   // the default as JSON text; "null": not set
  std::string_view meaning;
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  std::string_view choices;        // kEnum: "none|cpu|nvme"
  // Other names accepted in the same section, comma separated. A leading
  // '~' marks a legacy name that draws a warning ("~bfloat16").
  std::string_view aliases;
  uint32_t flags = 0;
  // For optimizer.params.* and scheduler.params.*: the types the key
  // belongs to, "Adam|AdamW"; empty: every type.
  std::string_view applies_to;
  // Overrides the printed default in docs ("true at stage 3, else false").
  std::string_view default_note;
  // Binding to the typed Config (null for sections). `set` receives a
  // value that passed the type and range checks.
  void (*set)(Config& config, const nlohmann::json& value) = nullptr;
  nlohmann::json (*get)(const Config& config) = nullptr;

  bool has(uint32_t flag) const { return (flags & flag) != 0; }
  std::string_view name() const;    // last path component
  std::string_view parent() const;  // path without the last component ("" at top level)
  nlohmann::json default_value() const;
};

// Every key, in documentation order (sections before their keys).
std::span<const ConfigKey> config_keys();
// The key at a canonical path, or nullptr.
const ConfigKey* find_config_key(std::string_view path);

// docs/config.md, generated from the table.
std::string config_keys_markdown();
// Every default as one nested JSON document (what `strata config defaults` prints).
nlohmann::ordered_json config_defaults_json();

}  // namespace strata
