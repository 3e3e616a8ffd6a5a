// Fuzz target: DeepSpeed config text -> resolved config or errors.
// Properties (checked, not only "does not crash"):
//  1. every printed issue is one line plus an optional "    hint:" line: no
//     input can forge or cut a line of output (Note [Printable messages]);
//  2. an accepted config, printed by `strata config show` (config_to_json),
//     parses back to the same resolved config.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "strata/core/config.h"

namespace {

[[noreturn]] void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_config: property failed: %s\n%s\n", what, detail.substr(0, 2000).c_str());
  std::abort();
}

void check_printed_issue(const std::string& line) {
  for (size_t i = 0; i < line.size(); ++i) {
    const auto c = static_cast<unsigned char>(line[i]);
    if (c == '\n') {
      if (line.compare(i + 1, 10, "    hint: ") != 0) property_failed("a newline that does not start the hint", line);
      continue;
    }
    if (c < 0x20 || c == 0x7f) property_failed("a raw control byte in a printed issue", line);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::ConfigOptions options;
  options.world_size = 8;
  options.source = "fuzz.json";
  const strata::ConfigCheck check = strata::check_config_text(text, options);
  for (const strata::ConfigIssue& issue : check.issues) check_printed_issue(strata::format_issue(issue, options.source));
  if (!check.ok()) return 0;
  const nlohmann::ordered_json shown = strata::config_to_json(check.config);
  const std::string shown_text = shown.dump();
  const strata::ConfigCheck again = strata::check_config_text(shown_text, options);
  if (!again.ok()) property_failed("`config show` output is not a valid config", again.format() + "\n" + shown_text);
  if (strata::config_to_json(again.config) != shown)
    property_failed("`config show` output resolves to a different config", shown_text);
  return 0;
}
