// Fixed-slot pinned host pool; see slot_pool.h, Note [slot pool choices].
//
// Note [slot pool states]
// Each slot is kFree (in free_list_), kHeld (a Slot handle owns it) or
// kReleasing (release_after() gave it up; a completion callback will return
// it). The state moves kHeld -> kReleasing under the lock BEFORE the
// callback is attached, because Completion::then runs the callback at once
// when the completion is already done: the callback must find the slot in
// kReleasing. Callbacks take the lock only to flip the state and notify; no
// user code runs under it. notify_all happens under the lock so that the
// destructor, woken by the last release, cannot destroy the condition
// variable while a callback is still inside notify_all.
#include "strata/core/slot_pool.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "strata/core/device.h"
#include "strata/core/host_memory.h"
#include "strata/core/units.h"

namespace strata {
namespace {

constexpr size_t kMaxSlots = 65536;
constexpr size_t kMaxAlignment = size_t{1} << 30;
constexpr size_t kDevicePinAlignment = 4096;  // allocate_pinned_host returns page-aligned memory

std::string memlock_text() {
  struct rlimit lim {};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return format_bytes(lim.rlim_cur, true);
}

}  // namespace

// ------------------------------------------------------------------------ Slot

Slot::Slot(Slot&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      index_(std::exchange(other.index_, 0)),
      offset_(std::exchange(other.offset_, 0)),
      holder_(std::move(other.holder_)) {}

Slot& Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    index_ = std::exchange(other.index_, 0);
    offset_ = std::exchange(other.offset_, 0);
    holder_ = std::move(other.holder_);
  }
  return *this;
}

void Slot::reset() {
  if (pool_ == nullptr) return;
  SlotPool* pool = std::exchange(pool_, nullptr);
  data_ = nullptr;
  pool->give_back(index_);
}

void Slot::release_after(Completion done) {
  if (pool_ == nullptr) return;
  SlotPool* pool = std::exchange(pool_, nullptr);
  data_ = nullptr;
  pool->begin_release(index_, done);
}

// -------------------------------------------------------------------- SlotPool

Result<std::unique_ptr<SlotPool>> SlotPool::create(Device& device, SlotPoolOptions options) {
  if (options.name.empty()) options.name = "slot pool";
  const std::string& name = options.name;
  if (options.slot_count == 0)
    return InvalidArgument(fmt::format("slot pool '{}': slot_count is 0; a pipeline needs at least 1 slot (3 to overlap "
                                       "read, copy and write)", name));
  if (options.slot_count > kMaxSlots)
    return InvalidArgument(fmt::format("slot pool '{}': slot_count {} is above the limit {}; use fewer, larger slots",
                                       name, options.slot_count, kMaxSlots));
  if (options.slot_bytes == 0) return InvalidArgument(fmt::format("slot pool '{}': slot_bytes is 0", name));
  const size_t a = options.alignment;
  if (a < 64 || a > kMaxAlignment || (a & (a - 1)) != 0)
    return InvalidArgument(fmt::format("slot pool '{}': alignment {} must be a power of two in [64, 1 GiB] "
                                       "(4096 for O_DIRECT)", name, a));
  if (options.acquire_timeout.count() <= 0)
    return InvalidArgument(fmt::format("slot pool '{}': acquire_timeout {} ms must be > 0 (use try_acquire() "
                                       "for a non-blocking attempt)", name, options.acquire_timeout.count()));
  if (options.slot_bytes > std::numeric_limits<size_t>::max() - (a - 1))
    return InvalidArgument(fmt::format("slot pool '{}': slot_bytes {} overflows when rounded to the alignment {}",
                                       name, options.slot_bytes, a));
  const size_t stride = (options.slot_bytes + a - 1) / a * a;
  if (stride > std::numeric_limits<size_t>::max() / options.slot_count)
    return InvalidArgument(fmt::format("slot pool '{}': slot_count {} x slot_bytes {} overflows", name,
                                       options.slot_count, options.slot_bytes));
  const size_t total = stride * options.slot_count;
  // Unknown (0): no bound from it.
  const uint64_t known = physical_memory_bytes();
  const uint64_t physical = known != 0 ? known : std::numeric_limits<uint64_t>::max();
  if (total > physical)
    return InvalidArgument(fmt::format("slot pool '{}': slot_count {} x slot_bytes {} = {} exceeds the host's "
                                       "physical memory ({}); lower slot_count or slot_bytes",
                                       name, options.slot_count, format_bytes(options.slot_bytes, true),
                                       format_bytes(total, true), format_bytes(physical, true)));

  // The device's pinned allocations are page aligned; a larger alignment is
  // obtained by over-allocating and aligning the base inside.
  const size_t extra = a > kDevicePinAlignment ? a : 0;
  const size_t allocation_bytes = total + extra;
  Result<void*> pinned = options.account != nullptr ? device.allocate_pinned_host(allocation_bytes, *options.account)
                                                     : device.allocate_pinned_host(allocation_bytes);
  if (!pinned.ok()) {
    const bool memlock = device.caps().pinning_counts_memlock;
    return OutOfMemory(fmt::format(
        "slot pool '{}': cannot pin {} x {} ({}) through the {} device: {}. The slot pool never falls back to "
        "pageable memory; {}lower slot_count or slot_bytes",
        name, options.slot_count, format_bytes(options.slot_bytes, true), format_bytes(allocation_bytes, true),
        device.caps().backend, pinned.status().message(),
        memlock ? fmt::format("raise `ulimit -l` (RLIMIT_MEMLOCK is {}) or ", memlock_text()) : std::string()));
  }
  void* allocation = *pinned;
  const auto raw = reinterpret_cast<uintptr_t>(allocation);
  if (extra == 0 && raw % a != 0) {
    // A backend that returned less than page alignment: no slack to align
    // inside, which would put the last slot past the end. Refuse loudly.
    device.free_pinned_host(allocation, allocation_bytes);
    return Internal(fmt::format("slot pool '{}': the {} device returned pinned memory at {} that is not aligned to "
                                "{} bytes; use alignment <= the device's pinned alignment",
                                name, device.caps().backend, allocation, a));
  }
  void* base = reinterpret_cast<void*>((raw + a - 1) / a * a);
  return std::unique_ptr<SlotPool>(new SlotPool(device, std::move(options), allocation, allocation_bytes, base, stride));
}

