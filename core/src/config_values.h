#pragma once
// Internal: conversions between JSON values (already type-checked by the
// parser) and the typed fields of strata::Config. Used by the key table.

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "strata/core/config.h"
#include "strata/core/json_file.h"
#include "strata/core/units.h"

namespace strata::config_detail {

// A checked integral JSON number (integer, or a float such as 5e8 with no
// fractional part) as int64, saturating at the int64 range.
inline int64_t json_integer(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {  // before is_number_integer(), which is true for unsigned too
    const uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                           : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  const double d = v.get<double>();
  if (d >= 9.2233720368547758e18) return std::numeric_limits<int64_t>::max();
  if (d <= -9.2233720368547758e18) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(std::llround(d));
}

template <typename Enum>
struct EnumNames;
template <>
struct EnumNames<OffloadDevice> {
  static constexpr std::array<std::string_view, 3> names{"none", "cpu", "nvme"};
};
template <>
struct EnumNames<AioEngineKind> {
  static constexpr std::array<std::string_view, 4> names{"auto", "io_uring", "libaio", "psync"};
};
template <>
struct EnumNames<OptimizerType> {
  static constexpr std::array<std::string_view, 4> names{"Adam", "AdamW", "Adagrad", "Lion"};
};
template <>
struct EnumNames<SchedulerType> {
  static constexpr std::array<std::string_view, 6> names{"none", "WarmupLR", "WarmupDecayLR",
                                                         "WarmupCosineLR", "OneCycle", "LRRangeTest"};
};
template <>
struct EnumNames<DeviceKind> {
  static constexpr std::array<std::string_view, 3> names{"auto", "cpu", "cuda"};
};

inline bool equal_caseless(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

template <typename Enum>
std::optional<Enum> enum_from_name(std::string_view name) {
  const auto& names = EnumNames<Enum>::names;
  for (size_t i = 0; i < names.size(); ++i) {
    if (equal_caseless(names[i], name)) return static_cast<Enum>(i);
  }
  return std::nullopt;
}
template <typename Enum>
std::string_view enum_name(Enum value) {
  const auto& names = EnumNames<Enum>::names;
  const auto i = static_cast<size_t>(value);
  return i < names.size() ? names[i] : std::string_view("?");
}

inline void set_field(bool& f, const nlohmann::json& v) { f = v.get<bool>(); }
inline void set_field(int& f, const nlohmann::json& v) { f = static_cast<int>(json_integer(v)); }
inline void set_field(int64_t& f, const nlohmann::json& v) { f = json_integer(v); }
inline void set_field(double& f, const nlohmann::json& v) { f = v.get<double>(); }
inline void set_field(std::string& f, const nlohmann::json& v) { f = v.is_null() ? std::string() : v.get<std::string>(); }
inline void set_field(std::optional<int64_t>& f, const nlohmann::json& v) {
  if (v.is_null()) f.reset();
  else f = json_integer(v);
}
inline void set_field(std::array<double, 2>& f, const nlohmann::json& v) { f = {v.at(0).get<double>(), v.at(1).get<double>()}; }
// Bytes: a whole number or a string with a unit (validated by the parser).
inline void set_field(uint64_t& f, const nlohmann::json& v) {
  if (v.is_string()) {
    auto parsed = parse_bytes(v.get<std::string>());
    f = parsed.ok() ? *parsed : 0;
  } else {
    f = json_byte_count(v).bytes.value_or(0);  // exact up to 2^64 - 1
  }
}
template <typename Enum, typename = decltype(EnumNames<Enum>::names)>
void set_field(Enum& f, const nlohmann::json& v) {
  if (auto e = enum_from_name<Enum>(v.get<std::string>())) f = *e;
}

inline nlohmann::json get_field(bool f) { return f; }
inline nlohmann::json get_field(int f) { return f; }
inline nlohmann::json get_field(int64_t f) { return f; }
inline nlohmann::json get_field(uint64_t f) { return f; }
inline nlohmann::json get_field(double f) { return f; }
inline nlohmann::json get_field(const std::string& f) { return f.empty() ? nlohmann::json() : nlohmann::json(f); }
inline nlohmann::json get_field(const std::optional<int64_t>& f) { return f ? nlohmann::json(*f) : nlohmann::json(); }
inline nlohmann::json get_field(const std::array<double, 2>& f) { return nlohmann::json::array({f[0], f[1]}); }
template <typename Enum, typename = decltype(EnumNames<Enum>::names)>
nlohmann::json get_field(Enum f) {
  return std::string(enum_name(f));
}

}  // namespace strata::config_detail
