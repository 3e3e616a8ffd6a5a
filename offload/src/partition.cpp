#include "strata/offload/partition.h"

#include <algorithm>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata::offload {

size_t LayerPartition::piece_real(const SubGroup& g, int rank) const {
  const size_t begin = g.piece * static_cast<size_t>(rank);
  return begin >= g.real ? 0 : std::min(g.piece, g.real - begin);
}

Result<Partition> Partition::create(std::span<const LayerSpec> layers, int world, int64_t sub_group_size) {
  if (world < 1) return InvalidArgument(fmt::format("world size {} must be at least 1", world));
  if (sub_group_size < 1)
    return InvalidArgument(fmt::format("zero_optimization.sub_group_size {} must be at least 1", sub_group_size));
  Partition p;
  p.world_ = world;
  const size_t unit = kShardAlign * static_cast<size_t>(world);
  const size_t sg = std::max(unit, static_cast<size_t>(sub_group_size) / unit * unit);
  p.sub_group_elements_ = sg;
  for (const LayerSpec& spec : layers) {
    LayerPartition lp;
    lp.name = spec.name;
    lp.elements = spec.param_count;
    size_t done = 0;
    // A layer with no parameters still gets one (all-padding) sub-group, so
    // every layer has the same shape of collectives on every rank.
    do {
      SubGroup g;
      g.real = std::min(sg, lp.elements - done);
      const size_t per_rank = (g.real + world - 1) / static_cast<size_t>(world);
      g.piece = std::max(kShardAlign, (per_rank + kShardAlign - 1) / kShardAlign * kShardAlign);
      g.padded_begin = lp.padded_elements;
      g.shard_offset = lp.shard_elements;
      lp.padded_elements += g.piece * static_cast<size_t>(world);
      lp.shard_elements += g.piece;
      lp.groups.push_back(g);
      done += g.real;
    } while (done < lp.elements);
    p.layers_.push_back(std::move(lp));
  }
  return p;
}

size_t Partition::shard_elements() const {
  size_t n = 0;
  for (const auto& l : layers_) n += l.shard_elements;
  return n;
}
size_t Partition::padded_elements() const {
  size_t n = 0;
  for (const auto& l : layers_) n += l.padded_elements;
  return n;
}
size_t Partition::real_elements() const {
  size_t n = 0;
  for (const auto& l : layers_) n += l.elements;
  return n;
}

std::vector<int> Partition::distinct_ranks() const {
  std::vector<int> starts{0};
  for (const LayerPartition& layer : layers_)
    for (const SubGroup& g : layer.groups) {
      if (g.piece == 0) continue;
      const size_t full = g.real / g.piece;  // ranks [0, full) hold a full piece
      for (size_t start : {full, full + 1})
        if (start < static_cast<size_t>(world_)) starts.push_back(static_cast<int>(start));
    }
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  return starts;
}

std::string Partition::describe(const StateId& id) const {
  const std::string name = id.layer < layers_.size() ? printable(layers_[id.layer].name, 64) : std::string("?");
  return fmt::format("layer {} '{}' group {} rank {}", id.layer, name, id.group, id.rank);
}

}  // namespace strata::offload