SlotPool::SlotPool(Device& device, SlotPoolOptions options, void* allocation, size_t allocation_bytes, void* base,
                   size_t stride)
    : device_(device),
      options_(std::move(options)),
      allocation_(allocation),
      allocation_bytes_(allocation_bytes),
      base_(base),
      stride_(stride),
      slots_(options_.slot_count) {
  free_list_.reserve(options_.slot_count);
  // Reverse, so that the LIFO hands out slot 0 first.
  for (size_t i = options_.slot_count; i-- > 0;) free_list_.push_back(i);
  memory_stats_.on_allocate(Tier::kPinnedHost, allocation_bytes_);
}

SlotPool::~SlotPool() {
  std::unique_lock<std::mutex> lock(mutex_);
  STRATA_CHECK(handles_alive_ == 0, fmt::format("slot pool '{}' destroyed while {} Slot handle(s) are alive ({}); "
                                                "release them first",
                                                options_.name, handles_alive_, describe_locked()));
  const bool drained = freed_cv_.wait_for(lock, options_.acquire_timeout,
                                          [&] { return stats_.pending_releases == 0; });
  STRATA_CHECK(drained, fmt::format("slot pool '{}' destroyed while {} release(s) still wait on their completion "
                                    "after {} ms ({}); the work they guard may still use the memory",
                                    options_.name, stats_.pending_releases, options_.acquire_timeout.count(),
                                    describe_locked()));
  lock.unlock();
  device_.free_pinned_host(allocation_, allocation_bytes_);
  memory_stats_.on_free(Tier::kPinnedHost, allocation_bytes_);
}

Status SlotPool::check_fits(size_t bytes) const {
  if (bytes <= options_.slot_bytes) return Status::Ok();
  return InvalidArgument(fmt::format("slot pool '{}': {} ({} bytes) requested but a slot holds {} ({} x {}); split "
                                     "the transfer into slot-sized chunks or create the pool with larger slots",
                                     options_.name, format_bytes(bytes, true), bytes,
                                     format_bytes(options_.slot_bytes, true), options_.slot_count,
                                     format_bytes(options_.slot_bytes, true)));
}

Slot SlotPool::make_slot(size_t index, std::string_view holder) {
  Slot slot;
  slot.pool_ = this;
  slot.index_ = index;
  slot.offset_ = index * stride_;
  slot.data_ = static_cast<char*>(base_) + slot.offset_;
  slot.bytes_ = options_.slot_bytes;
  slot.holder_ = std::string(holder);
  return slot;
}

Result<Slot> SlotPool::take_locked(size_t index, std::string_view holder) {
  SlotInfo& info = slots_[index];
  STRATA_CHECK(info.state == SlotState::kFree, "slot pool: a slot on the free list is not free");
  info.state = SlotState::kHeld;
  info.holder = std::string(holder);
  ++handles_alive_;
  ++stats_.acquires;
  ++stats_.in_use;
  stats_.peak_in_use = std::max(stats_.peak_in_use, stats_.in_use);
  return make_slot(index, holder);
}

