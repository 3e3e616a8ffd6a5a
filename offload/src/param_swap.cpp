#include "param_swap.h"

#include <fmt/format.h>

#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"

namespace strata::offload {

Result<std::unique_ptr<ParamSwap>> ParamSwap::create(const ParamSwapOptions& o, Device& device, MemoryStats& stats) {
  if (o.path.empty())
    return InvalidArgument("zero_optimization.offload_param.nvme_path is not set: name a folder on the NVMe drive");
  if (o.buffer_count < 1 || o.buffer_count > 65536)
    return InvalidArgument(fmt::format("zero_optimization.offload_param.buffer_count {} is not in 1..65536",
                                       o.buffer_count));
  std::unique_ptr<ParamSwap> s(new ParamSwap(device, stats));
  if (o.io_engine != nullptr) {
    s->engine_ = o.io_engine;
  } else {
    STRATA_ASSIGN_OR_RETURN(nvme::IoEngineConfig ec, nvme::io_engine_config(o.aio));
    Result<std::unique_ptr<nvme::IoEngine>> engine = nvme::make_io_engine(ec.options);
    if (!engine.ok())
      return engine.status().with_context("NVMe parameter shards: creating the I/O engine (aio section)");
    s->owned_engine_ = std::move(engine).value();
    s->engine_ = s->owned_engine_.get();
  }
  SlotPoolOptions po;
  po.slot_count = o.buffer_count;
  po.slot_bytes = std::max<uint64_t>(o.slot_bytes, 4096);
  po.alignment = 4096;
  po.name = "NVMe parameter slots";
  po.acquire_timeout = std::chrono::milliseconds(300000);
  po.account = &stats;  // the device counts the slots in the engine's stats
  Result<std::unique_ptr<SlotPool>> pool = SlotPool::create(device, po);
  if (!pool.ok())
    return pool.status().with_context(fmt::format(
        "NVMe parameter shards: pinning {} slots of {} (lower zero_optimization.offload_param.buffer_count)",
        o.buffer_count, format_bytes(po.slot_bytes, true)));
  s->pool_ = std::move(pool).value();
  STRATA_RETURN_IF_ERROR(s->engine_->register_buffer(s->pool_->base(), s->pool_->total_bytes()));
  s->registered_ = true;
  nvme::SwapStoreOptions so;
  so.paths = {o.path};
  so.job = o.job;
  so.rank = o.rank;
  // Shadow space: one write in flight per layer at most, bounded by the slots' worth.
  so.capacity_bytes = o.capacity_bytes * 2 + po.slot_bytes;
  so.verify_checksums = o.verify_checksums;
  so.verify_writes = false;
  Result<std::unique_ptr<nvme::SwapStore>> store = nvme::SwapStore::open(so, *s->engine_);
  if (!store.ok()) return store.status().with_context("NVMe parameter shards");
  s->store_ = std::move(store).value();
  s->description_ = fmt::format("NVMe ({}; {}; {} x {} pinned slots)", o.path, s->engine_->describe(),
                                o.buffer_count, format_bytes(po.slot_bytes, true));
  return s;
}

ParamSwap::~ParamSwap() {
  if (store_) store_->close().ignore();
  store_.reset();
  if (registered_) engine_->unregister_buffer(pool_->base()).ignore();
  if (nvme_bytes_ != 0) stats_.on_free(Tier::kNvme, nvme_bytes_);
}

Status ParamSwap::put(uint32_t layer, const void* data, uint64_t bytes, const std::string& name) {
  // Through a slot: the swap store's I/O wants aligned, registered memory.
  STRATA_ASSIGN_OR_RETURN(Slot slot, pool_->acquire("initial " + name));
  std::memcpy(slot.data(), data, bytes);
  STRATA_RETURN_IF_ERROR(store_->write_sync(layer, slot.data(), bytes).with_context("writing " + name));
  stats_.on_allocate(Tier::kNvme, bytes);
  nvme_bytes_ += bytes;
  bytes_written_ += bytes;
  return Status::Ok();
}

Result<ParamSwap::Read> ParamSwap::read(uint32_t layer, uint64_t bytes, const std::string& name) {
  Read r;
  STRATA_ASSIGN_OR_RETURN(r.slot, pool_->acquire("read of " + name));
  Result<nvme::SwapHandle> h = store_->read(layer, r.slot.data(), bytes);
  if (!h.ok()) return h.status().with_context("reading " + name);
  r.done = h->completion();
  bytes_read_ += bytes;
  return r;
}

Result<Completion> ParamSwap::write(uint32_t layer, const void* data, uint64_t bytes, const std::string& name) {
  Result<nvme::SwapHandle> h = store_->write(layer, data, bytes);
  if (!h.ok()) return h.status().with_context("writing " + name);
  bytes_written_ += bytes;
  return h->completion();
}

}  // namespace strata::offload
