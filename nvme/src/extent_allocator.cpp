#include "strata/nvme/extent_allocator.h"

#include <algorithm>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata::nvme {

ExtentAllocator::ExtentAllocator(uint64_t capacity_bytes, uint64_t granularity_bytes)
    : capacity_(capacity_bytes / granularity_bytes * granularity_bytes),
      granularity_(granularity_bytes),
      free_bytes_(capacity_) {
  STRATA_CHECK(granularity_bytes > 0, "ExtentAllocator granularity must be positive");
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

Result<Extent> ExtentAllocator::allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("allocate: zero-byte extent");
  uint64_t need = round_up(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    Extent extent{it->first, need};
    uint64_t rest = it->second - need;
    uint64_t rest_offset = it->first + need;
    free_.erase(it);
    if (rest > 0) free_.emplace(rest_offset, rest);
    free_bytes_ -= need;
    return extent;
  }
  return ResourceExhausted(fmt::format("no free extent of {} ({} requested): {}; raise the swap capacity",
                                       format_bytes(need, true), bytes, describe()));
}

Status ExtentAllocator::reserve(Extent extent) {
  if (extent.length == 0 || extent.offset % granularity_ != 0 || extent.length % granularity_ != 0) {
    return InvalidArgument(fmt::format("reserve: extent [{}, +{}) is empty or not aligned to {}", extent.offset,
                                       extent.length, granularity_));
  }
  auto it = free_.upper_bound(extent.offset);
  if (it == free_.begin()) {
    return FailedPrecondition(fmt::format("reserve: extent [{}, +{}) is not free", extent.offset, extent.length));
  }
  --it;
  uint64_t start = it->first, length = it->second;
  if (extent.offset + extent.length > start + length) {
    return FailedPrecondition(fmt::format("reserve: extent [{}, +{}) overlaps a used extent", extent.offset,
                                          extent.length));
  }
  free_.erase(it);
  if (extent.offset > start) free_.emplace(start, extent.offset - start);
  uint64_t end = extent.offset + extent.length;
  if (end < start + length) free_.emplace(end, start + length - end);
  free_bytes_ -= extent.length;
  return Status::Ok();
}

Status ExtentAllocator::free(Extent extent) {
  if (extent.length == 0 || extent.offset + extent.length > capacity_) {
    return InvalidArgument(fmt::format("free: extent [{}, +{}) is outside [0, {})", extent.offset, extent.length,
                                       capacity_));
  }
  auto next = free_.lower_bound(extent.offset);
  if (next != free_.end() && next->first < extent.offset + extent.length) {
    return FailedPrecondition(fmt::format("free: extent [{}, +{}) overlaps a free extent (double free?)",
                                          extent.offset, extent.length));
  }
  uint64_t start = extent.offset, end = extent.offset + extent.length;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > start) {
      return FailedPrecondition(fmt::format("free: extent [{}, +{}) overlaps a free extent (double free?)",
                                            extent.offset, extent.length));
    }
    if (prev->first + prev->second == start) {
      start = prev->first;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == end) {
    end += next->second;
    free_.erase(next);
  }
  free_.emplace(start, end - start);
  free_bytes_ += extent.length;
  return Status::Ok();
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [offset, length] : free_) best = std::max(best, length);
  return best;
}

std::string ExtentAllocator::describe() const {
  return fmt::format("{} free extent(s), {} free of {}, largest {}", free_.size(), format_bytes(free_bytes_, true),
                     format_bytes(capacity_, true), format_bytes(largest_free(), true));
}

}  // namespace strata::nvme
