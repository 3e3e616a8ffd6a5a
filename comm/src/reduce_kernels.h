#pragma once
// Element-wise reductions of n rank inputs, the arithmetic of the local
// backend and of the mpi backend's 16-bit staging. Accumulation is in fp32
// in rank order 0..n-1; 16-bit outputs are rounded once (RNE) at the end.
// avg divides the fp32 sum by `divisor` (the world size). fp64 and int64
// accumulate in their own type, also in rank order (exact and deterministic:
// the same bits as a sequential loop over ranks).

#include <cstddef>
#include <vector>

#include "strata/comm/communicator.h"

namespace strata::comm::detail {

// out[i] = reduce_{p<n} inputs[p][i]; out may be one of the inputs.
void reduce_elements(DType dtype, ReduceOp op, const void* const* inputs, int n, size_t count, void* out,
                     int divisor);

// Bulk conversions between a 16-bit (or fp32) buffer and fp32 (not for the
// 64-bit types).
void to_fp32(DType dtype, const void* src, float* dst, size_t count);
void from_fp32(DType dtype, const float* src, void* dst, size_t count);

// "2, 5, 7" (ranges compressed: "0-3, 6").
std::string format_rank_list(const std::vector<int>& ranks);

}  // namespace strata::comm::detail
