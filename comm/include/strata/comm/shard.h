#pragma once
// Shard arithmetic for tensors whose size is not a multiple of the world
// size. Convention (the one ZeRO stage 3 checkpoints use): each rank owns
// shard_count(total, world) = ceil(total / world) elements; the flat tensor
// is padded to world * shard_count elements, so the padding sits at the end
// of the last rank(s). all_gather of the padded shards yields the padded flat
// tensor; reduce_scatter of a padded flat gradient yields the padded shards.

#include <algorithm>
#include <cstddef>

namespace strata::comm {

constexpr size_t shard_count(size_t total, int world_size) {
  return world_size <= 0 ? 0 : (total + static_cast<size_t>(world_size) - 1) / static_cast<size_t>(world_size);
}
constexpr size_t padded_count(size_t total, int world_size) {
  return shard_count(total, world_size) * static_cast<size_t>(world_size);
}
// First element of `rank`'s shard in the padded flat tensor.
constexpr size_t shard_offset(size_t total, int world_size, int rank) {
  return shard_count(total, world_size) * static_cast<size_t>(rank);
}
// Elements of `rank`'s shard that are real data (the rest is padding).
constexpr size_t shard_valid_count(size_t total, int world_size, int rank) {
  const size_t begin = shard_offset(total, world_size, rank);
  return begin >= total ? 0 : std::min(shard_count(total, world_size), total - begin);
}

}  // namespace strata::comm
