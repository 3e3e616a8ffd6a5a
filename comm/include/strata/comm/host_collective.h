#pragma once
// A collective over small host arrays (a loss, a vote, norm block sums) on
// any backend: directly on local and mpi, whose buffers are host memory;
// on nccl, whose buffers must be device memory, through comm buffers that
// are uploaded before and downloaded after. Blocks until the collective and
// the copies are done.
//
//   double loss = ..., sum = 0;
//   STRATA_RETURN_IF_ERROR(comm::host_collective(comm, &loss, 8, &sum, 8, [&](const void* s, void* r) {
//     return comm.all_reduce(s, r, 1, DType::kF64, comm::ReduceOp::kSum);
//   }, "summing the loss"));
#include <cstddef>
#include <functional>
#include <string_view>

#include "strata/comm/communicator.h"

namespace strata::comm {

// `issue` receives the send and recv pointers to use (the host arrays, or
// device comm buffers on nccl) and issues exactly one collective.
inline Status host_collective(Communicator& comm, const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                              const std::function<Result<CommWork>(const void* send, void* recv)>& issue,
                              std::string_view what) {
  if (comm.backend() != Backend::kNccl) {
    STRATA_ASSIGN_OR_RETURN(CommWork w, issue(send, recv));
    return w.wait().with_context(what);
  }
  STRATA_ASSIGN_OR_RETURN(CommBuffer s, comm.allocate_buffer(send_bytes == 0 ? 1 : send_bytes));
  STRATA_ASSIGN_OR_RETURN(CommBuffer r, comm.allocate_buffer(recv_bytes == 0 ? 1 : recv_bytes));
  if (send_bytes != 0) STRATA_RETURN_IF_ERROR(comm.upload(s.data(), send, send_bytes));
  STRATA_ASSIGN_OR_RETURN(CommWork w, issue(s.data(), r.data()));
  STRATA_RETURN_IF_ERROR(w.wait().with_context(what));
  return recv_bytes == 0 ? Status::Ok() : comm.download(recv, r.data(), recv_bytes);
}

}  // namespace strata::comm
