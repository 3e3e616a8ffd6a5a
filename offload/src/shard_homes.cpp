// The stage-3 parameter shard homes (Note [Shard homes] in shard_home.h).
#include <cstring>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "shard_home.h"

namespace strata::offload::engine_detail {

namespace {

// What every home knows of its layer.
class ShardOfLayer : public ShardHome {
 protected:
  ShardOfLayer(EngineContext& ctx, size_t li)
      : ctx_(ctx),
        li_(li),
        eb_(ctx.where(li).param_element_bytes),
        bytes_(ctx.part.layer(li).shard_elements * eb_),
        name_("parameter shard of " + ctx.layer_label(li)) {}
  // A home whose shard is updated in place (UpdateStaging::kNone) has no
  // parameter slot to lend.
  Result<Slot> update_slot() override { return Unsupported(no_slot("an update slot")); }
  Result<Completion> write_back(Slot staging) override {
    (void)staging;
    return Unsupported(no_slot("a write-back from a parameter slot"));
  }
  std::string no_slot(std::string_view what) const {
    return fmt::format("the {} ({}) has no {}: only a shard on NVMe is stepped in a parameter slot", name_,
                       param_home_name(home()), what);
  }
  const LayerPartition& part() const { return ctx_.part.layer(li_); }
  // This rank's piece of group g at its place in the gathered (padded) layer.
  std::byte* in_place(const SubGroup& g, std::byte* gathered) const {
    return gathered + part().piece_begin(g, ctx_.rank) * eb_;
  }

  EngineContext& ctx_;
  const size_t li_;
  const size_t eb_;     // bytes per element
  const size_t bytes_;  // the shard's
  const std::string name_;
};

class DeviceShard final : public ShardOfLayer {
 public:
  DeviceShard(EngineContext& ctx, size_t li, DeviceBuffer shard) : ShardOfLayer(ctx, li), shard_(std::move(shard)) {}
  ParamHome home() const override { return ParamHome::kShardOnDevice; }

  // Device memory is filled from a host copy (Note [Shards made in place]).
  Status create(const ShardFill& fill) override { return refill(fill); }
  Status refill(const ShardFill& fill) override {
    std::vector<std::byte> shard(bytes_);
    fill(shard);
    return put(shard);
  }
  Status put(std::span<const std::byte> values) override {
    return ctx_.device.copy(shard_.data(), values.data(), values.size(), CopyKind::kHostToDevice);
  }
  Status read(std::span<std::byte> out) override {
    return ctx_.device.copy(out.data(), shard_.data(), out.size(), CopyKind::kDeviceToHost);
  }

  Status stage_for_gather(std::byte* gathered, const Completion& ready, std::vector<Completion>& queued) override {
    (void)gathered;
    (void)queued;
    // A queue gate: the gather sends the updated shard.
    return ctx_.comm.wait(ready, comm::CommQueue::kGather);
  }
  const std::byte* gather_source(const SubGroup& g, std::byte* gathered) const override {
    (void)gathered;
    return shard_.as<std::byte>() + g.shard_offset * eb_;
  }
  std::byte* resident() override { return shard_.as<std::byte>(); }

 private:
  DeviceBuffer shard_;
};

class PinnedHostShard final : public ShardOfLayer {
 public:
  PinnedHostShard(EngineContext& ctx, size_t li, HostBuffer shard) : ShardOfLayer(ctx, li), shard_(std::move(shard)) {}
  ParamHome home() const override { return ParamHome::kShardInPinnedHost; }

  Status create(const ShardFill& fill) override { return refill(fill); }
  Status refill(const ShardFill& fill) override {
    fill(std::span<std::byte>(shard_.data(), bytes_));
    return Status::Ok();
  }
  Status put(std::span<const std::byte> values) override {
    std::memcpy(shard_.data(), values.data(), values.size());
    return Status::Ok();
  }
  Status read(std::span<std::byte> out) override {
    std::memcpy(out.data(), shard_.data(), out.size());
    return Status::Ok();
  }

