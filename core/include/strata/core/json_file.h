#pragma once
// A user's JSON (a config, a hardware profile, a row file, a bench result)
// read strictly, the same way everywhere (Note [Strict JSON] in
// json_file.cpp): the file through read_regular_file (regular files only, a
// FIFO never hangs, at most max_bytes), then one linear scan that refuses
// NUL bytes and nesting deeper than max_depth, then the parser, whose errors
// give their line and column. A key given twice in one object is an error
// naming its JSON path ("rows[0].stage"): nlohmann would keep the last one.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/bounded_file.h"
#include "strata/core/status.h"

namespace strata {

// One problem with a JSON text: where (a JSON path such as "rows[0].stage";
// "" for the whole text), what, and what to do instead.
struct JsonProblem {
  std::string path;
  std::string message;
  std::string hint;
};

struct JsonLimits {
  uint64_t max_bytes = uint64_t{16} << 20;
  // Real files nest a few levels; the parser, dump() and the destructor are
  // recursive, so 70,000 levels would overflow the stack.
  size_t max_depth = 64;
  std::string_view what = "JSON file";  // "config", "hardware profile": the noun in messages and hints
};

struct ParsedJson {
  nlohmann::ordered_json document;          // null when `error` is set
  std::optional<JsonProblem> error;         // the text is not usable JSON
  std::vector<JsonProblem> duplicate_keys;  // one per key given twice, in file order
};

// Parses `text` strictly (see the top of this header). Every duplicate key is
// collected; any other problem stops the parse.
ParsedJson parse_json_text(std::string_view text, const JsonLimits& limits);

// read_regular_file + parse_json_text, with `file.what` as the noun of every
// message (limits.what is not used). The first problem, a duplicate key
// included, is an InvalidArgument:
//   "<what> '<path>' (<flag>): rows[0].stage: duplicate key: ...; <hint>"
Result<nlohmann::ordered_json> read_json_file(const std::string& path, const FileDescription& file,
                                              const JsonLimits& limits);

// A JSON number as a byte count: whole, >= 0 and at most 2^64 - 1. Either
// `bytes` is set, or `problem` says what is wrong ("is negative", ...).
struct JsonByteCount {
  std::optional<uint64_t> bytes;
  std::string_view problem;
};
JsonByteCount json_byte_count(double value);
template <typename Json>
JsonByteCount json_byte_count(const Json& v) {
  if (v.is_number_unsigned()) return {v.template get<uint64_t>(), {}};
  if (v.is_number_integer() && v.template get<int64_t>() >= 0)
    return {static_cast<uint64_t>(v.template get<int64_t>()), {}};
  if (v.is_number()) return json_byte_count(v.template get<double>());  // negative integers, floats
  return {std::nullopt, "is not a number"};
}

}  // namespace strata
