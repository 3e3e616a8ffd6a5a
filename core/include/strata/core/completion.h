#pragma once
// Completion: the one way an asynchronous operation finishes in Strata.
//
// A Completion is a copyable handle to a shared completion state: every copy
// observes the same outcome, a Status. Host code produces it through a
// CompletionSource (an NVMe read, a collective, a CPU Adam tile, a checksum
// check); consumers wait for it on the host (wait), chain work onto it
// (then), or make a device stream wait for it (Stream::wait(Completion),
// see device.h). See docs/async.md ("how an asynchronous thing completes").
//
// Note [Completion rules]
//  1. A Completion completes exactly once, with the Status of its operation.
//     A waiter always learns that Status: a failed producer never looks like a
//     success downstream (a stream gated on a failed read fails with the
//     read's error, and so does every event recorded after the gate).
//  2. then(callback) runs the callback exactly once with the Status: at once
//     on the calling thread if already complete, else on the thread that
//     completes it, after the state is published and with no lock held, so a
//     callback may wait on, complete or chain other completions freely. Keep
//     callbacks short: they run on I/O, comm or stream worker threads.
//  3. A CompletionSource that is destroyed without complete() completes its
//     Completion with Internal("... abandoned ..."), so a waiter never hangs
//     on a producer that went away (e.g. an error path that forgot it).
//  4. A default-constructed Completion is already complete and ok (the
//     completion of "nothing to wait for").

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata {

namespace detail {
struct CompletionState;
}  // namespace detail

using CompletionCallback = std::function<void(const Status&)>;

class Completion {
 public:
  // Already complete, ok.
  Completion() = default;
  // An already-complete Completion with `status` (for synchronous paths).
  static Completion ready(Status status = Status::Ok(), std::string label = {});

  // True once complete (ok or not). Never blocks.
  bool done() const;
  // Blocks until complete; returns the operation's Status (same on every call).
  Status wait() const;
  // Waits at most `timeout`: true when complete (then status() is final).
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // The Status once done(); FailedPrecondition naming the label before that.
  Status status() const;
  // What the operation is ("nvme read of 'f.swp' [0, 4096)"), for messages.
  std::string label() const;
  // Rule 2 above.
  void then(CompletionCallback callback) const;

  // Identity: two handles of the same state.
  bool same_as(const Completion& other) const { return state_ == other.state_; }

 private:
  friend class CompletionSource;
  friend Completion when_all(std::span<const Completion> inputs, std::string label);
  explicit Completion(std::shared_ptr<detail::CompletionState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::CompletionState> state_;  // null: complete and ok
};

// The producer side. Move-only; complete() once.
class CompletionSource {
 public:
  explicit CompletionSource(std::string label = {});
  CompletionSource(CompletionSource&&) noexcept = default;
  CompletionSource& operator=(CompletionSource&& other) noexcept;
  CompletionSource(const CompletionSource&) = delete;
  CompletionSource& operator=(const CompletionSource&) = delete;
  ~CompletionSource();  // rule 3

  // The operation's Completion; valid before and after complete().
  Completion completion() const { return Completion(state_); }
  // Publishes `status`, wakes waiters, then runs the callbacks on this thread.
  // A second call is a bug (STRATA_CHECK).
  void complete(Status status);
  bool valid() const { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::CompletionState> state_;
};

// Completes when every input has; its Status is the first failure in input
// order (so the error is deterministic), else ok. Does not block.
// When the other inputs are complete and ok, the one input still pending is
// returned itself (with its own label, not `label`): no join is built.
Completion when_all(std::span<const Completion> inputs, std::string label = {});

}  // namespace strata