Result<Slot> SlotPool::acquire_impl(std::string_view holder, bool block) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (free_list_.empty()) {
    if (!block) {
      ++stats_.try_failures;
      return ResourceExhausted(fmt::format("slot pool '{}': no free slot for '{}' ({})", options_.name, holder,
                                           describe_locked()));
    }
    ++stats_.waits;
    const auto start = std::chrono::steady_clock::now();
    const bool got = freed_cv_.wait_for(lock, options_.acquire_timeout, [&] { return !free_list_.empty(); });
    stats_.total_wait_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    if (!got) {
      ++stats_.timeouts;
      return DeadlineExceeded(fmt::format(
          "slot pool '{}': no slot free for '{}' after {} ms ({}); a holder did not release its slot, or a release "
          "completion never completed: raise slot_count or find the stuck holder",
          options_.name, holder, options_.acquire_timeout.count(), describe_locked()));
    }
  }
  const size_t index = free_list_.back();
  free_list_.pop_back();
  return take_locked(index, holder);
}

Result<Slot> SlotPool::acquire(std::string_view holder) { return acquire_impl(holder, /*block=*/true); }

Result<Slot> SlotPool::acquire(std::string_view holder, size_t bytes) {
  STRATA_RETURN_IF_ERROR(check_fits(bytes));
  return acquire_impl(holder, /*block=*/true);
}

Result<Slot> SlotPool::try_acquire(std::string_view holder) { return acquire_impl(holder, /*block=*/false); }

Result<Slot> SlotPool::try_acquire(std::string_view holder, size_t bytes) {
  STRATA_RETURN_IF_ERROR(check_fits(bytes));
  return acquire_impl(holder, /*block=*/false);
}

void SlotPool::return_locked(size_t index) {
  SlotInfo& info = slots_[index];
  info.state = SlotState::kFree;
  info.holder.clear();
  info.release_label.clear();
  free_list_.push_back(index);
  ++stats_.releases;
  --stats_.in_use;
  freed_cv_.notify_all();  // under the lock: see Note [slot pool states]
}

void SlotPool::give_back(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  STRATA_CHECK(index < slots_.size() && slots_[index].state == SlotState::kHeld,
               fmt::format("slot pool '{}': slot {} returned but not held", options_.name, index));
  --handles_alive_;
  return_locked(index);
}

void SlotPool::begin_release(size_t index, const Completion& done) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    SlotInfo& info = slots_[index];
    STRATA_CHECK(info.state == SlotState::kHeld,
                 fmt::format("slot pool '{}': release_after on slot {} that is not held", options_.name, index));
    info.state = SlotState::kReleasing;
    info.release_label = done.label().empty() ? std::string("unnamed completion") : done.label();
    --handles_alive_;
    ++stats_.pending_releases;
  }
  // Outside the lock: then() may run the callback right here.
  done.then([this, index](const Status& status) { finish_release(index, status); });
}

void SlotPool::finish_release(size_t index, const Status& status) {
  std::lock_guard<std::mutex> lock(mutex_);
  STRATA_CHECK(slots_[index].state == SlotState::kReleasing,
               fmt::format("slot pool '{}': release completion for slot {} ran twice", options_.name, index));
  if (!status.ok()) {
    ++stats_.failed_releases;
    stats_.last_release_error = status.to_string();
  }
  --stats_.pending_releases;
  return_locked(index);
}

std::string SlotPool::describe_locked() const {
  std::string text = fmt::format("{} x {}, {} free", options_.slot_count, format_bytes(options_.slot_bytes, true),
                                 free_list_.size());
  // Long pools: name the first few busy slots, then count the rest.
  constexpr size_t kMaxNamed = 16;
  size_t named = 0, more = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const SlotInfo& info = slots_[i];
    if (info.state == SlotState::kFree) continue;
    if (named == kMaxNamed) {
      ++more;
      continue;
    }
    text += named == 0 ? "; " : ", ";
    if (info.state == SlotState::kHeld) {
      text += fmt::format("[{}] held by '{}'", i, info.holder);
    } else {
      text += fmt::format("[{}] released by '{}', waiting on '{}'", i, info.holder, info.release_label);
    }
    ++named;
  }
  if (more > 0) text += fmt::format(" and {} more busy", more);
  return text;
}

size_t SlotPool::free_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_list_.size();
}

SlotPoolStats SlotPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace strata
