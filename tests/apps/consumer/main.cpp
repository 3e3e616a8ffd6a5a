// Uses the installed Strata: core Status, units and dtype conversion.
#include <cstdio>

#include <strata/core/build_info.h>
#include <strata/core/dtype.h>
#include <strata/core/units.h>

int main() {
  auto bytes = strata::parse_bytes("1GiB", "consumer");
  if (!bytes.ok() || *bytes != (1ull << 30)) return 1;
  if (strata::fp32_to_bf16_bits(1.0f) != 0x3f80) return 2;
  auto bad = strata::parse_bytes("12 parsecs", "consumer");
  if (bad.ok()) return 3;
  std::printf("consumer linked Strata %s: %s\n", std::string(strata::build_info().version).c_str(),
              bad.status().to_string().c_str());
  return 0;
}
