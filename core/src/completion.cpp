#include "strata/core/completion.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <utility>

#include <fmt/format.h>

namespace strata {
namespace detail {

struct CompletionState {
  explicit CompletionState(std::string l) : label(std::move(l)) {}
  const std::string label;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::vector<CompletionCallback> callbacks;

  void complete(Status s) {
    std::vector<CompletionCallback> to_run;
    {
      std::lock_guard<std::mutex> lock(mutex);
      STRATA_CHECK(!done, fmt::format("completion '{}' completed twice", label));
      done = true;
      status = std::move(s);
      to_run.swap(callbacks);
      cv.notify_all();  // under the lock: no waiter sees `done` before we stop touching cv
    }
    // `status` is immutable from here on, so callbacks may read it unlocked.
    for (CompletionCallback& cb : to_run) cb(status);
  }
};

}  // namespace detail

Completion Completion::ready(Status status, std::string label) {
  if (status.ok() && label.empty()) return Completion();
  auto state = std::make_shared<detail::CompletionState>(std::move(label));
  state->done = true;
  state->status = std::move(status);
  return Completion(std::move(state));
}

bool Completion::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

Status Completion::wait() const {
  if (!state_) return Status::Ok();
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

bool Completion::wait_for(std::chrono::nanoseconds timeout) const {
  if (!state_) return true;
  std::unique_lock<std::mutex> lock(state_->mutex);
  return state_->cv.wait_for(lock, timeout, [&] { return state_->done; });
}

Status Completion::status() const {
  if (!state_) return Status::Ok();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->done)
    return FailedPrecondition(fmt::format("'{}' has not completed yet; wait() for it first",
                                          state_->label.empty() ? "operation" : state_->label));
  return state_->status;
}

std::string Completion::label() const { return state_ ? state_->label : std::string(); }

void Completion::then(CompletionCallback callback) const {
  if (!callback) return;
  if (!state_) {
    callback(Status::Ok());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->done) {
      state_->callbacks.push_back(std::move(callback));
      return;
    }
  }
  callback(state_->status);  // done: status is immutable
}

CompletionSource::CompletionSource(std::string label)
    : state_(std::make_shared<detail::CompletionState>(std::move(label))) {}

CompletionSource& CompletionSource::operator=(CompletionSource&& other) noexcept {
  if (this != &other) {
    CompletionSource old(std::move(*this));  // abandons our state, if any (rule 3)
    state_ = std::move(other.state_);
  }
  return *this;
}

CompletionSource::~CompletionSource() {
  if (!state_) return;
  bool pending;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    pending = !state_->done;
  }
  if (pending)
    state_->complete(Internal(fmt::format("'{}' was abandoned: its producer went away without completing it (a bug)",
                                          state_->label.empty() ? "operation" : state_->label)));
}

void CompletionSource::complete(Status status) {
  STRATA_CHECK(state_ != nullptr, "CompletionSource::complete on a moved-from source");
  // The state stays: completion() after complete() still returns this
  // operation's outcome (never a fresh "ok"), and a second complete() is
  // caught by the state's own check.
  state_->complete(std::move(status));
}

Completion when_all(std::span<const Completion> inputs, std::string label) {
  std::vector<Completion> pending;
  for (const Completion& c : inputs)
    if (c.state_ != nullptr) pending.push_back(c);
  if (pending.empty()) return Completion::ready(Status::Ok(), std::move(label));
  // Every input complete already: the outcome is known, no join is needed.
  if (std::all_of(pending.begin(), pending.end(), [](const Completion& c) { return c.done(); })) {
    for (const Completion& c : pending)
      if (Status s = c.status(); !s.ok()) return Completion::ready(std::move(s), std::move(label));
    return Completion::ready(Status::Ok(), std::move(label));
  }
  // Inputs complete and ok change nothing: one input left pending is then the
  // join itself (same moment, same status); no join or label is built.
  const Completion* open = nullptr;
  size_t open_count = 0;
  bool failed = false;
  for (const Completion& c : pending) {
    if (!c.done()) open = &c, ++open_count;
    else if (!c.status().ok()) failed = true;
  }
  if (open_count == 1 && !failed) return *open;

  struct Join {
    std::vector<Completion> inputs;
    std::atomic<size_t> remaining;
    CompletionSource source;
  };
  auto join = std::make_shared<Join>();
  join->inputs = pending;
  join->remaining.store(pending.size());
  join->source = CompletionSource(std::move(label));
  Completion out = join->source.completion();
  for (const Completion& c : pending) {
    c.then([join](const Status&) {
      if (join->remaining.fetch_sub(1) != 1) return;
      Status first;
      for (const Completion& in : join->inputs) {
        Status s = in.status();
        if (!s.ok()) {
          first = std::move(s);
          break;
        }
      }
      join->inputs.clear();  // break the cycle inputs -> callback -> join
      join->source.complete(std::move(first));
    });
  }
  return out;
}

}  // namespace strata
