#include "flag_guards.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata::cli {
namespace {

// "" when `text` is acceptable for an integer option (or not a plain decimal
// integer at all, which CLI11's own conversion then refuses), else the reason.
std::string check_integer_text(const std::string& text, bool is_unsigned) {
  std::string_view s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  const bool negative = !s.empty() && s.front() == '-';
  std::string_view digits = s;
  if (!digits.empty() && (digits.front() == '-' || digits.front() == '+')) digits.remove_prefix(1);
  if (digits.empty()) return {};
  for (char c : digits)
    if (!std::isdigit(static_cast<unsigned char>(c))) return {};  // hex, 1e3, words: CLI11 decides
  if (is_unsigned) {
    if (negative && digits.find_first_not_of('0') != std::string_view::npos)
      return fmt::format("{} is negative; give a whole number >= 0", printable(text, 64));
    uint64_t v = 0;
    const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (r.ec == std::errc::result_out_of_range)
      return fmt::format("{} is out of range (the largest is 18446744073709551615)", printable(text, 64));
    return {};
  }
  int64_t v = 0;
  const std::string signed_text = negative ? "-" + std::string(digits) : std::string(digits);
  const auto r = std::from_chars(signed_text.data(), signed_text.data() + signed_text.size(), v);
  if (r.ec == std::errc::result_out_of_range)
    return fmt::format("{} is out of range ({} .. {})", printable(text, 64), INT64_MIN, INT64_MAX);
  return {};
}

// "" when `text` is a finite number or not a number at all (CLI11's own
// conversion then refuses it), else the reason: CLI11 reads "nan", "inf" and
// "1e999" as doubles, and a NaN passes every CLI::Range (each comparison
// with it is false), so --clip nan reached the engine as gradient_clipping nan.
std::string check_float_text(const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  if (end == begin) return {};
  while (*end != '\0' && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (*end != '\0') return {};
  if (std::isnan(v)) return fmt::format("{} is not a number; give a finite number", printable(text, 64));
  if (std::isinf(v)) return fmt::format("{} is not finite; give a finite number", printable(text, 64));
  return {};
}

bool is_plain_integer(std::string_view text) {
  if (!text.empty() && (text.front() == '-' || text.front() == '+')) text.remove_prefix(1);
  return !text.empty() && std::all_of(text.begin(), text.end(),
                                      [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

// The option `name` of the deepest command that took part in the parse:
// CLI11 hands the failure to the top-level app, not to the subcommand.
const CLI::Option* find_parsed_option(const CLI::App* app, const std::string& name) {
  for (const CLI::App* sub : app->get_subcommands([](const CLI::App* s) { return s->parsed(); }))
    if (const CLI::Option* found = find_parsed_option(sub, name)) return found;
  return app->get_option_no_throw(name);
}

}  // namespace

std::string parse_failure_message(const CLI::App* failed, const CLI::Error& error) {
  const std::string simple = CLI::FailureMessage::simple(failed, error);
  if (failed == nullptr || dynamic_cast<const CLI::ConversionError*>(&error) == nullptr) return simple;
  static constexpr std::string_view kPrefix = "Could not convert: ";
  const std::string_view what = error.what();
  const size_t separator = what.find(" = ");
  if (what.rfind(kPrefix, 0) != 0 || separator == std::string_view::npos) return simple;
  const std::string name(what.substr(kPrefix.size(), separator - kPrefix.size()));
  const std::string_view value = what.substr(separator + 3);
  const CLI::Option* option = find_parsed_option(failed, name);
  if (option == nullptr || !is_plain_integer(value)) return simple;
  // guard_number_flags let the text through, so it fits 64 bits: the flag's
  // type is narrower, and every such flag of the CLI is a 32-bit int.
  const std::string type = option->get_type_name();
  std::string range;
  if (type.rfind("UINT", 0) == 0) range = "0 .. 4294967295";
  else if (type.rfind("INT", 0) == 0) range = "-2147483648 .. 2147483647";
  else return simple;
  return fmt::format("{}: {} is out of range: the flag takes a 32-bit whole number ({}), and its own limits are "
                     "checked next\n"
                     "Run with --help for more information.\n",
                     name, value, range);
}

void guard_number_flags(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    const bool is_unsigned = type.rfind("UINT", 0) == 0;
    const bool is_signed = !is_unsigned && type.rfind("INT", 0) == 0;
    // An empty description keeps --help unchanged.
    if (type.rfind("FLOAT", 0) == 0) {
      opt->check(CLI::Validator([](std::string& value) { return check_float_text(value); }, "", ""));
      continue;
    }
    if (!is_unsigned && !is_signed) continue;
    opt->check(CLI::Validator(
        [is_unsigned](std::string& value) { return check_integer_text(value, is_unsigned); }, "", ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) guard_number_flags(*sub);
}

}  // namespace strata::cli
