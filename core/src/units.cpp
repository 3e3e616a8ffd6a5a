#include "strata/core/units.h"

#include <array>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <charconv>
#include <string>
#include <variant>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A number as the user wrote it: a plain integer is kept exact (a double
// would turn 9007199254740993 into ...992 and 2^64 - 1 into "too large");
// anything with a fraction or an exponent goes through a double.
struct Number {
  bool integral = false;
  uint64_t integer = 0;
  double real = 0;
  std::string suffix;  // lower case, spaces trimmed
};

enum class SplitError { kNotANumber, kControlCharacter, kIntegerTooLarge };

// Splits "12.5GiB" into number 12.5 and suffix "gib".
std::variant<Number, SplitError> split_number(std::string_view text) {
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && !std::isspace(u)) || u == 0x7f) return SplitError::kControlCharacter;  // NUL included
  }
  std::string s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s = s.substr(start);
  if (s.empty()) return SplitError::kNotANumber;
  Number n;
  size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  const bool plain_integer = digits > 0 && (digits == s.size() || (s[digits] != '.' && s[digits] != 'e' && s[digits] != 'E'));
  std::string rest;
  if (plain_integer) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + digits, n.integer);
    if (ec == std::errc::result_out_of_range) return SplitError::kIntegerTooLarge;
    if (ec != std::errc() || end != s.data() + digits) return SplitError::kNotANumber;
    n.integral = true;
    n.real = static_cast<double>(n.integer);
    rest = s.substr(digits);
  } else {
    char* end = nullptr;
    errno = 0;
    n.real = std::strtod(s.c_str(), &end);
    if (end == s.c_str() || errno == ERANGE || !std::isfinite(n.real)) return SplitError::kNotANumber;
    rest = std::string(end);
  }
  while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.front()))) rest.erase(0, 1);
  n.suffix = lower(rest);
  return n;
}

Status split_error(SplitError e, std::string_view text, std::string_view what, std::string_view examples) {
  switch (e) {
    case SplitError::kControlCharacter:
      return InvalidArgument(fmt::format("{} '{}' contains a control character; write a plain number such as {}", what,
                                         printable(text, 64), examples));
    case SplitError::kIntegerTooLarge:
      return InvalidArgument(fmt::format("{} '{}' is too large (the most is 18446744073709551615)", what,
                                         printable(text, 64)));
    case SplitError::kNotANumber:
      break;
  }
  return InvalidArgument(fmt::format("{} '{}' is not a number (examples: {})", what, printable(text, 64), examples));
}

// value x factor as an exact integer: integers multiply exactly (overflow is
// an error, never a wrap); fractions and exponents round once at the end.
Result<uint64_t> scale(const Number& n, uint64_t factor, std::string_view text, std::string_view what) {
  if (n.integral) {
    uint64_t out = 0;
    if (__builtin_mul_overflow(n.integer, factor, &out))
      return InvalidArgument(fmt::format("{} '{}' is too large (more than 2^64 - 1)", what, printable(text, 64)));
    return out;
  }
  const double value = n.real * static_cast<double>(factor);
  if (value < 0) return InvalidArgument(fmt::format("{} '{}' is negative", what, printable(text, 64)));
  if (!(value < 18446744073709551616.0))
    return InvalidArgument(fmt::format("{} '{}' is too large (more than 2^64 - 1)", what, printable(text, 64)));
  double rounded = std::round(value);
  if (std::fabs(rounded - value) > 1e-6 * std::max(1.0, value))
    return InvalidArgument(fmt::format("{} '{}' is not a whole number", what, printable(text, 64)));
  return static_cast<uint64_t>(rounded);
}

}  // namespace

Result<uint64_t> parse_bytes(std::string_view text, std::string_view what) {
  auto split = split_number(text);
  if (auto* e = std::get_if<SplitError>(&split)) {
    if (*e == SplitError::kNotANumber)
      return InvalidArgument(fmt::format("{} '{}' is not a size (examples: 4096, 1MiB, 80GB, 1e9)", what,
                                         printable(text, 64)));
    return split_error(*e, text, what, "4096, 1MiB, 80GB, 1e9");
  }
  const Number& n = std::get<Number>(split);
  struct Unit { const char* name; uint64_t factor; };
  static constexpr std::array<Unit, 16> kUnits{{
      {"", 1}, {"b", 1},
      {"k", uint64_t{1} << 10}, {"kib", uint64_t{1} << 10}, {"kb", 1000},
      {"m", uint64_t{1} << 20}, {"mib", uint64_t{1} << 20}, {"mb", 1000000},
      {"g", uint64_t{1} << 30}, {"gib", uint64_t{1} << 30}, {"gb", 1000000000},
      {"t", uint64_t{1} << 40}, {"tib", uint64_t{1} << 40}, {"tb", 1000000000000},
      {"bytes", 1}, {"byte", 1},
  }};
  for (const Unit& u : kUnits) {
    if (n.suffix == u.name) return scale(n, u.factor, text, what);
  }
  return InvalidArgument(fmt::format(
      "{} '{}' has an unknown unit '{}' (use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)", what, printable(text, 64),
      printable(n.suffix, 32)));
}

Result<uint64_t> parse_count(std::string_view text, std::string_view what) {
  auto split = split_number(text);
  if (auto* e = std::get_if<SplitError>(&split)) return split_error(*e, text, what, "7B, 350M, 1.3e9");
  const Number& n = std::get<Number>(split);
  uint64_t factor = 0;
  if (n.suffix.empty()) factor = 1;
  else if (n.suffix == "k") factor = 1000;
  else if (n.suffix == "m") factor = 1000000;
  else if (n.suffix == "b" || n.suffix == "g") factor = 1000000000;
  else if (n.suffix == "t") factor = 1000000000000;
  else
    return InvalidArgument(fmt::format("{} '{}' has an unknown suffix '{}' (use K, M, B or T)", what,
                                       printable(text, 64), printable(n.suffix, 32)));
  return scale(n, factor, text, what);
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
