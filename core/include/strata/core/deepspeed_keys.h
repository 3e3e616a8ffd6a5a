#pragma once
// Every key of DeepSpeed's training config, from one pinned release, and
// what Strata does with each one it does not act on. The config parser
// consults this table for a key that Strata's own key table
// (config_schema.h) lacks, before calling it unknown; docs/deepspeed-keys.md
// is generated from it (a test fails when the committed file is out of date).

#include <span>
#include <string>
#include <string_view>

namespace strata {

// The DeepSpeed release the table was taken from.
inline constexpr std::string_view kDeepSpeedRelease = "0.19.6";
inline constexpr std::string_view kDeepSpeedCommit = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641";

enum class DeepSpeedKeyClass : unsigned char {
  kStrata,       // in Strata's key table: acted on, or accepted there with its own rule
  kNoEffect,     // accepted with a warning: ignoring it does not change what training computes
  kUnsupported,  // changes what training computes: an error when the feature is on
};
std::string_view deepspeed_key_class_name(DeepSpeedKeyClass c);

// A DeepSpeed feature: the unit of classification and of messages.
struct DeepSpeedFeature {
  std::string_view id;      // "pipeline"
  DeepSpeedKeyClass cls;
  std::string_view name;    // "pipeline parallelism" (used in messages)
  std::string_view why;     // why the class: what DeepSpeed does with it, what Strata does instead
  std::string_view source;  // where DeepSpeed reads it (paths in DeepSpeed's repository)
};

// One key (a leaf or a section) at its DeepSpeed JSON path.
struct DeepSpeedKey {
  // The table lists most keys by path and feature alone.
  constexpr DeepSpeedKey(std::string_view path, std::string_view feature, std::string_view off = {},
                         bool open = false)
      : path(path), feature(feature), off(off), open(open) {}

  std::string_view path;     // "pipeline.stages"
  std::string_view feature;  // DeepSpeedFeature::id
  // kUnsupported only; when the feature counts as on:
  //   ""              never by itself (a parameter of the feature),
  //   "*"             whenever given (null excepted),
  //   "enabled:false" a section: unless its member "enabled" is false,
  //   "v1|v2"         a value (JSON) other than these.
  std::string_view off;
  // Any key below is accepted without a name check (sections whose member
  // names are chosen by the user, or that DeepSpeed passes on unread).
  bool open;
};

std::span<const DeepSpeedFeature> deepspeed_features();
std::span<const DeepSpeedKey> deepspeed_keys();
const DeepSpeedFeature* find_deepspeed_feature(std::string_view id);
const DeepSpeedKey* find_deepspeed_key(std::string_view path);

// docs/deepspeed-keys.md, generated from the table.
std::string deepspeed_keys_markdown();

}  // namespace strata
