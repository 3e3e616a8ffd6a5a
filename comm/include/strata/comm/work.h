#pragma once
// CommWork: one queued collective. A copyable handle whose state is a
// strata::Completion (strata/core/completion.h): every copy observes the same
// completion and Status, and the Completion can gate a device stream
// (stream.wait(work.completion())), another queue (comm.wait(...)) or a host
// callback (work.completion().then(...)). A failed collective's Status names
// the op, its sequence number on its queue and the rank(s) that failed or did
// not arrive. A default-constructed CommWork is already complete and ok.

#include <chrono>
#include <cstdint>

#include "strata/comm/queue.h"
#include "strata/core/completion.h"
#include "strata/core/status.h"

namespace strata::comm {

class [[nodiscard]] CommWork {
 public:
  CommWork() = default;
  CommWork(Completion completion, uint64_t sequence, CommQueue queue)
      : completion_(std::move(completion)), sequence_(sequence), queue_(queue) {}

  // Non-blocking: true once the collective has completed (or failed).
  bool done() const { return completion_.done(); }
  // Blocks until completion; returns the collective's status (the same on
  // every call). The watchdog bounds the wait.
  Status wait() const { return completion_.wait(); }
  // Waits at most `timeout`; Unavailable if the op is still running.
  Status wait_for(std::chrono::milliseconds timeout) const;
  // Sequence number of the collective on its queue (0 for an empty work).
  uint64_t sequence() const { return sequence_; }
  CommQueue queue() const { return queue_; }
  // The completion itself: hand it to Stream::wait, when_all, then().
  const Completion& completion() const { return completion_; }

 private:
  Completion completion_;
  uint64_t sequence_ = 0;
  CommQueue queue_ = CommQueue::kReduce;
};

}  // namespace strata::comm
