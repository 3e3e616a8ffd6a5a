#pragma once
// Memory tiers: where a piece of training state lives. Ordered from fastest
// and scarcest (device HBM) to slowest and largest (NVMe).

#include <array>
#include <cstdint>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

enum class Tier : uint8_t {
  kDevice = 0,        // accelerator memory (HBM, or the cpu device's capped host memory)
  kPinnedHost = 1,    // page-locked host memory: DMA-able, async copies overlap
  kPageableHost = 2,  // ordinary host memory: copies stage through the driver
  kNvme = 3,          // swap files on local NVMe
};
inline constexpr int kTierCount = 4;
inline constexpr std::array<Tier, kTierCount> kAllTiers = {Tier::kDevice, Tier::kPinnedHost,
                                                           Tier::kPageableHost, Tier::kNvme};

constexpr std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kPinnedHost: return "pinned_host";
    case Tier::kPageableHost: return "pageable_host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

// Accepts the names above and "pinned", "pageable", "host" (= pageable_host), "gpu" (= device).
Result<Tier> parse_tier(std::string_view name);

}  // namespace strata
