// Strict JSON from a user: see json_file.h.
//
// Note [Strict JSON]
// Before the parser sees a text, one linear scan refuses what no real file
// contains and what would make later steps explode: NUL bytes (a reader that
// stops at the NUL would accept a different document), nesting deeper than
// max_depth (the error path, dump() and the destructor are recursive: 70,000
// levels overflowed the stack) and more than max_bytes. The parser then runs
// with a callback that keeps, per open object, the keys seen so far and the
// JSON path ("rows[0].stage"), so a key given twice is reported where it is
// (nlohmann would silently keep the last one, other readers the first) and an
// error the parser raises itself (a number no double holds) can say where.

#include "strata/core/json_file.h"

#include <cmath>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata {
namespace {

using nlohmann::ordered_json;

std::optional<JsonProblem> prescan_json(std::string_view text, const JsonLimits& limits) {
  if (text.size() > limits.max_bytes)
    return JsonProblem{"", fmt::format("the {} is {} bytes, more than the {} a {} may have", limits.what, text.size(),
                                       limits.max_bytes, limits.what),
                       fmt::format("a {} is a small JSON object; is this the right file?", limits.what)};
  size_t depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0')
      return JsonProblem{"", fmt::format("NUL byte at offset {}", i),
                         fmt::format("a {} is UTF-8 JSON text; remove the NUL (is this a binary file?)", limits.what)};
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limits.max_depth)
        return JsonProblem{"", fmt::format("nesting deeper than {} levels at offset {}", limits.max_depth, i),
                           fmt::format("a {} nests a few levels deep; is this the right file?", limits.what)};
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return std::nullopt;
}

// The parse callback: the JSON path of every open object or array and the
// keys each object has had so far.
class DuplicateTracker {
 public:
  explicit DuplicateTracker(std::vector<JsonProblem>& duplicates) : duplicates_(duplicates) {}

  bool operator()(int, ordered_json::parse_event_t event, ordered_json& parsed) {
    using E = ordered_json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        open(event == E::array_start);
        break;
      case E::object_end:
      case E::array_end:
        if (!stack_.empty()) stack_.pop_back();
        break;
      case E::key:
        key(parsed.get<std::string>());
        break;
      case E::value:
        if (!stack_.empty() && stack_.back().is_array) ++stack_.back().next_index;
        break;
    }
    return true;
  }

  // The path of the value being parsed now.
  std::string current_path() const { return stack_.empty() ? std::string() : child_path(stack_.back()); }

 private:
  struct Frame {
    std::string path;
    bool is_array = false;
    size_t next_index = 0;       // arrays: the index of the next element
    std::string last_key;        // objects: the key whose value is being parsed
    std::set<std::string> keys;  // objects: every key so far
  };

  static std::string child_path(const Frame& f) {
    if (f.is_array) return fmt::format("{}[{}]", f.path, f.next_index);
    return f.path.empty() ? f.last_key : fmt::format("{}.{}", f.path, f.last_key);
  }

  void open(bool is_array) {
    std::string path;
    if (!stack_.empty()) {
      path = child_path(stack_.back());
      if (stack_.back().is_array) ++stack_.back().next_index;
    }
    stack_.push_back({std::move(path), is_array, 0, {}, {}});
  }

  void key(std::string name) {
    if (stack_.empty()) return;
    Frame& top = stack_.back();
    top.last_key = std::move(name);
    if (top.keys.insert(top.last_key).second) return;
    duplicates_.push_back({child_path(top), "duplicate key: the file gives it twice",
                           "delete one of the two; JSON readers disagree on which one wins"});
  }

  std::vector<Frame> stack_;
  std::vector<JsonProblem>& duplicates_;
};

// "parse error at line 3, column 5: syntax error ..." without nlohmann's "[json.exception.parse_error.101] ".
std::string without_exception_id(const std::string& what) {
  const size_t pos = what.find("] ");
  return pos == std::string::npos ? what : what.substr(pos + 2);
}

}  // namespace

ParsedJson parse_json_text(std::string_view text, const JsonLimits& limits) {
  ParsedJson out;
  if (std::optional<JsonProblem> refused = prescan_json(text, limits)) {
    out.error = std::move(refused);
    return out;
  }
  DuplicateTracker tracker(out.duplicate_keys);
  try {
    out.document = ordered_json::parse(text.begin(), text.end(), std::ref(tracker));
  } catch (const ordered_json::parse_error& e) {
    out.document = nullptr;
    out.error = JsonProblem{"", fmt::format("not valid JSON: {}", without_exception_id(e.what())),
                            fmt::format("a {} is strict JSON: no comments, no trailing commas, keys in double quotes",
                                        limits.what)};
  } catch (const ordered_json::exception& e) {
    // E.g. out_of_range.406: a number such as 1e400 that no double holds.
    out.document = nullptr;
    out.error = JsonProblem{tracker.current_path(),
                            fmt::format("not a usable JSON value: {}", without_exception_id(e.what())),
                            "numbers must fit in a double (about 1.8e308); write a smaller value"};
  }
  return out;
}

Result<ordered_json> read_json_file(const std::string& path, const FileDescription& file, const JsonLimits& limits) {
  STRATA_ASSIGN_OR_RETURN(std::string text, read_regular_file(path, limits.max_bytes, file));
  JsonLimits named = limits;
  named.what = file.what;  // one noun for the file's messages and the text's
  ParsedJson parsed = parse_json_text(text, named);
  const JsonProblem* problem = parsed.error              ? &*parsed.error
                               : !parsed.duplicate_keys.empty() ? &parsed.duplicate_keys.front()
                                                                : nullptr;
  if (problem == nullptr) return std::move(parsed.document);
  return InvalidArgument(fmt::format("{} '{}'{}: {}{}; {}", file.what, printable(path, 256),
                                     file.flag.empty() ? "" : fmt::format(" ({})", file.flag),
                                     problem->path.empty() ? "" : printable(problem->path, 256) + ": ",
                                     printable(problem->message, 1024), problem->hint));
}

JsonByteCount json_byte_count(double value) {
  if (std::isnan(value)) return {std::nullopt, "is not a number"};
  if (value < 0) return {std::nullopt, "is negative; a byte count is 0 or more"};
  // 2^64 is exact in a double; every whole double below it converts exactly.
  if (!(value < 18446744073709551616.0))
    return {std::nullopt, "is more than 18446744073709551615 (2^64 - 1), the most a byte count can be"};
  if (value != std::floor(value)) return {std::nullopt, "is not a whole number of bytes"};
  return {static_cast<uint64_t>(value), {}};
}

}  // namespace strata
