// Strict parsing of DeepSpeed JSON configs against the key table.
// Note [Strict walk]
// The document is walked in file order. Every key is looked up among the
// children of its section in the table (canonical names and aliases). An
// unknown key is an error that names its JSON path and suggests the nearest
// sibling (optimal string alignment distance, so "pin_memroy" finds
// "pin_memory") or, when the name is a known key elsewhere, where it
// belongs. Values are type- and range-checked before they reach the typed
// Config; nothing stops at the first problem. Resolution ("auto", batch
// arithmetic, defaults that depend on other keys) and the rules that join
// several keys live in config_resolve.cpp.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>

#include "config_internal.h"
#include "config_values.h"
#include "strata/core/bounded_file.h"
#include "strata/core/config.h"
#include "strata/core/config_schema.h"
#include "strata/core/json_file.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"

namespace strata {

using nlohmann::json;
using nlohmann::ordered_json;

std::string_view offload_device_name(OffloadDevice d) { return config_detail::enum_name(d); }
std::string_view aio_engine_name(AioEngineKind e) { return config_detail::enum_name(e); }
std::string_view optimizer_type_name(OptimizerType t) { return config_detail::enum_name(t); }
std::string_view scheduler_type_name(SchedulerType t) { return config_detail::enum_name(t); }
std::string_view train_precision_name(TrainPrecision p) {
  switch (p) {
    case TrainPrecision::kFp32: return "fp32";
    case TrainPrecision::kFp16: return "fp16";
    case TrainPrecision::kBf16: return "bf16";
  }
  return "?";
}

bool Config::is_unresolved(std::string_view path) const {
  return std::find(unresolved.begin(), unresolved.end(), path) != unresolved.end();
}

// Keys, values and paths come from a user's file: every field of a printed
// issue goes through printable() (strata/core/printable.h).
std::string format_issue(const ConfigIssue& issue, std::string_view source) {
  constexpr size_t kMaxPrintedBytes = 512;
  std::string out;
  if (!source.empty()) out += fmt::format("{}: ", printable(source, kMaxPrintedBytes));
  out += issue.severity == IssueSeverity::kError ? "error: " : "warning: ";
  if (!issue.path.empty()) out += fmt::format("{}: ", printable(issue.path, kMaxPrintedBytes));
  out += printable(issue.message, 4 * kMaxPrintedBytes);
  if (!issue.hint.empty()) out += fmt::format("\n    hint: {}", printable(issue.hint, 4 * kMaxPrintedBytes));
  return out;
}

bool ConfigCheck::ok() const { return error_count() == 0; }
size_t ConfigCheck::error_count() const {
  return static_cast<size_t>(std::count_if(issues.begin(), issues.end(),
                                           [](const ConfigIssue& i) { return i.severity == IssueSeverity::kError; }));
}
size_t ConfigCheck::warning_count() const { return issues.size() - error_count(); }
std::string ConfigCheck::format() const {
  std::string out;
  for (const ConfigIssue& issue : issues) {
    out += format_issue(issue, config.source);
    out += '\n';
  }
  return out;
}

namespace config_detail {

size_t edit_distance(std::string_view a, std::string_view b) {
  // Optimal string alignment: insertions, deletions, substitutions and
  // transpositions of neighbours each cost 1.
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1, 0));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                                  std::tolower(static_cast<unsigned char>(b[j - 1]))
                              ? 0
                              : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::optional<std::string> nearest_name(std::string_view word, const std::vector<std::string>& candidates) {
  size_t best = std::numeric_limits<size_t>::max();
  std::optional<std::string> best_name;
  for (const std::string& c : candidates) {
    const size_t dist = edit_distance(word, c);
    if (dist < best) {
      best = dist;
      best_name = c;
    }
  }
  // Close enough to be a typo: a third of the word, at least 2 edits
  // (1 for very short words), or one name containing the other.
  const size_t limit = std::max<size_t>(word.size() <= 3 ? 1 : 2, word.size() / 3);
  if (best_name && best <= limit) return best_name;
  for (const std::string& c : candidates) {
    if (word.size() >= 4 && (c.find(word) != std::string::npos || word.find(c) != std::string::npos)) return c;
  }
  return std::nullopt;
}

namespace {

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = text.find(sep, start);
    const size_t stop = end == std::string_view::npos ? text.size() : end;
    if (stop > start) out.push_back(text.substr(start, stop - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return out;
}

std::string join_path(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string(key) : fmt::format("{}.{}", parent, key);
}

std::string list_names(const std::vector<std::string_view>& names, std::string_view last_sep = " or ") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += (i + 1 == names.size()) ? std::string(last_sep) : std::string(", ");
    out += fmt::format("'{}'", names[i]);
  }
  return out;
}

// Children of each section, by canonical parent path.
const std::unordered_map<std::string, std::vector<const ConfigKey*>>& children_index() {
  static const auto index = [] {
    std::unordered_map<std::string, std::vector<const ConfigKey*>> m;
    for (const ConfigKey& k : config_keys()) m[std::string(k.parent())].push_back(&k);
    return m;
  }();
  return index;
}

struct Lookup {
  const ConfigKey* key = nullptr;
  bool legacy = false;  // matched a '~' alias
};

Lookup find_child(std::string_view parent, std::string_view name) {
  const auto& index = children_index();
  auto it = index.find(std::string(parent));
  if (it == index.end()) return {};
  for (const ConfigKey* k : it->second) {
    if (k->name() == name) return {k, false};
    for (std::string_view alias : split(k->aliases, ',')) {
      const bool legacy = !alias.empty() && alias.front() == '~';
      if (legacy) alias.remove_prefix(1);
      if (alias == name) return {k, legacy};
    }
  }
  return {};
}

std::string describe_json(const ordered_json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

std::string format_number(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == std::floor(x) && std::fabs(x) < 1e15) return fmt::format("{}", static_cast<int64_t>(x));
  return fmt::format("{}", x);
}

std::string range_text(const ConfigKey& k) {
  const bool lo = std::isfinite(k.min), hi = std::isfinite(k.max);
  const char* lo_op = k.has(kKeyMinExclusive) ? "<" : "<=";
  if (lo && hi) return fmt::format("{} {} value <= {}", format_number(k.min), lo_op, format_number(k.max));
  if (lo) return fmt::format("value {} {}", k.has(kKeyMinExclusive) ? ">" : ">=", format_number(k.min));
  if (hi) return fmt::format("value <= {}", format_number(k.max));
  return "any value";
}

bool looks_numeric(const std::string& s) {
  if (s.empty()) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end != nullptr && *end == '\0';
}

constexpr std::array<std::string_view, 9> kDeepSpeedOnlyOptimizers{
    "Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "MuAdam", "MuAdamW", "MuSGD", "SGD", "FusedAdam"};

}  // namespace

static bool is_auto_value(const ConfigKey& k, const ordered_json& v) {
  if (!v.is_string() || v.get<std::string>() != "auto" || k.type == KeyType::kString) return false;
  // "auto" is an ordinary choice of enums such as aio.engine.
  return !(k.type == KeyType::kEnum && (k.choices == "auto" || k.choices.rfind("auto|", 0) == 0 ||
                                        k.choices.find("|auto") != std::string_view::npos));
}

void Checker::error(std::string path, std::string message, std::string hint) {
  issues.push_back({IssueSeverity::kError, std::move(path), std::move(message), std::move(hint)});
}
void Checker::warn(std::string path, std::string message, std::string hint) {
  issues.push_back({IssueSeverity::kWarning, std::move(path), std::move(message), std::move(hint)});
}

bool Checker::check_number_range(const ConfigKey& k, double x, const std::string& path, const ordered_json& v) {
  const bool below = k.has(kKeyMinExclusive) ? !(x > k.min) : x < k.min;
  if (below || x > k.max) {
    error(path, fmt::format("{} is out of range", describe_json(v)),
          fmt::format("allowed: {} (default {})", range_text(k), k.default_json));
    return false;
  }
  return true;
}

bool Checker::check_value(const ConfigKey& k, const ordered_json& v, const std::string& path) {
  const std::string default_text = k.default_note.empty() ? std::string(k.default_json) : std::string(k.default_note);
  if (v.is_null()) {
    if (k.has(kKeyNullable)) return true;
    error(path, fmt::format("null is not a valid {}", key_type_name(k.type)),
          fmt::format("remove the key to use the default ({})", default_text));
    return false;
  }
  if (is_auto_value(k, v)) {
    if (k.has(kKeyAuto)) return true;
    error(path, "\"auto\" is not accepted for this key",
          fmt::format("give a {} (default {}); \"auto\" is only for keys that a launcher fills in", key_type_name(k.type),
                      default_text));
    return false;
  }
  switch (k.type) {
    case KeyType::kSection:
      return v.is_object();
    case KeyType::kBool: {
      if (v.is_boolean()) return true;
      if (v.is_string()) {
        std::string s = v.get<std::string>();
        std::string lower = s;
        for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (lower == "true" || lower == "false") {
          error(path, fmt::format("is the string \"{}\", not a boolean", s), fmt::format("write {} without quotes", lower));
          return false;
        }
      }
      error(path, fmt::format("{} is not a boolean", describe_json(v)), "write true or false (without quotes)");
      return false;
    }
    case KeyType::kInteger:
    case KeyType::kNumber: {
      if (v.is_string()) {
        const std::string s = v.get<std::string>();
        if (looks_numeric(s)) {
          error(path, fmt::format("is the string \"{}\", not a number", s), fmt::format("write {} without quotes", s));
        } else {
          error(path, fmt::format("\"{}\" is not a number", s), fmt::format("give a number (default {})", default_text));
        }
        return false;
      }
      if (!v.is_number() || v.is_boolean()) {
        error(path, fmt::format("{} is not a number", describe_json(v)), fmt::format("give a number (default {})", default_text));
        return false;
      }
      const double x = v.get<double>();
      if (!std::isfinite(x)) {
        error(path, "is not a finite number", fmt::format("default {}", default_text));
        return false;
      }
      // Integer keys are stored as int64: 18446744073709551615 must not become -1,
      // nor 2^63 INT64_MIN, whatever the key's own range says.
      if (k.type == KeyType::kInteger &&
          ((v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) ||
           (v.is_number_float() && !(std::fabs(x) < 9223372036854775808.0)))) {
        error(path, fmt::format("{} does not fit in a 64-bit signed integer", describe_json(v)),
              fmt::format("allowed: {} (default {})", range_text(k), default_text));
        return false;
      }
      if (k.type == KeyType::kInteger && v.is_number_float() && x != std::floor(x)) {
        error(path, fmt::format("{} is not a whole number", describe_json(v)),
              fmt::format("this key counts elements or steps; give an integer such as {}", format_number(std::floor(x))));
        return false;
      }
      return check_number_range(k, x, path, v);
    }
    case KeyType::kString:
      if (v.is_string()) return true;
      error(path, fmt::format("{} is not a string", describe_json(v)), "write the value in double quotes");
      return false;
    case KeyType::kEnum: {
      const auto choices = split(k.choices, '|');
      if (!v.is_string()) {
        error(path, fmt::format("{} is not one of {}", describe_json(v), list_names(choices)), "write the choice as a string");
        return false;
      }
      const std::string s = v.get<std::string>();
      for (std::string_view c : choices) {
        if (c == s) return true;
        if (equal_caseless(c, s)) {
          if (k.has(kKeyCaseless)) return true;
          error(path, fmt::format("\"{}\" is not one of {}", s, list_names(choices)), fmt::format("did you mean '{}'?", c));
          return false;
        }
      }
      if (k.path == "optimizer.type") {
        for (std::string_view name : kDeepSpeedOnlyOptimizers) {
          if (equal_caseless(name, s)) {
            error(path, fmt::format("\"{}\" is a DeepSpeed optimizer that Strata does not implement", s),
                  fmt::format("use one of {}", list_names(choices)));
            return false;
          }
        }
      }
      std::vector<std::string> names(choices.begin(), choices.end());
      auto near = nearest_name(s, names);
      error(path, fmt::format("\"{}\" is not one of {}", s, list_names(choices)),
            near ? fmt::format("did you mean '{}'?", *near) : fmt::format("default {}", default_text));
      return false;
    }
    case KeyType::kBytes: {
      if (v.is_string()) {
        auto parsed = parse_bytes(v.get<std::string>(), path);
        if (parsed.ok()) return true;
        error(path, parsed.status().message(), "write a byte count such as 268435456, \"256MiB\" or \"80GB\"");
        return false;
      }
      if (v.is_number()) {
        // Stored as uint64: 2^63 must not wrap to 0 (unlimited), nor 1e30 clamp.
        const JsonByteCount bytes = json_byte_count(v);
        if (bytes.bytes) return true;
        error(path, fmt::format("{} {}", describe_json(v), bytes.problem),
              "write a whole number of bytes up to 18446744073709551615, or a size with a unit such as \"64GiB\" "
              "or \"80GB\"");
        return false;
      }
      error(path, fmt::format("{} is not a byte count", describe_json(v)),
            "write a whole number of bytes or a string with a unit such as \"256MiB\" or \"80GB\"");
      return false;
    }
    case KeyType::kNumberPair: {
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number() || v[0].is_boolean() ||
          v[1].is_boolean()) {
        std::string hint = fmt::format("write two numbers, e.g. {}", k.default_json);
        if (v.is_array() && v.size() == 2 && (v[0].is_string() || v[1].is_string())) hint += " (numbers without quotes)";
        error(path, fmt::format("{} is not a pair of numbers", describe_json(v)), hint);
        return false;
      }
      bool ok = true;
      for (size_t i = 0; i < 2; ++i) {
        const double x = v[i].get<double>();
        if (x < k.min || x >= k.max) {
          error(fmt::format("{}[{}]", path, i), fmt::format("{} is out of range", describe_json(v[i])),
                fmt::format("allowed: {} <= value < {}", format_number(k.min), format_number(k.max)));
          ok = false;
        }
      }
      return ok;
    }
    case KeyType::kStringList: {
      bool ok = v.is_array();
      if (ok) {
        for (const auto& e : v) ok = ok && e.is_string();
      }
      if (!ok) error(path, fmt::format("{} is not a list of strings", describe_json(v)), "write [\"name\", ...]");
      return ok;
    }
  }
  return false;
}

