#pragma once
// Block sums of squares: the deterministic pieces of the global gradient
// norm (Note [Gradient norm] in engine.h). out[b] is the fp64 sum of g*g
// over elements [b*block, (b+1)*block) of `data`, added in a fixed pattern
// (8 interleaved lanes, then the lanes in order), so the same block gives
// the same bits wherever and by whomever it is computed. A non-finite
// element makes its block's sum non-finite.
#include <cstddef>
#include <span>

#include "strata/core/dtype.h"

namespace strata::offload {

// count must equal out.size() * block. dtype: fp32, bf16 or fp16.
void block_sums_of_squares(const void* data, DType dtype, size_t count, size_t block, std::span<double> out);

}  // namespace strata::offload
