#pragma once
// Byte accounting per tier: {current, peak, allocated, freed}, in the style
// of c10's allocator stats. Thread-safe (atomics); cheap enough for every
// allocation. Each allocator owns one MemoryStats; MemoryStats::process()
// is the sum over all of them for the whole process.

#include <atomic>
#include <cstdint>
#include <string>

#include "strata/core/tier.h"

namespace strata {

struct TierStats {
  uint64_t current_bytes = 0;     // in use now
  uint64_t peak_bytes = 0;        // max of current_bytes since creation / reset_peak
  uint64_t allocated_bytes = 0;   // total ever allocated
  uint64_t freed_bytes = 0;       // total ever freed
  uint64_t allocation_count = 0;
  uint64_t free_count = 0;
};

class MemoryStats {
 public:
  MemoryStats() = default;
  MemoryStats(const MemoryStats&) = delete;
  MemoryStats& operator=(const MemoryStats&) = delete;

  void on_allocate(Tier tier, uint64_t bytes);
  // STRATA_CHECKs that `bytes` does not exceed what is in use (a double free).
  void on_free(Tier tier, uint64_t bytes);
  TierStats get(Tier tier) const;
  // Sets peak to current for one tier (e.g. at the start of a step).
  void reset_peak(Tier tier);
  // "device: current 1.00 MiB, peak 2.00 MiB, allocated 3.00 MiB (3), freed 2.00 MiB (2)"
  std::string to_string(Tier tier) const;

  // Process-wide totals; every MemoryStats also feeds these.
  static MemoryStats& process();

 private:
  explicit MemoryStats(bool is_process) : is_process_(is_process) {}
  struct Counters {
    std::atomic<uint64_t> current{0}, peak{0}, allocated{0}, freed{0}, allocations{0}, frees{0};
  };
  void apply_allocate(Tier tier, uint64_t bytes);
  void apply_free(Tier tier, uint64_t bytes);
  Counters counters_[kTierCount];
  bool is_process_ = false;
};

}  // namespace strata
