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

// printable(), with every byte >= 0x80 escaped too: for text that must be
// ASCII (a checkpoint tag, a job name) read from a file a user controls,
// where such a byte is the error itself and need not be valid UTF-8.
std::string printable_ascii(std::string_view text, size_t max_bytes = 512);

// A whole message made safe to print as the last line of defence (the CLI's
// "error:" lines): like printable(), but its line breaks are kept, since a
// message's hint goes on a line of its own. Values inside a message should
// still go through printable() where they are formatted, which escapes a
// newline too; this catches the escape sequences of any value that did not.
std::string printable_message(std::string_view message, size_t max_bytes = 1 << 16);

}  // namespace strata
