#include "strata/offload/partition.h"

#include <algorithm>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata::offload {

size_t LayerPartition::piece_real(const SubGroup& g, int rank) const {
  const size_t begin = g.piece * static_cast<size_t>(rank);
  return begin >= g.real ? 0 : std::min(g.piece, g.real - begin);
}

LayerPartition::PieceRuns LayerPartition::piece_runs(const SubGroup& g, int rank_begin, int rank_end) const {
  PieceRuns out;
  if (rank_end <= rank_begin) return out;
  const uint64_t begin = static_cast<uint64_t>(rank_begin), end = static_cast<uint64_t>(rank_end);
  const uint64_t full = g.piece == 0 ? 0 : g.real / g.piece;         // ranks [0, full): full pieces
  const size_t partial = g.piece == 0 ? 0 : g.real - full * g.piece;  // rank `full`: the rest, if any
  auto add = [&out](size_t real, uint64_t first, uint64_t last) {
    if (last > first) out.runs[out.count++] = PieceRun{real, last - first};
  };
  const uint64_t full_end = std::clamp(full, begin, end);
  add(g.piece, begin, full_end);
  uint64_t empty_begin = full_end;
  if (partial != 0 && full >= begin && full < end) {
    add(partial, full, full + 1);
    empty_begin = full + 1;
  }
  add(0, empty_begin, end);
  return out;
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
