// Fuzz target: the size and count parsers ("1.5GiB", "1e9", "7B").
// Properties: an accepted value prints (as a plain integer) and parses back
// to itself; error messages never carry a raw control byte.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "strata/core/units.h"

namespace {

[[noreturn]] void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_units: property failed: %s\n%s\n", what, detail.substr(0, 2000).c_str());
  std::abort();
}

void check(const strata::Result<uint64_t>& r, bool bytes) {
  if (!r.ok()) {
    for (unsigned char c : r.status().message())
      if (c < 0x20 || c == 0x7f) property_failed("a raw control byte in an error", r.status().message());
    return;
  }
  const std::string plain = std::to_string(*r);
  const strata::Result<uint64_t> back = bytes ? strata::parse_bytes(plain) : strata::parse_count(plain);
  if (!back.ok() || *back != *r) property_failed("a parsed value does not parse back to itself", plain);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check(strata::parse_bytes(text, "--size"), true);
  check(strata::parse_count(text, "--params"), false);
  return 0;
}