// A key of another section whose name is within typo distance of `name`,
// as its full path ("zero_optimization.offload_optimizer").
static std::optional<std::string> nearest_key_elsewhere(std::string_view name, std::string_view parent) {
  std::vector<std::string> names;
  std::vector<std::string_view> paths;
  for (const ConfigKey& k : config_keys()) {
    if (k.parent() == parent || k.has(kKeyDeprecated)) continue;
    names.emplace_back(k.name());
    paths.push_back(k.path);
  }
  auto near = nearest_name(name, names);
  if (!near || edit_distance(name, *near) == 0) return std::nullopt;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == *near) return std::string(paths[i]);
  }
  return std::nullopt;
}

void Checker::unknown_key(std::string_view parent, std::string_view name, const std::string& path) {
  if (parent == "optimizer.params" && name == "max_grad_norm") {
    error(path, "max_grad_norm is not an optimizer parameter",
          "remove it and set the top-level \"gradient_clipping\" to the same value");
    return;
  }
  // A known key in the wrong section?
  std::vector<std::string_view> homes;
  for (const ConfigKey& k : config_keys()) {
    if (k.name() == name && k.parent() != parent) homes.push_back(k.parent());
  }
  const std::string where = parent.empty() ? std::string("the top level") : fmt::format("'{}'", parent);
  if (!homes.empty()) {
    std::string hint;
    if (std::find(homes.begin(), homes.end(), std::string_view{}) != homes.end()) {
      hint = fmt::format("move it to the top level: '{}' is a top-level key", name);
    } else {
      hint = fmt::format("move it into {}", list_names(homes));
    }
    error(path, fmt::format("'{}' is not a key of {}", name, where), hint);
    return;
  }
  std::vector<std::string> siblings;
  std::vector<std::string_view> sibling_views;
  auto it = children_index().find(std::string(parent));
  if (it != children_index().end()) {
    for (const ConfigKey* k : it->second) {
      siblings.emplace_back(k->name());
      sibling_views.push_back(k->name());
      for (std::string_view alias : split(k->aliases, ',')) {
        if (!alias.empty() && alias.front() != '~') siblings.emplace_back(alias);
      }
    }
  }
  // DeepSpeed's names there that Strata's table lacks ("compresion_training").
  for (const DeepSpeedKey& k : deepspeed_keys()) {
    const size_t dot = k.path.rfind('.');
    const std::string_view k_parent = dot == std::string_view::npos ? std::string_view{} : k.path.substr(0, dot);
    const std::string_view k_name = dot == std::string_view::npos ? k.path : k.path.substr(dot + 1);
    if (k_parent == parent && k.feature != "strata") siblings.emplace_back(k_name);
  }
  std::string hint;
  // Edit distances are quadratic: a key far longer than any known key has no
  // near neighbour, so skip the search (a 1 MB key took 45 s before).
  constexpr size_t kMaxSuggestBytes = 128;
  if (name.size() > kMaxSuggestBytes) {
    hint = fmt::format("see docs/config.md (strata config defaults) for the keys of {}", where);
  } else if (auto near = nearest_name(name, siblings)) {
    hint = fmt::format("did you mean '{}'?", *near);
  } else if (auto elsewhere = nearest_key_elsewhere(name, parent)) {
    hint = fmt::format("did you mean '{}'?", *elsewhere);
  } else if (!sibling_views.empty() && sibling_views.size() <= 16) {
    hint = fmt::format("known keys of {}: {}", where, list_names(sibling_views, ", "));
  } else {
    hint = fmt::format("see docs/config.md (strata config defaults) for the keys of {}", where);
  }
  error(path, fmt::format("unknown key '{}'", name), hint);
}

