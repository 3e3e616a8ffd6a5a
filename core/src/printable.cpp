#include "strata/core/printable.h"

#include <algorithm>

#include <fmt/format.h>

namespace strata {

namespace {

std::string escaped(std::string_view text, size_t max_bytes, bool keep_newlines, bool ascii_only = false) {
  std::string out;
  const size_t shown = std::min(text.size(), max_bytes);
  out.reserve(shown + 16);
  for (size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (((c < 0x20 || c == 0x7f) && !(keep_newlines && c == '\n')) || (ascii_only && c >= 0x80)) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  if (shown < text.size()) out += fmt::format("...(cut, {} bytes in all)", text.size());
  return out;
}

}  // namespace

std::string printable(std::string_view text, size_t max_bytes) { return escaped(text, max_bytes, false); }

std::string printable_ascii(std::string_view text, size_t max_bytes) { return escaped(text, max_bytes, false, true); }

std::string printable_message(std::string_view message, size_t max_bytes) {
  return escaped(message, max_bytes, true);
}

}  // namespace strata
