#include "strata/core/units.h"

#include <array>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

namespace strata {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Splits "12.5GiB" into number 12.5 and suffix "gib".
bool split_number(std::string_view text, double* number, std::string* suffix) {
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s = s.substr(start);
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  *number = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || errno == ERANGE || !std::isfinite(*number)) return false;
  std::string rest(end);
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) rest.erase(0, 1);
  *suffix = lower(rest);
  return true;
}

Result<uint64_t> to_integer(double value, std::string_view text, std::string_view what) {
  if (value < 0) return InvalidArgument(fmt::format("{} '{}' is negative", what, text));
  if (value > 1.8e19) return InvalidArgument(fmt::format("{} '{}' is too large", what, text));
  double rounded = std::round(value);
  if (std::fabs(rounded - value) > 1e-6 * std::max(1.0, value))
    return InvalidArgument(fmt::format("{} '{}' is not a whole number", what, text));
  return static_cast<uint64_t>(rounded);
}

}  // namespace

Result<uint64_t> parse_bytes(std::string_view text, std::string_view what) {
  double number = 0;
  std::string suffix;
  if (!split_number(text, &number, &suffix))
    return InvalidArgument(fmt::format("{} '{}' is not a size (examples: 4096, 1MiB, 80GB, 1e9)", what, text));
  struct Unit { const char* name; double factor; };
  static constexpr std::array<Unit, 16> kUnits{{
      {"", 1}, {"b", 1},
      {"k", 1024.0}, {"kib", 1024.0}, {"kb", 1e3},
      {"m", 1048576.0}, {"mib", 1048576.0}, {"mb", 1e6},
      {"g", 1073741824.0}, {"gib", 1073741824.0}, {"gb", 1e9},
      {"t", 1099511627776.0}, {"tib", 1099511627776.0}, {"tb", 1e12},
      {"bytes", 1}, {"byte", 1},
  }};
  for (const Unit& u : kUnits) {
    if (suffix == u.name) return to_integer(number * u.factor, text, what);
  }
  return InvalidArgument(fmt::format(
      "{} '{}' has an unknown unit '{}' (use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)", what, text, suffix));
}

Result<uint64_t> parse_count(std::string_view text, std::string_view what) {
  double number = 0;
  std::string suffix;
  if (!split_number(text, &number, &suffix))
    return InvalidArgument(fmt::format("{} '{}' is not a number (examples: 7B, 350M, 1.3e9)", what, text));
  double factor = 0;
  if (suffix.empty()) factor = 1;
  else if (suffix == "k") factor = 1e3;
  else if (suffix == "m") factor = 1e6;
  else if (suffix == "b" || suffix == "g") factor = 1e9;
  else if (suffix == "t") factor = 1e12;
  else
    return InvalidArgument(fmt::format("{} '{}' has an unknown suffix '{}' (use K, M, B or T)", what, text, suffix));
  return to_integer(number * factor, text, what);
}

std::string format_bytes(uint64_t bytes, bool binary) {
  const double base = binary ? 1024.0 : 1000.0;
  static constexpr std::array<const char*, 5> kDec{"B", "KB", "MB", "GB", "TB"};
  static constexpr std::array<const char*, 5> kBin{"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= base && unit + 1 < kDec.size()) {
    value /= base;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", value, binary ? kBin[unit] : kDec[unit]);
}

std::string format_count(uint64_t count) {
  double v = static_cast<double>(count);
  if (v >= 1e12) return fmt::format("{:.2f}T", v / 1e12);
  if (v >= 1e9) return fmt::format("{:.2f}B", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.2f}K", v / 1e3);
  return fmt::format("{}", count);
}

}  // namespace strata
