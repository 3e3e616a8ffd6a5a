#pragma once
// Reading a user's file safely: opened non-blocking (a FIFO must not hang
// us), regular files only (a folder, /dev/zero or a FIFO is an error naming
// what it is), and never more than `max_bytes` (checked against the size
// first, then bounded while reading, in case the file grows).

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

struct FileDescription {
  std::string_view what;  // "config file", "data file"
  std::string_view flag;  // "--data", or "" when the file is not a flag
  std::string_view hint;  // appended to the errors: what to do instead
};

// Errors: "<what> '<path>' (<flag>) is not a regular file (a FIFO); <hint>",
// "... is larger than N bytes; <hint>", and errno failures naming the path.
Result<std::string> read_regular_file(const std::string& path, uint64_t max_bytes, const FileDescription& file);

}  // namespace strata
