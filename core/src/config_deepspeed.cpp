// DeepSpeed keys that Strata's key table lacks (see deepspeed_keys.h and
// Note [DeepSpeed keys]). The strict walk (config_parse.cpp) hands each such
// key here instead of calling it unknown; its members are checked against
// DeepSpeed's names, and each feature is reported once: a warning when it
// has no effect in Strata or is switched off, an error where the file
// switches on a feature that changes what training computes.
#include <fmt/format.h>

#include "config_internal.h"

namespace strata::config_detail {
namespace {

using nlohmann::ordered_json;

std::string_view parent_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

std::string_view name_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Whether `value`, given for `key`, switches its feature on (DeepSpeedKey::off).
bool switches_on(const DeepSpeedKey& key, const ordered_json& value) {
  if (key.off.empty() || value.is_null()) return false;
  if (key.off == "*") return true;
  if (key.off == "enabled:false") {
    if (!value.is_object()) return !(value.is_boolean() && !value.get<bool>());
    auto it = value.find("enabled");
    return it == value.end() || !(it->is_boolean() && !it->get<bool>());
  }
  std::string_view rest = key.off;
  while (!rest.empty()) {
    const size_t bar = rest.find('|');
    const std::string_view choice = rest.substr(0, bar);
    if (ordered_json::parse(choice) == value) return false;
    rest = bar == std::string_view::npos ? std::string_view{} : rest.substr(bar + 1);
  }
  return true;
}

// ", or set enabled to false": the first spelling of the off value.
std::string how_to_switch_off(const DeepSpeedKey& key) {
  if (key.off.empty() || key.off == "*" || key.off == "enabled:false") return "";
  if (key.off == "null") return fmt::format(", or remove '{}'", name_of(key.path));
  return fmt::format(", or set {} to {}", name_of(key.path), key.off.substr(0, key.off.find('|')));
}

}  // namespace

bool Checker::deepspeed_key(std::string_view parent, std::string_view name, const ordered_json& value,
                            const std::string& written) {
  const std::string path = parent.empty() ? std::string(name) : fmt::format("{}.{}", parent, name);
  const DeepSpeedKey* key = find_deepspeed_key(path);
  if (key == nullptr || key->feature == "strata") return false;
  walk_deepspeed(*key, value, written);
  return true;
}

void Checker::walk_deepspeed(const DeepSpeedKey& key, const ordered_json& value, const std::string& written) {
  const DeepSpeedFeature* feature = find_deepspeed_feature(key.feature);
  if (feature == nullptr) return;  // the table test keeps this from happening
  DeepSpeedUse* use = nullptr;
  for (DeepSpeedUse& u : deepspeed_uses) {
    if (u.feature == feature) use = &u;
  }
  if (use == nullptr) {
    deepspeed_uses.push_back({feature, written, {}});
    use = &deepspeed_uses.back();
  }
  if (feature->cls == DeepSpeedKeyClass::kUnsupported && switches_on(key, value)) use->on.emplace_back(written, &key);
  if (!value.is_object()) return;
  for (auto it = value.begin(); it != value.end(); ++it) {
    const std::string child_path = fmt::format("{}.{}", key.path, it.key());
    const std::string child_written = fmt::format("{}.{}", written, it.key());
    if (const DeepSpeedKey* child = find_deepspeed_key(child_path)) {
      walk_deepspeed(*child, it.value(), child_written);
      continue;
    }
    if (key.open) continue;
    std::vector<std::string> siblings;
    std::vector<std::string_view> listed;
    for (const DeepSpeedKey& k : deepspeed_keys()) {
      if (parent_of(k.path) != key.path) continue;
      siblings.emplace_back(name_of(k.path));
      listed.push_back(name_of(k.path));
    }
    std::string hint;
    constexpr size_t kMaxSuggestBytes = 128;
    if (it.key().size() <= kMaxSuggestBytes) {
      if (auto near = nearest_name(it.key(), siblings)) hint = fmt::format("did you mean '{}'?", *near);
    }
    if (hint.empty()) {
      std::string names;
      for (std::string_view n : listed) names += fmt::format("{}'{}'", names.empty() ? "" : ", ", n);
      hint = fmt::format("DeepSpeed {}'s keys of '{}': {}", kDeepSpeedRelease, written, names);
    }
    error(child_written, fmt::format("unknown key '{}'", it.key()), hint);
  }
}

void Checker::report_deepspeed() {
  for (const DeepSpeedUse& use : deepspeed_uses) {
    const DeepSpeedFeature& f = *use.feature;
    if (f.cls == DeepSpeedKeyClass::kNoEffect) {
      warn(use.first, fmt::format("accepted, but DeepSpeed's {} has no effect in Strata: {}", f.name, f.why),
           "remove it to silence this warning (see docs/deepspeed-keys.md)");
      continue;
    }
    if (use.on.empty()) {
      warn(use.first,
           fmt::format("accepted because it is off: DeepSpeed's {} is not supported by Strata, and its keys have no "
                       "effect",
                       f.name),
           "remove it to silence this warning (see docs/deepspeed-keys.md)");
      continue;
    }
    for (const auto& [written, key] : use.on) {
      error(written, fmt::format("turns on DeepSpeed's {}, which Strata does not support: {}", f.name, f.why),
            fmt::format("remove '{}'{} to train with Strata (see docs/deepspeed-keys.md)", use.first,
                        how_to_switch_off(*key)));
    }
  }
}

}  // namespace strata::config_detail