void Checker::walk(const ordered_json& object, const std::string& parent, const std::string& written_parent) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string& name = it.key();
    const ordered_json& value = it.value();
    const std::string written = join_path(written_parent, name);
    Lookup found = find_child(parent, name);
    if (found.key == nullptr) {
      if (!deepspeed_key(parent, name, value, written)) unknown_key(parent, name, written);
      continue;
    }
    const ConfigKey& k = *found.key;
    const std::string canonical(k.path);
    if (found.legacy) {
      warn(written, fmt::format("'{}' is a legacy name", name), fmt::format("write '{}'", k.name()));
    }
    auto seen = written_as.find(canonical);
    if (seen != written_as.end()) {
      error(written, fmt::format("given twice, also as '{}'", seen->second), "keep one of the two names");
      continue;
    }
    written_as[canonical] = written;
    if (k.type == KeyType::kSection) {
      if (!value.is_object()) {
        error(written, fmt::format("{} is not a section", describe_json(value)),
              fmt::format("write an object: \"{}\": {{ ... }}", name));
        continue;
      }
      if (k.has(kKeyIgnored)) {
        warn(written, "accepted for DeepSpeed compatibility; Strata does not act on it", "");
      }
      walk(value, canonical, written);
      continue;
    }
    if (k.has(kKeyDeprecated)) warn(written, "deprecated key", std::string(k.meaning));
    if (!check_value(k, value, written)) continue;
    if (is_auto_value(k, value)) {
      autos.push_back(canonical);
      continue;
    }
    values.emplace_back(canonical, value);
  }
}

