#pragma once
// Exactly checkable collective inputs (the nccl-tests idea): every send
// element is a small integer, exact in fp32, fp16, bf16, fp64 and int64, and every sum of
// them over up to 256 ranks is exact too, so the expected result of each
// collective is known bit for bit whatever the reduction order. Used by the
// tests and by `strata comm-bench` for its #wrong column.

#include <cstddef>
#include <cstdint>

#include "strata/comm/communicator.h"

namespace strata::comm {

// Elements in this rank's send buffer / recv buffer for `desc`.
size_t send_count(const CollectiveDesc& desc, int world_size);
size_t recv_count(const CollectiveDesc& desc, int world_size);

// Writes rank `rank`'s send contents for `desc` (send_count elements of
// desc.dtype) into host memory. Broadcast: only the root's matters.
void fill_send_pattern(const CollectiveDesc& desc, int rank, int world_size, void* host_send);

// Fills a recv buffer with a NaN sentinel so elements a collective forgets
// to write are caught.
void fill_sentinel(DType dtype, void* host, size_t count);

// Expected value (as desc.dtype bits widened to uint64) of element `index`
// of rank `rank`'s recv buffer. Reductions follow the documented semantics:
// fp32 accumulation, avg = fp32 sum / world size, one RNE rounding to 16
// bits; fp64 and int64 accumulate in their own type (avg = fp64 sum / world).
uint64_t expected_bits(const CollectiveDesc& desc, int rank, int world_size, size_t index);

// Number of recv elements that differ bitwise from expected_bits();
// *first_wrong (if given) receives the first such index, or SIZE_MAX.
size_t count_wrong(const CollectiveDesc& desc, int rank, int world_size, const void* host_recv,
                   size_t* first_wrong = nullptr);

// Reads element `index` of a host buffer of `dtype` as bits.
uint64_t element_bits(DType dtype, const void* host, size_t index);

}  // namespace strata::comm
