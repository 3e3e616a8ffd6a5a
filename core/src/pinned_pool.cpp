// Pinned host pool.
//
// Note [pinned pool accounting]
// A block's footprint is its size rounded up to the alignment (4096 by
// default): page-locking works on pages, so this is the exact amount pinned.
// There are no power-of-two size classes: a 3 MiB + 4 KiB request pins
// exactly that. pinned_bytes_ counts every pinned footprint, live or cached,
// because cached blocks stay locked; it is what the budget and
// RLIMIT_MEMLOCK bound. Reserving happens under the mutex, the slow pin call
// (mlock touches every page) outside it. A refused pin is not an error unless
// the caller disabled the pageable fallback.
//
// Note [CAP_IPC_LOCK lifts RLIMIT_MEMLOCK]
// The kernel bounds mlock by RLIMIT_MEMLOCK only for a process without
// CAP_IPC_LOCK in its effective set (mlock(2)); root in most containers has
// it. The pool used to bound itself by the soft limit regardless, so on such
// a machine (8 MiB limit, mlock of any size allowed) everything past 8 MiB
// went to pageable memory for no reason. The capability is read once per
// pool creation with capget(2); when it cannot be read, the limit applies.
#include "strata/core/pinned_pool.h"

#include <linux/capability.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "strata/core/device.h"
#include "strata/core/units.h"

namespace strata {
namespace {

size_t round_up(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

uint64_t memlock_soft_limit() {
  struct rlimit lim {};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return std::numeric_limits<uint64_t>::max();
  return lim.rlim_cur;
}

bool holds_ipc_lock_capability() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  return (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

// The limit mlock enforces on this process: none with CAP_IPC_LOCK (Note
// [CAP_IPC_LOCK lifts RLIMIT_MEMLOCK]), else the soft RLIMIT_MEMLOCK.
uint64_t effective_memlock_limit() {
  return holds_ipc_lock_capability() ? std::numeric_limits<uint64_t>::max() : memlock_soft_limit();
}

std::string limit_text(uint64_t bytes) {
  return bytes == std::numeric_limits<uint64_t>::max() ? std::string("unlimited") : format_bytes(bytes, true);
}

std::string memlock_text() {
  const std::string soft = limit_text(memlock_soft_limit());
  return holds_ipc_lock_capability() ? soft + ", not applied: CAP_IPC_LOCK" : soft;
}

}  // namespace

// ---------------------------------------------------------------- PinnedBuffer

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      footprint_bytes_(std::exchange(other.footprint_bytes_, 0)),
      tier_(other.tier_) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    footprint_bytes_ = std::exchange(other.footprint_bytes_, 0);
    tier_ = other.tier_;
  }
  return *this;
}

void PinnedBuffer::reset() {
  if (data_ != nullptr) pool_->give_back(data_, size_bytes_, footprint_bytes_, tier_);
  pool_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
  footprint_bytes_ = 0;
}

// ------------------------------------------------------------------ PinnedPool

Result<std::unique_ptr<PinnedPool>> PinnedPool::create(Device* device, PinnedPoolOptions options) {
  const size_t a = options.alignment_bytes;
  if (a < 64 || (a & (a - 1)) != 0)
    return InvalidArgument(fmt::format("pinned pool: alignment_bytes {} must be a power of two >= 64 (4096 for O_DIRECT)", a));
  if (options.method == PinMethod::kAllocate && device != nullptr && a > 4096)
    return InvalidArgument(fmt::format(
        "pinned pool: alignment_bytes {} > 4096 needs PinMethod::kRegister (device allocations are page aligned)", a));
  const bool memlock_bound = device == nullptr || device->caps().pinning_counts_memlock;
  uint64_t limit = options.budget_bytes == 0 ? std::numeric_limits<uint64_t>::max() : options.budget_bytes;
  if (memlock_bound) limit = std::min(limit, effective_memlock_limit());
  if (limit == std::numeric_limits<uint64_t>::max()) limit = 0;
  if (!options.warn) {
    options.warn = [](std::string_view text) { std::fprintf(stderr, "strata: warning: %.*s\n", static_cast<int>(text.size()), text.data()); };
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(device, std::move(options), limit));
}

PinnedPool::PinnedPool(Device* device, PinnedPoolOptions options, uint64_t limit_bytes)
    : device_(device), options_(std::move(options)), pinned_limit_bytes_(limit_bytes) {}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mutex_);
  STRATA_CHECK(live_buffers_ == 0, fmt::format("pinned pool destroyed with {} live PinnedBuffer(s); release them first",
                                               live_buffers_));
  for (auto& [footprint, block] : cached_) release_block(block);
  cached_.clear();
}

