#pragma once
// strata.speculative_optimizer: whether each layer's CPU optimizer step may
// start under the backward (Note [Early, exact updates] in docs/engine.md).
// kAuto: where the placement allows it, the model's compute is not on the
// host's cores (not the cpu device), and the second (pending) buffer of its
// state fits
// strata.host_memory_budget (without one: half the machine's memory per rank).
#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/config.h"
#include "strata/core/placement.h"
#include "strata/core/status.h"

namespace strata::offload {

enum class SpeculationMode : uint8_t { kAuto, kOn, kOff };
// "auto" | "on" | "off"; anything else is an InvalidArgument naming `field`.
Result<SpeculationMode> parse_speculation_mode(std::string_view text, std::string_view field);
const char* speculation_mode_name(SpeculationMode mode);

// strata.gradient_shards: where reduced gradient shards wait for the step
// (Note [Gradient shards on NVMe] in offload/src/gradient_spill.h). kAuto:
// on NVMe where the optimizer state is there and the plan with pinned
// shards does not fit strata.host_memory_budget.
enum class GradientShardsMode : uint8_t { kAuto, kPinned, kNvme };
// "auto" | "pinned" | "nvme"; anything else is an InvalidArgument naming `field`.
Result<GradientShardsMode> parse_gradient_shards_mode(std::string_view text, std::string_view field);
// Why reduced gradient shards cannot wait on NVMe with this placement (empty:
// they can): the state must be stepped on the host, whole (ratio 1), and a
// folder must be on NVMe, the optimizer state's or the parameter shards'.
// The one rule behind StatePlacement's decision and strata plan's rows.
std::string gradient_shards_nvme_blocker(const Placement& placement, double ratio);

}  // namespace strata::offload
