#pragma once
// CommWork: the completion event of one queued collective. Copyable handle
// to shared state; every copy observes the same completion and status.
// A default-constructed CommWork is an already-completed, successful event.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "strata/core/status.h"

namespace strata::comm {

namespace detail {
struct WorkState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  Status status;
  uint64_t sequence = 0;
  void complete(Status s);
};
}  // namespace detail

class [[nodiscard]] CommWork {
 public:
  CommWork() = default;
  explicit CommWork(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // Non-blocking: true once the collective has completed (or failed).
  bool done() const;
  // Blocks until completion; returns the collective's status (the same on
  // every call). The watchdog bounds the wait.
  Status wait() const;
  // Waits at most `timeout`; Unavailable if the op is still running.
  Status wait_for(std::chrono::milliseconds timeout) const;
  // Sequence number of the collective on its communicator (0 for an empty work).
  uint64_t sequence() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace strata::comm