Status PinnedPool::pin_new_block(size_t footprint, void** data) {
  *data = nullptr;
  if (options_.method == PinMethod::kAllocate && device_ != nullptr) {
    STRATA_ASSIGN_OR_RETURN(*data, device_->allocate_pinned_host(footprint));
    return Status::Ok();
  }
  void* p = std::aligned_alloc(options_.alignment_bytes, footprint);
  if (p == nullptr) return OutOfMemory(fmt::format("host allocation of {} failed", format_bytes(footprint, true)));
  Status st = device_ != nullptr ? device_->pin_host(p, footprint)
              : mlock(p, footprint) == 0
                  ? Status::Ok()
                  : ErrnoStatus(errno, fmt::format("mlock({})", format_bytes(footprint, true)));
  if (!st.ok()) {
    std::free(p);
    return st;
  }
  *data = p;
  return Status::Ok();
}

void PinnedPool::release_block(const Block& block) {
  if (block.tier == Tier::kPageableHost) {
    std::free(block.data);
    return;
  }
  if (options_.method == PinMethod::kAllocate && device_ != nullptr) {
    device_->free_pinned_host(block.data, block.footprint_bytes);
    return;
  }
  if (device_ != nullptr) {
    device_->unpin_host(block.data, block.footprint_bytes).ignore();  // unpinning our own pin cannot fail
  } else {
    munlock(block.data, block.footprint_bytes);
  }
  std::free(block.data);
}

uint64_t PinnedPool::evict_cached_locked(uint64_t want_bytes) {
  uint64_t released = 0;
  // Largest first: fewest blocks to release.
  while (released < want_bytes && !cached_.empty()) {
    auto it = std::prev(cached_.end());
    release_block(it->second);
    released += it->first;
    pinned_bytes_ -= it->first;
    cached_bytes_ -= it->first;
    cached_.erase(it);
  }
  return released;
}