const ordered_json* Checker::given(std::string_view canonical) const {
  for (const auto& [path, value] : values) {
    if (path == canonical) return &value;
  }
  return nullptr;
}

std::string Checker::written(std::string_view canonical) const {
  auto it = written_as.find(std::string(canonical));
  return it != written_as.end() ? it->second : std::string(canonical);
}

bool Checker::is_auto(std::string_view canonical) const {
  return std::find(autos.begin(), autos.end(), canonical) != autos.end();
}

// The Config with every given (non-auto) value applied over the defaults,
// in table order so that explicit keys win over deprecated ones.
void Checker::apply(Config& config) const {
  for (const ConfigKey& k : config_keys()) {
    if (k.type == KeyType::kSection) continue;
    const ordered_json* v = given(k.path);
    if (v == nullptr) continue;
    const json plain = json::parse(v->dump());
    if (plain.is_null() && k.type == KeyType::kBool) continue;  // null: unset, resolved later
    if (k.has(kKeyIgnored)) {
      config.ignored[std::string(k.path)] = *v;
    } else if (k.parent() == "scheduler.params") {
      config.scheduler.params[std::string(k.name())] = plain;
    } else if (k.set != nullptr) {
      k.set(config, plain);
    }
  }
  config.optimizer.given = written_as.count("optimizer") > 0;
}

}  // namespace config_detail

