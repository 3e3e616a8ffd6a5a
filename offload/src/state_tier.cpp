#include "strata/offload/state_tier.h"

#include <cstring>
#include <map>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::offload {
namespace {

// Each section of a piece (exp_avg, exp_avg_sq, master) starts on 64 bytes,
// so that a step written out of place into the pending buffer (Note [Pending
// versions in memory]) stores whole aligned vectors non-temporally (Note
// [Out-of-place steps] in cpu_adam's kernel_body.h).
uint64_t moment_section_bytes(size_t count, const cpu_adam::MomentStorage& moments) {
  return (moments.moment_bytes(count) + 63) / 64 * 64;
}

struct IdLess {
  bool operator()(const StateId& a, const StateId& b) const {
    return std::tie(a.layer, a.group, a.rank) < std::tie(b.layer, b.group, b.rank);
  }
};

class MemoryStateTier final : public OptimizerStateTier {
 public:
  MemoryStateTier(Device& device, Tier tier, const cpu_adam::MomentStorage& moments, MemoryStats& host_stats)
      : device_(device), tier_(tier), moments_(moments), host_stats_(host_stats) {}
  ~MemoryStateTier() override {
    for (auto& [id, p] : pieces_) release(p);
  }

  Tier tier() const override { return tier_; }
  std::string describe() const override {
    return tier_ == Tier::kDevice ? "device memory" : "pinned host memory";
  }

  Status add(const StateId& id, const std::string& name, size_t count, std::span<const float> master_init) override {
    STRATA_CHECK(pieces_.find(id) == pieces_.end(), "optimizer state piece added twice");
    STRATA_CHECK(master_init.empty() || master_init.size() == count, "master init size mismatch");
    const uint64_t moment_bytes = moment_section_bytes(count, moments_);
    Piece p;
    p.count = count;
    p.bytes = memory_piece_bytes(count, !master_init.empty(), moments_);
    if (tier_ == Tier::kDevice) {
      Result<DeviceBuffer> b = device_.allocate(p.bytes, host_stats_);  // counted by the device
      if (!b.ok())
        return OutOfMemory(fmt::format("optimizer state of {} ({}) does not fit in device memory: {}; offload it "
                                       "with zero_optimization.offload_optimizer.device \"cpu\" or raise --device-memory",
                                       name, format_bytes(p.bytes, true), b.status().message()));
      p.device = std::move(*b);
      p.data = static_cast<std::byte*>(p.device.data());
    } else {
      Result<void*> b = device_.allocate_pinned_host(p.bytes, host_stats_);
      if (!b.ok())
        return OutOfMemory(fmt::format("optimizer state of {} ({}) could not be allocated in pinned host memory: {}",
                                       name, format_bytes(p.bytes, true), b.status().message()));
      p.data = static_cast<std::byte*>(*b);
    }
    // Device memory is written through the Device (a cuda pointer is not
    // host memory); pinned memory directly.
    p.has_master = !master_init.empty();
    if (tier_ == Tier::kDevice) {
      STRATA_RETURN_IF_ERROR(device_.memset(p.data, 0, p.bytes));
      if (p.has_master)
        STRATA_RETURN_IF_ERROR(device_.copy(p.data + 2 * moment_bytes, master_init.data(), count * sizeof(float),
                                            CopyKind::kHostToDevice));
    } else {
      std::memset(p.data, 0, p.bytes);
      if (p.has_master) std::memcpy(p.data + 2 * moment_bytes, master_init.data(), count * sizeof(float));
    }
    bytes_ += p.bytes;
    pieces_.emplace(id, std::move(p));
    return Status::Ok();
  }

  Result<PieceState> open(const StateId& id) override {
    const Piece& p = piece(id);
    return state_in(p, p.data);
  }
  Status close(const StateId&, bool) override { return Status::Ok(); }
  uint64_t bytes() const override { return bytes_; }