Result<PinnedBuffer> PinnedPool::allocate(size_t bytes) {
  PinnedBuffer buffer;
  if (bytes == 0) return buffer;
  const size_t footprint = round_up(bytes, options_.alignment_bytes);
  if (footprint < bytes) return InvalidArgument(fmt::format("pinned pool: {} bytes is too large", bytes));
  buffer.pool_ = this;
  buffer.size_bytes_ = bytes;
  buffer.footprint_bytes_ = footprint;

  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto cached = cached_.find(footprint);
    if (cached != cached_.end()) {
      buffer.data_ = cached->second.data;
      buffer.tier_ = Tier::kPinnedHost;
      cached_bytes_ -= footprint;
      cached_.erase(cached);
      ++live_buffers_;
      stats_.on_allocate(Tier::kPinnedHost, footprint);
      return buffer;
    }
    if (pinned_limit_bytes_ != 0 && pinned_bytes_ + footprint > pinned_limit_bytes_) {
      evict_cached_locked(pinned_bytes_ + footprint - pinned_limit_bytes_);
    }
    if (pinned_limit_bytes_ != 0 && pinned_bytes_ + footprint > pinned_limit_bytes_) {
      refusal = fmt::format("{} pinned + {} requested would exceed the pinned limit {} (budget {}, RLIMIT_MEMLOCK {})",
                            format_bytes(pinned_bytes_, true), format_bytes(footprint, true),
                            format_bytes(pinned_limit_bytes_, true),
                            options_.budget_bytes == 0 ? std::string("none") : format_bytes(options_.budget_bytes, true),
                            memlock_text());
    } else {
      pinned_bytes_ += footprint;  // reserve; pin outside the lock
    }
  }

  if (refusal.empty()) {
    void* data = nullptr;
    Status st = pin_new_block(footprint, &data);
    if (st.ok()) {
      std::lock_guard<std::mutex> lock(mutex_);
      buffer.data_ = data;
      buffer.tier_ = Tier::kPinnedHost;
      ++live_buffers_;
      stats_.on_allocate(Tier::kPinnedHost, footprint);
      return buffer;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_bytes_ -= footprint;
    refusal = st.message();
  }

  if (!options_.allow_pageable_fallback) {
    buffer.pool_ = nullptr;
    return OutOfMemory(fmt::format("pinned pool: cannot pin {}: {}; raise `ulimit -l` or the pinned budget, "
                                   "or allow the pageable fallback",
                                   format_bytes(bytes, true), refusal));
  }
  void* data = std::aligned_alloc(options_.alignment_bytes, footprint);
  if (data == nullptr) {
    buffer.pool_ = nullptr;
    return OutOfMemory(fmt::format("pinned pool: pinning {} was refused ({}) and the pageable fallback allocation "
                                   "failed too: the host is out of memory",
                                   format_bytes(bytes, true), refusal));
  }
  bool warn_now = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    buffer.data_ = data;
    buffer.tier_ = Tier::kPageableHost;
    ++live_buffers_;
    ++fallback_count_;
    stats_.on_allocate(Tier::kPageableHost, footprint);
    warn_now = !warned_;
    warned_ = true;
  }
  if (warn_now) {
    options_.warn(fmt::format(
        "pinned host pool: pinning {} was refused ({}); using pageable host memory for it and for later refused "
        "allocations, so their copies will not overlap compute. Raise `ulimit -l` (RLIMIT_MEMLOCK) or the pinned "
        "budget. (printed once)",
        format_bytes(bytes, true), refusal));
  }
  return buffer;
}

void PinnedPool::give_back(void* data, size_t size_bytes, size_t footprint, Tier tier) {
  (void)size_bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  STRATA_CHECK(live_buffers_ > 0, "pinned pool: a buffer was returned twice");
  --live_buffers_;
  stats_.on_free(tier, footprint);
  Block block{data, footprint, tier};
  if (tier == Tier::kPinnedHost && options_.cache_freed) {
    cached_.emplace(footprint, block);
    cached_bytes_ += footprint;
    return;
  }
  release_block(block);
  if (tier == Tier::kPinnedHost) pinned_bytes_ -= footprint;
}

uint64_t PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  return evict_cached_locked(std::numeric_limits<uint64_t>::max());
}

uint64_t PinnedPool::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinned_bytes_;
}
uint64_t PinnedPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_bytes_;
}
uint64_t PinnedPool::fallback_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fallback_count_;
}

PinningProbe probe_pinning(size_t bytes) {
  PinningProbe probe;
  probe.memlock_limit_bytes = memlock_soft_limit();
  probe.ipc_lock_capability = holds_ipc_lock_capability();
  const size_t footprint = round_up(bytes, 4096);
  void* p = std::aligned_alloc(4096, footprint);
  if (p == nullptr) {
    probe.detail = "host allocation failed";
    return probe;
  }
  if (mlock(p, footprint) == 0) {
    munlock(p, footprint);
    probe.works = true;
    probe.detail = fmt::format("mlock({}) ok, RLIMIT_MEMLOCK {}", format_bytes(footprint, true), memlock_text());
  } else {
    const int error = errno;
    probe.detail = fmt::format("mlock({}) failed: {} (RLIMIT_MEMLOCK {}; raise `ulimit -l`)",
                               format_bytes(footprint, true), std::strerror(error), memlock_text());
  }
  std::free(p);
  return probe;
}

}  // namespace strata