ConfigCheck check_config_ordered(const ordered_json& document, const ConfigOptions& options,
                                 std::vector<ConfigIssue> early_issues) {
  ConfigCheck check;
  check.config.source = options.source;
  config_detail::Checker checker(options);
  checker.issues = std::move(early_issues);
  if (!document.is_object()) {
    checker.error("", fmt::format("the config is a JSON {}, not an object", document.type_name()),
                  "a DeepSpeed config is one JSON object: { \"train_batch_size\": 32, ... }");
    check.issues = std::move(checker.issues);
    return check;
  }
  checker.walk(document, "", "");
  checker.report_deepspeed();
  checker.apply(check.config);
  config_detail::resolve(checker, check.config);
  for (const ConfigIssue& issue : checker.issues) {
    if (issue.severity == IssueSeverity::kWarning) check.config.warnings.push_back(issue);
  }
  check.issues = std::move(checker.issues);
  return check;
}

// Note [Bounded input]
// The text goes through parse_json_text (strata/core/json_file.h, Note
// [Strict JSON]): NUL bytes, nesting deeper than 64 levels and more than
// kMaxConfigBytes are refused before the parser runs; every duplicate key is
// an error (DeepSpeed refuses them too). DeepSpeed configs nest 4 levels deep
// and weigh a few KB.
ConfigCheck check_config_text(std::string_view text, const ConfigOptions& options) {
  ParsedJson parsed = parse_json_text(text, {.max_bytes = kMaxConfigBytes, .max_depth = 64, .what = "config"});
  const auto to_issue = [](JsonProblem p) {
    return ConfigIssue{IssueSeverity::kError, std::move(p.path), std::move(p.message), std::move(p.hint)};
  };
  std::vector<ConfigIssue> early;
  for (JsonProblem& duplicate : parsed.duplicate_keys) early.push_back(to_issue(std::move(duplicate)));
  if (parsed.error) {
    ConfigCheck check;
    check.config.source = options.source;
    check.issues = std::move(early);
    check.issues.push_back(to_issue(std::move(*parsed.error)));
    return check;
  }
  return check_config_ordered(parsed.document, options, std::move(early));
}

