#pragma once
// How the engine cuts a model's training state into rank shards.
//
// Note [Partition]
// Every layer is one flat run of elements (LayerSpec::param_count). It is
// cut into sub-groups of at most `sub_group_size` elements; a sub-group is
// split into `world` equal rank pieces of `piece` elements each, a multiple
// of kShardAlign. Every sub-group but a layer's last is exactly world x piece
// real elements, so the padding of a layer sits only at its end: the layer's
// padded flat buffer ("padded space") holds the real elements first, and an
// all-gather of the pieces of every sub-group into it rebuilds the layer with
// no reshuffle. A rank's shard of a layer is its pieces of every sub-group
// back to back.
//
// Why kShardAlign (2048 elements): it is the block of the global gradient
// norm (the fp64 partial sums combined in block order, Note [Gradient norm]
// in engine.h) and a multiple of 4 KiB for 16-bit and 32-bit state, the I/O
// alignment of the NVMe tier. Because every piece is a whole number of
// blocks, a block is always inside one rank's piece, whatever the world size
// or stage, so sharding cannot change the norm.
//
// State ids are stable names of a piece: (layer, sub-group, rank), printed
// as "layer 3 'h2' group 0 rank 1" in messages.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/core/layered_model.h"
#include "strata/core/status.h"

namespace strata::offload {

inline constexpr size_t kShardAlign = 2048;

struct StateId {
  uint32_t layer = 0;
  uint32_t group = 0;
  int32_t rank = 0;
  bool operator==(const StateId&) const = default;
};

struct SubGroup {
  size_t padded_begin = 0;  // first element in the layer's padded space
  size_t piece = 0;         // elements per rank piece (multiple of kShardAlign)
  size_t real = 0;          // real (unpadded) elements of the sub-group
  size_t shard_offset = 0;  // where a rank's piece starts inside its shard of the layer
};

struct LayerPartition {
  std::string name;
  size_t elements = 0;         // real elements (LayerSpec::param_count)
  size_t padded_elements = 0;  // sum over sub-groups of world x piece
  size_t shard_elements = 0;   // one rank's shard: sum of pieces
  std::vector<SubGroup> groups;

  // First element of `rank`'s piece of group g in padded space.
  size_t piece_begin(const SubGroup& g, int rank) const { return g.padded_begin + g.piece * static_cast<size_t>(rank); }
  // Real (not padding) elements in `rank`'s piece of g: a prefix of the piece.
  size_t piece_real(const SubGroup& g, int rank) const;

  // Ranks [rank_begin, rank_end) of g grouped by piece_real: the ranks below
  // real / piece hold a full piece, that rank the partial one, the rest none,
  // so at most three runs. A sum or maximum over the ranks of anything that
  // depends only on a piece's size is one over the runs, whatever the world.
  struct PieceRun {
    size_t real = 0;   // piece_real of every rank of the run
    uint64_t ranks = 0;  // how many ranks, >= 1
  };
  struct PieceRuns {
    std::array<PieceRun, 3> runs;
    size_t count = 0;
    const PieceRun* begin() const { return runs.data(); }
    const PieceRun* end() const { return runs.data() + count; }
  };
  PieceRuns piece_runs(const SubGroup& g, int rank_begin, int rank_end) const;
};

class Partition {
 public:
  // `sub_group_size` (elements, >= 1) is rounded down to a multiple of
  // world x kShardAlign (at least one). InvalidArgument for world < 1.
  static Result<Partition> create(std::span<const LayerSpec> layers, int world, int64_t sub_group_size);

  int world() const { return world_; }
  size_t layer_count() const { return layers_.size(); }
  const LayerPartition& layer(size_t i) const { return layers_[i]; }
  // Elements of one sub-group that is not a layer's last.
  size_t sub_group_elements() const { return sub_group_elements_; }
  // Sum over layers of shard_elements / padded_elements / elements.
  size_t shard_elements() const;
  size_t padded_elements() const;
  size_t real_elements() const;

  // "layer 3 'h2' group 0 rank 1"
  std::string describe(const StateId& id) const;

  // One rank of each run of ranks whose pieces have the same real sizes in
  // every sub-group, ascending, rank 0 first. In a sub-group of `real`
  // elements the ranks below real / piece hold a full piece, that rank the
  // partial one and the ranks above none, so the runs start at 0 and at
  // b and b + 1 for each sub-group's b = real / piece: at most 2 x sub-groups
  // + 1 ranks, whatever the world size. What depends on a rank only through
  // its pieces' sizes (the memory plan) is the same across its run, so the
  // largest over these ranks is the largest over all.
  std::vector<int> distinct_ranks() const;

 private:
  int world_ = 1;
  size_t sub_group_elements_ = 0;
  std::vector<LayerPartition> layers_;
};

}  // namespace strata::offload