  // H2D of this rank's pieces into their place, then gather in place; on a
  // stream of their own, so a backward's re-gather never queues behind the
  // gradient copies out (which wait for the backward).
  Status stage_for_gather(std::byte* gathered, const Completion& ready, std::vector<Completion>& queued) override {
    Stream& to_device = *ctx_.shard_h2d;
    STRATA_RETURN_IF_ERROR(to_device.wait(ready));  // a stream gate: the H2D reads the shard after its update
    Status copies;
    for (const SubGroup& g : part().groups)
      if (copies.ok())
        copies = to_device.copy_async(in_place(g, gathered), shard_.data() + g.shard_offset * eb_, g.piece * eb_,
                                      CopyKind::kHostToDevice);
    const Completion h2d = to_device.record_completion();  // after the copies queued
    queued.push_back(h2d);
    STRATA_RETURN_IF_ERROR(copies);
    ctx_.transfers.h2d_bytes += bytes_;
    return ctx_.comm.wait(h2d, comm::CommQueue::kGather);  // a queue gate: the gather follows the H2D
  }
  const std::byte* gather_source(const SubGroup& g, std::byte* gathered) const override { return in_place(g, gathered); }
  std::byte* resident() override { return shard_.data(); }

 private:
  HostBuffer shard_;
};

class NvmeShard final : public ShardOfLayer {
 public:
  NvmeShard(EngineContext& ctx, size_t li, ParamSwap& swap, SerialWorker& reader)
      : ShardOfLayer(ctx, li), swap_(swap), reader_(reader) {}
  ParamHome home() const override { return ParamHome::kShardOnNvme; }

  // Through a slot of the store (initial values: counted as NVMe bytes).
  Status create(const ShardFill& fill) override { return swap_.put(key(), bytes_, name_, fill); }
  Status refill(const ShardFill& fill) override {
    STRATA_ASSIGN_OR_RETURN(Slot slot, swap_.staging_slot("writing the " + name_));
    fill(std::span<std::byte>(slot.as<std::byte>(), bytes_));
    return put(std::span<const std::byte>(slot.as<std::byte>(), bytes_));  // durable on return: the slot is free
  }
  Status put(std::span<const std::byte> values) override {
    STRATA_ASSIGN_OR_RETURN(Completion w, swap_.write(key(), values.data(), values.size(), name_));
    // Durable before the next gather reads it; callers are off the step path
    // (a load into a fresh engine, a rollback, initial values).
    return ctx_.wait_status(w, "writing the " + name_);
  }
  Status read(std::span<std::byte> out) override {
    STRATA_ASSIGN_OR_RETURN(ParamSwap::Read rd, swap_.read(key(), out.size(), name_));
    // Blocks by design (off the step path: gather_state for tests and export).
    const Status st = ctx_.wait_status(rd.done, "reading the " + name_);
    if (st.ok()) std::memcpy(out.data(), rd.slot.as<std::byte>(), out.size());
    rd.slot.release_after(rd.done);  // once the read ended (a timed-out one may still write the slot)
    return st;
  }

  // The shard's last write-back must be durable before it is read (a shadow
  // write flips the index only then). The shard reader waits for it, reads
  // the shard into a slot and copies its pieces into place; the driving
  // thread only queues the gather behind that, so neither a prefetch nor an
  // acquire blocks here on a later layer's update.
  Status stage_for_gather(std::byte* gathered, const Completion& ready, std::vector<Completion>& queued) override {
    const Completion copied = reader_.submit([this, gathered] { return read_into_place(gathered); }, ready,
                                             fmt::format("reading the {}", name_), /*sticky=*/false);
    queued.push_back(copied);
    ctx_.transfers.h2d_bytes += bytes_;
    return ctx_.comm.wait(copied, comm::CommQueue::kGather);  // a queue gate: the gather follows the read
  }
  const std::byte* gather_source(const SubGroup& g, std::byte* gathered) const override { return in_place(g, gathered); }
  std::byte* resident() override { return nullptr; }

