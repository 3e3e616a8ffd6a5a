#pragma once
// The set-up that the two components streaming state through NVMe share (the
// optimizer-state tier, nvme_state_tier.cpp, and the stage-3 parameter swap,
// param_swap.cpp): their I/O engine and their pinned slots. Private to
// offload/src.
#include <memory>
#include <string_view>

#include "strata/core/config.h"
#include "strata/core/device.h"
#include "strata/core/memory_stats.h"
#include "strata/core/slot_pool.h"
#include "strata/core/status.h"
#include "strata/nvme/io_engine.h"

namespace strata::offload {

// The I/O engine: `given` (a test's fault-injecting one, Note [Testing
// seam]) or one made from the aio section, kept in `owned`. `what` names
// the component in errors ("NVMe parameter shards").
Result<nvme::IoEngine*> io_engine_for(nvme::IoEngine* given, const AioConfig& aio,
                                      std::unique_ptr<nvme::IoEngine>& owned, std::string_view what);

// `count` pinned slots of `slot_bytes` (aligned to `alignment`), counted by
// the device in `stats`, registered with `engine` as one region (io_uring:
// fixed buffers; a refusal is a note, not an error). The caller unregisters
// pool->base() before the pool goes. `fix` says which key to lower when
// pinning fails.
Result<std::unique_ptr<SlotPool>> registered_slots(Device& device, nvme::IoEngine& engine, MemoryStats& stats,
                                                   size_t count, uint64_t slot_bytes, size_t alignment,
                                                   std::string_view what, std::string_view fix);

}  // namespace strata::offload
