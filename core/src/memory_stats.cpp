#include "strata/core/memory_stats.h"

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata {

MemoryStats& MemoryStats::process() {
  static MemoryStats* stats = new MemoryStats(true);  // never destroyed: used from static destructors
  return *stats;
}

void MemoryStats::apply_allocate(Tier tier, uint64_t bytes) {
  Counters& c = counters_[static_cast<int>(tier)];
  const uint64_t now = c.current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  c.allocated.fetch_add(bytes, std::memory_order_relaxed);
  c.allocations.fetch_add(1, std::memory_order_relaxed);
  uint64_t peak = c.peak.load(std::memory_order_relaxed);
  while (now > peak && !c.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void MemoryStats::apply_free(Tier tier, uint64_t bytes) {
  Counters& c = counters_[static_cast<int>(tier)];
  const uint64_t before = c.current.fetch_sub(bytes, std::memory_order_relaxed);
  STRATA_CHECK(before >= bytes, fmt::format("MemoryStats: freeing {} bytes of tier {} but only {} in use "
                                            "(double free or mismatched size)",
                                            bytes, tier_name(tier), before));
  c.freed.fetch_add(bytes, std::memory_order_relaxed);
  c.frees.fetch_add(1, std::memory_order_relaxed);
}

void MemoryStats::on_allocate(Tier tier, uint64_t bytes) {
  apply_allocate(tier, bytes);
  if (!is_process_) process().apply_allocate(tier, bytes);
}

void MemoryStats::on_free(Tier tier, uint64_t bytes) {
  apply_free(tier, bytes);
  if (!is_process_) process().apply_free(tier, bytes);
}

TierStats MemoryStats::get(Tier tier) const {
  const Counters& c = counters_[static_cast<int>(tier)];
  TierStats s;
  s.current_bytes = c.current.load(std::memory_order_relaxed);
  s.peak_bytes = c.peak.load(std::memory_order_relaxed);
  s.allocated_bytes = c.allocated.load(std::memory_order_relaxed);
  s.freed_bytes = c.freed.load(std::memory_order_relaxed);
  s.allocation_count = c.allocations.load(std::memory_order_relaxed);
  s.free_count = c.frees.load(std::memory_order_relaxed);
  return s;
}

void MemoryStats::reset_peak(Tier tier) {
  Counters& c = counters_[static_cast<int>(tier)];
  c.peak.store(c.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::string MemoryStats::to_string(Tier tier) const {
  const TierStats s = get(tier);
  return fmt::format("{}: current {}, peak {}, allocated {} ({}), freed {} ({})", tier_name(tier),
                     format_bytes(s.current_bytes, true), format_bytes(s.peak_bytes, true),
                     format_bytes(s.allocated_bytes, true), s.allocation_count,
                     format_bytes(s.freed_bytes, true), s.free_count);
}

}  // namespace strata