  Result<Slot> update_slot() override { return swap_.staging_slot("the update of the " + name_); }
  Result<Completion> write_back(Slot staging) override {
    Result<Completion> written = swap_.write(key(), staging.data(), bytes_, name_);
    if (!written.ok()) return written.status();  // nothing in flight: the slot returns now
    staging.release_after(*written);
    auto durable = std::make_shared<CompletionSource>(fmt::format("parameter shard of layer {} written", li_));
    written->then([durable, name = name_](const Status& s) {
      durable->complete(s.ok() ? s : s.with_context("writing the " + name));
    });
    return durable->completion();
  }

 private:
  uint32_t key() const { return static_cast<uint32_t>(li_); }

  // On the shard reader thread.
  Status read_into_place(std::byte* gathered) {
    STRATA_ASSIGN_OR_RETURN(ParamSwap::Read rd, swap_.read(key(), bytes_, name_));
    // A failed read does not fail the gather: the layer is gathered from
    // whatever the slot holds and the failure drops the step at the commit
    // point's vote on every rank (Note [Atomic steps]). The shard reader's
    // own thread waits for the read it issued (the driving thread only waits
    // for the gather queued behind it). Bounded (Note [Bounded waits]): a
    // read that does not end drops the step like a failed one; its slot goes
    // back only once it ended.
    const bool ended = rd.done.wait_for(ctx_.wait_bound());
    const Status read = ended ? rd.done.status()
                              : DeadlineExceeded(fmt::format("'{}' did not complete in {} s (strata.wait_timeout_s; "
                                                             "raise it if the drive is only slow)",
                                                             rd.done.label(), ctx_.opt.wait_timeout_s));
    if (!read.ok()) ctx_.failures.record(FailureOf::kCall, read.with_context("reading the " + name_));
    Status copy;
    const std::byte* shard = rd.slot.as<std::byte>();
    for (const SubGroup& g : part().groups)
      if (copy.ok() && ended)
        copy = ctx_.device.copy(in_place(g, gathered), shard + g.shard_offset * eb_, g.piece * eb_,
                                CopyKind::kHostToDevice);
    rd.slot.release_after(ended ? Completion() : rd.done);  // the copies above are done
    return copy.with_context("copying the " + name_ + " to the device");
  }

  ParamSwap& swap_;
  SerialWorker& reader_;
};

}  // namespace

Result<std::unique_ptr<ShardHome>> make_shard_home(EngineContext& ctx, size_t li, ParamSwap* swap,
                                                   SerialWorker* shard_reader) {
  const LayerPlacement& where = ctx.where(li);
  const size_t bytes = ctx.part.layer(li).shard_elements * where.param_element_bytes;
  const std::string name = "parameter shard of " + ctx.layer_label(li);
  switch (where.params) {
    case ParamHome::kShardOnDevice: {
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer shard, ctx.alloc_device(bytes, name));
      return std::unique_ptr<ShardHome>(new DeviceShard(ctx, li, std::move(shard)));
    }
    case ParamHome::kShardInPinnedHost: {
      STRATA_ASSIGN_OR_RETURN(HostBuffer shard, HostBuffer::create(ctx.device, ctx.stats, bytes, name));
      return std::unique_ptr<ShardHome>(new PinnedHostShard(ctx, li, std::move(shard)));
    }
    case ParamHome::kShardOnNvme:
      STRATA_CHECK(swap != nullptr && shard_reader != nullptr, "a shard on NVMe needs the parameter swap store");
      return std::unique_ptr<ShardHome>(new NvmeShard(ctx, li, *swap, *shard_reader));
    case ParamHome::kWholeOnDevice: break;
  }
  return Internal(fmt::format("{} is kept whole: it has no shard home", ctx.layer_label(li)));
}

}  // namespace strata::offload::engine_detail
