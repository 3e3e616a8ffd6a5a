// GradientSpill (Note [Gradient shards on NVMe] in gradient_spill.h).
#include "gradient_spill.h"

#include <fmt/format.h>

#include "nvme_streaming.h"

namespace strata::offload::engine_detail {

Result<std::unique_ptr<GradientSpill>> GradientSpill::create(EngineContext& ctx, const std::string& job_name) {
  const EngineOptions& opt = ctx.opt;
  const StatePlacement& p = ctx.placement;
  std::unique_ptr<GradientSpill> s(new GradientSpill(ctx));
  // One key per owned piece of every layer, in (layer, group, rank) order.
  uint64_t keys = 0;
  s->first_key_.resize(ctx.part.layer_count());
  for (size_t li = 0; li < ctx.part.layer_count(); ++li) {
    s->first_key_[li] = keys;
    if (ctx.where(li).gradient_shard_on_nvme)
      keys += ctx.part.layer(li).groups.size() * static_cast<uint64_t>(ctx.owned_rank_end() - ctx.owned_rank_begin());
  }
  s->counted_.assign(keys, false);
  STRATA_ASSIGN_OR_RETURN(s->engine_, io_engine_for(ctx.faults.gradient_io(), opt.nvme.aio, s->owned_engine_,
                                                    "NVMe gradient shards"));
  STRATA_ASSIGN_OR_RETURN(s->pool_, registered_slots(ctx.device, *s->engine_, ctx.stats, p.gradient_slot_count,
                                                     p.gradient_slot_bytes, 4096, "NVMe gradient shards",
                                                     "set strata.gradient_shards pinned or lower "
                                                     "zero_optimization.sub_group_size"));
  s->registered_ = true;
  nvme::SwapStoreOptions so;
  so.paths = {p.gradient_folder == StatePlacement::GradientFolder::kOptimizerState ? opt.nvme.path
                                                                                   : opt.nvme_param.path};
  so.job = job_name + "-gradients";
  so.rank = ctx.rank;
  // Shadow space: a piece's new copy beside its previous one, and a slot's worth.
  so.capacity_bytes = p.gradient_nvme_bytes * 2 + p.gradient_slot_bytes * p.gradient_slot_count;
  so.verify_checksums = opt.nvme.verify_checksums;
  so.verify_writes = false;
  Result<std::unique_ptr<nvme::SwapStore>> store = nvme::SwapStore::open(so, *s->engine_);
  if (!store.ok()) return store.status().with_context("NVMe gradient shards");
  s->store_ = std::move(store).value();
  s->worker_ = std::make_unique<SerialWorker>(fmt::format("gradient shards to NVMe of rank {}", ctx.rank));
  return s;
}

GradientSpill::~GradientSpill() {
  stop();
  if (store_) store_->close().ignore();
  store_.reset();
  if (registered_) engine_->unregister_buffer(pool_->base()).ignore();
  if (nvme_bytes_ != 0) ctx_.stats.on_free(Tier::kNvme, nvme_bytes_);
}

void GradientSpill::stop() {
  if (!worker_) return;
  ctx_.wait_at_teardown(worker_->submit([] { return Status::Ok(); }, {}, "the end of the gradient spill queue",
                                        /*sticky=*/false),
                        "the gradient shards' writes to NVMe");
  worker_.reset();
}

nvme::TensorId GradientSpill::key_of(const StateId& id) const {
  const int owned_ranks = ctx_.owned_rank_end() - ctx_.owned_rank_begin();
  return first_key_[id.layer] + static_cast<uint64_t>(id.group) * static_cast<uint64_t>(owned_ranks) +
         static_cast<uint64_t>(id.rank - ctx_.owned_rank_begin());
}

Completion GradientSpill::spill(size_t li, const std::byte* full, const Completion& reduced, PieceSums sums) {
  const std::string label = fmt::format("writing the gradient shard of {} to NVMe", ctx_.layer_label(li));
  const Completion done = worker_->submit([this, li, full, sums = std::move(sums)] { return spill_now(li, full, sums); },
                                          reduced, label, /*sticky=*/false);
  // A failure (or a failed reduction before it) fails the step at the commit
  // point's vote; what waits on the spill (the norm, the update) goes on.
  return ctx_.failures.absorb(done, label, FailureOf::kCall);
}

Status GradientSpill::spill_now(size_t li, const std::byte* full, const PieceSums& sums) {
  const LayerPartition& layer = ctx_.part.layer(li);
  const size_t grad_bytes = ctx_.grad_bytes();
  std::vector<Completion> writes;
  Status failed;
  size_t block_offset = 0;
  for (size_t gi = 0; gi < layer.groups.size() && failed.ok(); ++gi) {
    const SubGroup& g = layer.groups[gi];
    for (int r = ctx_.owned_rank_begin(); r < ctx_.owned_rank_end() && failed.ok(); ++r) {
      const StateId id{static_cast<uint32_t>(li), static_cast<uint32_t>(gi), r};
      const uint64_t bytes = g.piece * grad_bytes;
      Result<Slot> slot = pool_->acquire(fmt::format("the gradient of {}", ctx_.part.describe(id)));
      if (!slot.ok()) {
        failed = slot.status();
        break;
      }
      failed = ctx_.device.copy(slot->data(), full + layer.piece_begin(g, r) * grad_bytes, bytes,
                                CopyKind::kDeviceToHost);
      if (!failed.ok()) break;
      sums(block_offset, slot->as<std::byte>(), g.piece);
      block_offset += g.piece / kShardAlign;
      const nvme::TensorId key = key_of(id);
      Result<nvme::SwapHandle> written = store_->write(key, slot->data(), bytes);
      if (!written.ok()) {
        failed = written.status().with_context("writing the gradient of " + ctx_.part.describe(id));
        break;
      }
      slot->release_after(written->completion());
      writes.push_back(written->completion());
      bytes_written_ += bytes;
      if (!counted_[key]) {
        counted_[key] = true;
        ctx_.stats.on_allocate(Tier::kNvme, bytes);
        nvme_bytes_ += bytes;
      }
    }
  }
  // The writes end before the spill does: the update reads them back.
  for (const Completion& w : writes) {
    const Status ended = ctx_.wait_status(w, w.label());
    if (failed.ok() && !ended.ok()) failed = ended;
  }
  return failed;
}

Result<GradientSpill::Read> GradientSpill::read(const StateId& id, bool wait) {
  const std::string holder = "reading the gradient of " + ctx_.part.describe(id);
  Result<Slot> slot = wait ? pool_->acquire(holder) : pool_->try_acquire(holder);
  if (!slot.ok()) {
    if (!wait && slot.status().code() == StatusCode::kResourceExhausted) return Read{};
    return slot.status();
  }
  const uint64_t bytes = ctx_.part.layer(id.layer).groups[id.group].piece * ctx_.grad_bytes();
  Result<nvme::SwapHandle> h = store_->read(key_of(id), slot->data(), bytes);
  if (!h.ok()) return h.status().with_context(holder);
  return Read{std::move(slot).value(), h->completion(), bytes};
}

Status GradientSpill::arrived(Read& read, const StateId& id) {
  const Status st = ctx_.wait_status(read.done, "reading the gradient of " + ctx_.part.describe(id));
  if (!st.ok()) {
    read.slot.release_after(read.done);
    return st;
  }
  bytes_read_ += read.bytes;
  return Status::Ok();
}

}  // namespace strata::offload::engine_detail
