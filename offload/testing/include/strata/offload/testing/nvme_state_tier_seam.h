#pragma once
// The NVMe optimizer-state tier on a given I/O engine, for tests only (Note
// [Testing seam] in engine_seam.h): NvmeStateTierOptions has no engine field,
// so a release build always does its I/O through an engine made from the aio
// section. Defined in strata_offload; this header is never installed.
#include <memory>

#include "strata/offload/nvme_state_tier.h"

namespace strata::nvme {
class IoEngine;
}

namespace strata::offload::testing {

// make_nvme_state_tier with its I/O through `io` (e.g. a fault-injecting
// engine, strata/nvme/testing/fault_injection.h; must outlive the tier)
// instead of one made from options.aio.
Result<std::unique_ptr<OptimizerStateTier>> make_nvme_state_tier_on(const NvmeStateTierOptions& options,
                                                                    nvme::IoEngine& io, Device& device,
                                                                    MemoryStats& stats);

}  // namespace strata::offload::testing
