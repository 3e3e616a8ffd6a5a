#pragma once
// A stream's first failure, by op number, and the failures it takes over
// from the streams it waited on through events: the cuda device's failure
// bookkeeping (Note [cuda gates] and Note [Failures across event waits] in
// cuda/cuda_device.cpp). Plain C++, so that it is tested on machines without
// a GPU (tests/core/stream_failure_log_test.cpp).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/core/status.h"

namespace strata::detail {

// The first failure of a stream and the op number it happened at (Note [cuda
// gates]), and the streams it waited on through events (Note [Failures
// across event waits]).
struct StreamFailureLog {
  // From op `from_op` on, this stream carries `source`'s failures up to `source_op`.
  struct Link {
    uint64_t from_op;
    std::shared_ptr<StreamFailureLog> source;
    uint64_t source_op;
  };
  std::mutex mutex;
  uint64_t failed_at = UINT64_MAX;
  Status failure;
  std::vector<Link> links;

  void fail(uint64_t op, Status st) {
    std::lock_guard<std::mutex> lock(mutex);
    if (op < failed_at) {
      failed_at = op;
      failure = std::move(st);
    }
  }
  // `source`'s first failure up to `source_op`, as a stream that waited on it reports it.
  static Status waited_failure(StreamFailureLog& source, uint64_t source_op) {
    Status st = source.failure_up_to(source_op);
    return st.ok() ? st : st.with_context("stream waited on an event recorded after a failure");
  }
  void link(uint64_t from_op, std::shared_ptr<StreamFailureLog> source, uint64_t source_op) {
    std::lock_guard<std::mutex> lock(mutex);
    links.push_back({from_op, std::move(source), source_op});
  }
  // The first failure at or before op `op`: this stream's own, or one that a
  // stream it waited on had before the event it waited for.
  Status failure_up_to(uint64_t op) {
    uint64_t first_at;
    Status first;
    std::vector<Link> waited;
    {
      std::lock_guard<std::mutex> lock(mutex);
      first_at = failed_at <= op ? failed_at : UINT64_MAX;
      if (first_at != UINT64_MAX) first = failure;
      for (const Link& l : links) {
        if (l.from_op <= op && l.from_op < first_at) waited.push_back(l);
      }
    }
    // Not under the lock: the source may be waiting on this stream's events
    // too; each step looks at earlier work, so the walk ends.
    for (const Link& l : waited) {
      if (l.from_op >= first_at) continue;
      Status st = waited_failure(*l.source, l.source_op);
      if (st.ok()) continue;
      first_at = l.from_op;
      first = std::move(st);
    }
    return first_at == UINT64_MAX ? Status::Ok() : first;
  }
  // Called once every op up to `op` has completed, and so has the work each
  // of its waits waited for: the failures reached through those links are
  // final, so they become this log's own and the links are dropped (the
  // list stays as short as the waits still in flight).
  void settle_up_to(uint64_t op) {
    std::vector<Link> due;
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const Link& l : links) {
        if (l.from_op <= op) due.push_back(l);
      }
    }
    if (due.empty()) return;
    for (const Link& l : due) {
      Status st = waited_failure(*l.source, l.source_op);
      if (!st.ok()) fail(l.from_op, std::move(st));
    }
    // Only now: a reader in between sees the link or the failure it became.
    // Only the links looked at: one pushed meanwhile by another issuing
    // thread may carry an op number at or below `op` and is not settled yet.
    std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(links, [&due](const Link& l) {
      return std::any_of(due.begin(), due.end(), [&l](const Link& d) {
        return d.from_op == l.from_op && d.source == l.source && d.source_op == l.source_op;
      });
    });
  }
};

}  // namespace strata::detail
