#pragma once
// WireDesc: what a rank tells its peers about a collective before it runs
// (the handshake of the mpi backend and of strata.torch's communicator over
// torch.distributed), and the rule by which two ranks' descriptors name the
// same collective. One layout for both: seven 64-bit words, sent as raw
// bytes (MPI_UINT64_T; an int64 tensor on torch). Private to comm/src and the
// torch communicator; the descriptor never leaves a job, so its layout is not
// a file or network format anyone else reads.
#include <cstdint>

#include "strata/comm/communicator.h"

namespace strata::comm::detail {

struct WireDesc {
  uint64_t sequence, op, dtype, reduce, root, count;
  uint64_t gate_failed;  // 1: this rank's queue gate failed, so every rank skips the collective
};
static_assert(sizeof(WireDesc) == 7 * sizeof(uint64_t), "sent as seven 64-bit words");

inline WireDesc to_wire(const CollectiveDesc& d, uint64_t sequence, bool gate_failed) {
  return WireDesc{sequence,
                  static_cast<uint64_t>(d.op),
                  static_cast<uint64_t>(d.dtype),
                  static_cast<uint64_t>(d.reduce),
                  static_cast<uint64_t>(d.root),
                  static_cast<uint64_t>(d.count),
                  gate_failed ? 1u : 0u};
}

inline CollectiveDesc from_wire(const WireDesc& w) {
  CollectiveDesc d;
  d.op = static_cast<CollectiveOp>(w.op);
  d.dtype = static_cast<DType>(w.dtype);
  d.reduce = static_cast<ReduceOp>(w.reduce);
  d.root = static_cast<int>(w.root);
  d.count = static_cast<size_t>(w.count);
  return d;
}

// Whether two ranks' descriptors name the same collective: the same sequence
// number and op, and whatever of dtype, count, root and reduction the op uses.
inline bool same_collective(const WireDesc& a, const WireDesc& b) {
  if (a.sequence != b.sequence || a.op != b.op) return false;
  const auto op = static_cast<CollectiveOp>(a.op);
  if (op == CollectiveOp::kBarrier) return true;
  if (a.dtype != b.dtype || a.count != b.count) return false;
  if (op == CollectiveOp::kBroadcast && a.root != b.root) return false;
  if ((op == CollectiveOp::kAllReduce || op == CollectiveOp::kReduceScatter) && a.reduce != b.reduce) return false;
  return true;
}

}  // namespace strata::comm::detail