ConfigCheck check_config(const nlohmann::json& document, const ConfigOptions& options) {
  return check_config_ordered(ordered_json::parse(document.dump()), options, {});
}

ConfigCheck check_config_file(const std::string& path, const ConfigOptions& options) {
  ConfigOptions with_source = options;
  if (with_source.source.empty()) with_source.source = path;
  Result<std::string> text = read_config_file(path);
  if (!text.ok()) {
    ConfigCheck check;
    check.config.source = with_source.source;
    check.issues.push_back({IssueSeverity::kError, "", text.status().message(),
                            "check the path; configs are JSON files such as ds_config.json"});
    return check;
  }
  return check_config_text(*text, with_source);
}

Result<std::string> read_config_file(const std::string& path) {
  return read_regular_file(path, kMaxConfigBytes,
                           {.what = "config file", .flag = "", .hint = "give a DeepSpeed JSON config file"});
}

namespace {
Result<Config> to_result(ConfigCheck check) {
  if (check.ok()) return std::move(check.config);
  std::string message = fmt::format("{} error(s) in config{}:\n", check.error_count(),
                                    check.config.source.empty() ? "" : fmt::format(" '{}'", printable(check.config.source, 256)));
  for (const ConfigIssue& issue : check.issues) {
    if (issue.severity == IssueSeverity::kError) message += format_issue(issue, check.config.source) + "\n";
  }
  if (!message.empty() && message.back() == '\n') message.pop_back();
  return InvalidArgument(std::move(message));
}
}  // namespace

Result<Config> parse_config(const nlohmann::json& json, const ConfigOptions& options) {
  return to_result(check_config(json, options));
}
Result<Config> parse_config_text(std::string_view text, const ConfigOptions& options) {
  return to_result(check_config_text(text, options));
}
Result<Config> load_config(const std::string& path, const ConfigOptions& options) {
  return to_result(check_config_file(path, options));
}

}  // namespace strata
