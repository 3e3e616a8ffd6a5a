#include "param_swap.h"

#include <algorithm>

#include <fmt/format.h>

#include "strata/core/units.h"
#include "nvme_streaming.h"

namespace strata::offload {

Result<std::unique_ptr<ParamSwap>> ParamSwap::create(const ParamSwapOptions& o, Device& device, MemoryStats& stats) {
  if (o.path.empty())
    return InvalidArgument("zero_optimization.offload_param.nvme_path is not set: name a folder on the NVMe drive");
  if (o.buffer_count < 1 || o.buffer_count > 65536)
    return InvalidArgument(fmt::format("zero_optimization.offload_param.buffer_count {} is not in 1..65536",
                                       o.buffer_count));
  std::unique_ptr<ParamSwap> s(new ParamSwap(device, stats));
  STRATA_ASSIGN_OR_RETURN(s->engine_, io_engine_for(o.io_engine, o.aio, s->owned_engine_, "NVMe parameter shards"));
  const uint64_t slot_bytes = std::max<uint64_t>(o.slot_bytes, 4096);
  STRATA_ASSIGN_OR_RETURN(s->pool_, registered_slots(device, *s->engine_, stats, o.buffer_count, slot_bytes, 4096,
                                                     "NVMe parameter shards",
                                                     "lower zero_optimization.offload_param.buffer_count"));
  s->registered_ = true;
  nvme::SwapStoreOptions so;
  so.paths = {o.path};
  so.job = o.job;
  so.rank = o.rank;
  // Shadow space: one write in flight per layer at most, bounded by the slots' worth.
  so.capacity_bytes = o.capacity_bytes * 2 + slot_bytes;
  so.verify_checksums = o.verify_checksums;
  so.verify_writes = false;
  Result<std::unique_ptr<nvme::SwapStore>> store = nvme::SwapStore::open(so, *s->engine_);
  if (!store.ok()) return store.status().with_context("NVMe parameter shards");
  s->store_ = std::move(store).value();
  s->description_ = fmt::format("NVMe ({}; {}; {} x {} pinned slots)", o.path, s->engine_->describe(),
                                o.buffer_count, format_bytes(slot_bytes, true));
  return s;
}

ParamSwap::~ParamSwap() {
  if (store_) store_->close().ignore();
  store_.reset();
  if (registered_) engine_->unregister_buffer(pool_->base()).ignore();
  if (nvme_bytes_ != 0) stats_.on_free(Tier::kNvme, nvme_bytes_);
}

Status ParamSwap::put(uint32_t layer, uint64_t bytes, const std::string& name,
                      const std::function<void(std::span<std::byte>)>& fill) {
  // Through a slot: the swap store's I/O wants aligned, registered memory.
  STRATA_ASSIGN_OR_RETURN(Slot slot, pool_->acquire("initial " + name));
  fill(std::span<std::byte>(slot.as<std::byte>(), bytes));
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
