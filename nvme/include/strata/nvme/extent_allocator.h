#pragma once
// First-fit extent allocator over a byte range [0, capacity), in units of
// `granularity` bytes (the O_DIRECT alignment). Freed extents coalesce with
// their free neighbours, so a full free restores one extent. Not thread-safe;
// the swap store guards it.

#include <cstdint>
#include <map>
#include <string>

#include "strata/core/status.h"

namespace strata::nvme {

struct Extent {
  uint64_t offset = 0;
  uint64_t length = 0;  // bytes reserved (a multiple of the granularity)
  bool operator==(const Extent&) const = default;
};

class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t capacity_bytes, uint64_t granularity_bytes);

  // Lowest-offset free extent that fits `bytes` rounded up to the granularity.
  Result<Extent> allocate(uint64_t bytes);
  // Marks a specific extent used (rebuilding state from an index). Fails if
  // any part of it is not free.
  Status reserve(Extent extent);
  // Returns an extent from allocate()/reserve(); coalesces with neighbours.
  Status free(Extent extent);

  uint64_t capacity() const { return capacity_; }
  uint64_t granularity() const { return granularity_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  size_t free_extent_count() const { return free_.size(); }
  uint64_t round_up(uint64_t bytes) const { return (bytes + granularity_ - 1) / granularity_ * granularity_; }
  // "3 free extents, 12.0 MiB free, largest 8.0 MiB"
  std::string describe() const;

 private:
  uint64_t capacity_;
  uint64_t granularity_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, non-adjacent
};

}  // namespace strata::nvme
