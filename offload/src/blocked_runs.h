#pragma once
// How one piece's optimizer step is cut into kernel calls when its moments
// are block-wise 8-bit (cpu_adam::MomentStorage::int8) and its elements have
// several runs of hyper-parameters (tensors with their own weight decay or
// lr scale: UpdateScheduler's runs).
//
// Note [Runs in 8-bit blocks]
// A block's scale is the largest magnitude in the block after the update,
// so a block must be updated in one go: two kernel calls that each cover
// half a block would each re-scale the whole block from half of it. The
// blocks sit on a fixed grid of the layer (pieces start on multiples of
// kShardAlign = 2048 elements, a multiple of the 256-element block), so they are the same
// whatever the world size, stage or sub-group size. A block inside one run
// goes to the 8-bit kernel with its neighbours of the same run (`whole`); a
// block that a run boundary cuts (`shared`) is decoded to fp32, each run's
// part stepped by the fp32 kernel, and encoded again. Both are
// deterministic, and which blocks are shared depends only on the model's
// tensors and hyper-parameters, so losses stay bit-identical across stages,
// placements and sub-group sizes.
#include <cstddef>
#include <span>
#include <vector>

namespace strata::offload::engine_detail {

// A run of equal hyper-parameters: elements [offset, offset + count) of the piece.
struct ElementRun {
  size_t offset = 0, count = 0;
};

struct BlockedSteps {
  // Elements [first, first + count) all in run `run`: whole blocks (the last
  // may be the piece's partial last block).
  struct Range {
    size_t run = 0;
    size_t first = 0, count = 0;
  };
  std::vector<Range> whole;
  // One block cut by a run boundary (or partly outside every run: those
  // elements are not stepped, as without 8-bit moments).
  struct SharedBlock {
    size_t first = 0, count = 0;  // the block
    std::vector<Range> parts;     // each run's part of it, in order
  };
  std::vector<SharedBlock> shared;
};

// `runs` sorted by offset, not overlapping, inside [0, piece_count).
BlockedSteps plan_blocked_steps(std::span<const ElementRun> runs, size_t piece_count, size_t block_elements);

}  // namespace strata::offload::engine_detail
