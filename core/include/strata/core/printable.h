#pragma once
// Text from a user (a config key, a flag value, a file name) made safe to
// print: control bytes (NUL, newline, escape sequences) become \xNN, so no
// input can forge or cut a line of output, and text longer than `max_bytes`
// is cut with its full size said.

#include <cstddef>
#include <string>
#include <string_view>

namespace strata {

std::string printable(std::string_view text, size_t max_bytes = 512);

}  // namespace strata
