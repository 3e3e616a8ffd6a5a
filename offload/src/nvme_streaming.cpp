#include "nvme_streaming.h"

#include <chrono>

#include <fmt/format.h>

#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"

namespace strata::offload {

Result<nvme::IoEngine*> io_engine_for(nvme::IoEngine* given, const AioConfig& aio,
                                      std::unique_ptr<nvme::IoEngine>& owned, std::string_view what) {
  if (given != nullptr) return given;
  STRATA_ASSIGN_OR_RETURN(nvme::IoEngineConfig config, nvme::io_engine_config(aio));
  Result<std::unique_ptr<nvme::IoEngine>> made = nvme::make_io_engine(config.options);
  if (!made.ok()) return made.status().with_context(fmt::format("{}: creating the I/O engine (aio section)", what));
  owned = std::move(made).value();
  return owned.get();
}

Result<std::unique_ptr<SlotPool>> registered_slots(Device& device, nvme::IoEngine& engine, MemoryStats& stats,
                                                   size_t count, uint64_t slot_bytes, size_t alignment,
                                                   std::string_view what, std::string_view fix) {
  SlotPoolOptions po;
  po.slot_count = count;
  po.slot_bytes = slot_bytes;
  po.alignment = alignment;
  po.name = fmt::format("{} slots", what);
  po.acquire_timeout = std::chrono::milliseconds(300000);  // a write-back on a slow drive, not a hang
  po.account = &stats;                                     // the device counts the slots in the engine's stats
  Result<std::unique_ptr<SlotPool>> pool = SlotPool::create(device, po);
  if (!pool.ok())
    return pool.status().with_context(
        fmt::format("{}: pinning {} slots of {} ({})", what, count, format_bytes(slot_bytes, true), fix));
  // One registration of the whole region: io_uring issues every slot's I/O
  // as READ_FIXED / WRITE_FIXED.
  STRATA_RETURN_IF_ERROR(engine.register_buffer((*pool)->base(), (*pool)->total_bytes()));
  return pool;
}

}  // namespace strata::offload
