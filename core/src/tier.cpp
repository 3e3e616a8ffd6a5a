#include "strata/core/tier.h"

#include <fmt/format.h>

namespace strata {

Result<Tier> parse_tier(std::string_view name) {
  for (Tier tier : kAllTiers) {
    if (name == tier_name(tier)) return tier;
  }
  if (name == "gpu") return Tier::kDevice;
  if (name == "pinned") return Tier::kPinnedHost;
  if (name == "pageable" || name == "host" || name == "cpu") return Tier::kPageableHost;
  return InvalidArgument(fmt::format(
      "unknown memory tier '{}' (use device, pinned_host, pageable_host or nvme)", name));
}

}  // namespace strata