  // Note [Pending versions in memory]: pinned host only (the CPU kernels
  // write the pending buffer; device state is stepped in place).
  Status add_pending(const StateId& id) override {
    if (tier_ != Tier::kPinnedHost) return OptimizerStateTier::add_pending(id);
    Piece& p = piece(id);
    STRATA_CHECK(p.pending == nullptr, "a pending buffer added twice");
    Result<void*> b = device_.allocate_pinned_host(p.bytes, host_stats_);
    if (!b.ok())
      return OutOfMemory(fmt::format("the pending version of an optimizer state piece ({}) could not be allocated in "
                                     "pinned host memory: {}; set strata.speculative_optimizer off to do without it",
                                     format_bytes(p.bytes, true), b.status().message()));
    p.pending = static_cast<std::byte*>(*b);
    std::memset(p.pending, 0, p.bytes);
    return Status::Ok();
  }
  Result<PieceState> open_pending(const StateId& id) override {
    const Piece& p = piece(id);
    if (p.pending == nullptr) return OptimizerStateTier::open_pending(id);
    return state_in(p, p.pending);
  }
  Status keep_pending(const StateId& id) override {
    Piece& p = piece(id);
    if (p.pending == nullptr) return OptimizerStateTier::keep_pending(id);
    std::swap(p.data, p.pending);
    return Status::Ok();
  }

 private:
  struct Piece {
    size_t count = 0, bytes = 0;
    bool has_master = false;
    std::byte* data = nullptr;
    std::byte* pending = nullptr;  // Note [Pending versions in memory]; pinned host only
    DeviceBuffer device;
  };
  Piece& piece(const StateId& id) {
    auto it = pieces_.find(id);
    STRATA_CHECK(it != pieces_.end(), "an optimizer state piece that was never added");
    return it->second;
  }
  // The piece's state laid out in `data` (its buffer or its pending one).
  PieceState state_in(const Piece& p, std::byte* data) const {
    const uint64_t moment_bytes = moment_section_bytes(p.count, moments_);
    PieceState s;
    s.count = p.count;
    s.exp_avg = data;
    s.exp_avg_sq = data + moment_bytes;
    s.master = p.has_master ? reinterpret_cast<float*>(data + 2 * moment_bytes) : nullptr;
    s.moments = moments_;
    return s;
  }
  void release(Piece& p) {
    if (tier_ == Tier::kPinnedHost && p.data != nullptr) device_.free_pinned_host(p.data, p.bytes);
    if (p.pending != nullptr) device_.free_pinned_host(p.pending, p.bytes);
    p.data = nullptr;
    p.pending = nullptr;
  }
  Device& device_;
  Tier tier_;
  cpu_adam::MomentStorage moments_;
  MemoryStats& host_stats_;
  std::map<StateId, Piece, IdLess> pieces_;
  uint64_t bytes_ = 0;
};

}  // namespace

uint64_t memory_piece_bytes(size_t count, bool has_master, const cpu_adam::MomentStorage& moments) {
  const uint64_t bytes = 2 * moment_section_bytes(count, moments) + (has_master ? uint64_t{count} * sizeof(float) : 0);
  return bytes == 0 ? 64 : bytes;  // an empty piece still gets an address
}

Result<std::unique_ptr<OptimizerStateTier>> make_memory_state_tier(Device& device, Tier tier,
                                                                   const cpu_adam::MomentStorage& moments,
                                                                   MemoryStats& host_stats, bool device_kernels) {
  if (tier != Tier::kDevice && tier != Tier::kPinnedHost)
    return InvalidArgument(fmt::format("optimizer state tier {} is not a memory tier", tier_name(tier)));
  if (tier == Tier::kDevice && !device.caps().host_addressable && !device_kernels)
    return Unsupported(fmt::format(
        "optimizer state on the {} device needs the device optimizer kernel (docs/device-adam.md), which this build "
        "does not have; set zero_optimization.offload_optimizer.device to \"cpu\"",
        device.caps().backend));
  if (moments.blocked() && device_kernels)
    return Unsupported(fmt::format("strata.optimizer_state_dtype {}: the device optimizer kernel has no 8-bit moments; "
                                   "offload the optimizer state (offload_optimizer.device \"cpu\" or \"nvme\") or use "
                                   "bf16 states",
                                   moments.name()));
  return std::unique_ptr<OptimizerStateTier>(new MemoryStateTier(device, tier, moments, host_stats));
}

}  // namespace strata::offload
