#pragma once
// CommQueue: the independent ordered queues of a communicator.
//
// Each queue has its own worker and its own transport (local: its own
// rendezvous group; mpi: its own MPI_Comm_dup pair; nccl: its own ncclComm
// and stream), so a prefetch all_gather on kGather is never stuck behind a
// bucket reduce_scatter on kReduce. Ordering is per queue: every rank must
// issue the same collectives in the same order ON EACH QUEUE; there is no
// order between queues (a caller that needs one chains through completions:
// comm.wait(work.completion(), CommQueue::kGather)). See docs/comm.md.

#include <cstdint>
#include <string_view>

#include "strata/core/status.h"

namespace strata::comm {

// kReduce is also the default queue of every call that does not name one.
// kUpdate carries the all-gathers that follow an optimizer update (the
// engine's persistent layers), in update order, so that a gather waiting
// for a late layer's update never holds up the stage-3 gathers of the next
// forward on kGather (issued in acquire order).
enum class CommQueue : uint8_t { kReduce = 0, kGather = 1, kUpdate = 2 };
inline constexpr int kCommQueueCount = 3;
inline constexpr CommQueue kAllCommQueues[] = {CommQueue::kReduce, CommQueue::kGather, CommQueue::kUpdate};

constexpr int queue_index(CommQueue queue) { return static_cast<int>(queue); }
constexpr std::string_view queue_name(CommQueue queue) {
  switch (queue) {
    case CommQueue::kReduce: return "reduce";
    case CommQueue::kGather: return "gather";
    case CommQueue::kUpdate: return "update";
  }
  return "?";
}
// "reduce" | "gather" | "update"; the error names `what` and lists the choices.
Result<CommQueue> parse_queue(std::string_view text, std::string_view what = "queue");

}  // namespace strata::comm
