#pragma once
// Reading a user's file safely: opened non-blocking (a FIFO must not hang
// us), regular files only (a folder, /dev/zero or a FIFO is an error naming
// what it is), and never more than `max_bytes` (checked against the size
// first, then bounded while reading, in case the file grows).

#include <sys/types.h>

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

// What a path is, for messages, from its stat mode: "a regular file", "a
// directory", "a symbolic link", "a FIFO", "a socket", "a character device",
// "a block device", else "a special file".
std::string_view file_type_name(mode_t mode);

// InvalidArgument when `path` holds a NUL byte: the system would take the
// name up to it and open another file. "<what> '<path>' holds a NUL byte at
// offset N; ...".
Status check_path_text(std::string_view path, std::string_view what);

// Errors: "<what> '<path>' (<flag>) is not a regular file (a FIFO); <hint>",
// "... is larger than N bytes; <hint>", and errno failures naming the path.
Result<std::string> read_regular_file(const std::string& path, uint64_t max_bytes, const FileDescription& file);

}  // namespace strata
