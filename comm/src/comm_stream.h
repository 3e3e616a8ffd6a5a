#pragma once
// CommStream: the ordered worker behind one CommQueue of a communicator
// (Note [Comm stream] in docs/comm.md). One thread executes the queue's items
// in issue order: collectives, and gates (Note [Comm gates]).
//
// Note [Comm gates]
// Communicator::wait(completion, queue) appends a gate: the queue's own
// worker waits for it in order before it starts the next collective, so no
// thread is parked per pending dependency (nccl instead hands the gate to its
// device stream and does not wait at all). A gate that fails fails the queue,
// like a device stream: every later collective on it receives that Status and
// must end with an error without leaving its peers hanging (local and mpi
// vote it in the collective's handshake so every rank skips the collective
// and names the rank; see the backends). A gate on a completion that already
// succeeded orders nothing and is not queued (Communicator::wait).
//
// Note [Idle queues of one rank]
// Handing a collective to the queue's worker costs two thread switches (its
// wake-up, then the waiter's). A local group of one rank has no peer to wait
// for, so its collectives are copies in place; when nothing is queued or
// running on the queue, one runs on the calling thread instead, in the same
// order and with the same completion as on the worker.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "strata/comm/work.h"
#include "strata/core/device.h"

namespace strata::comm::detail {

class CommStream {
 public:
  // A collective: gets the queue's gate status (ok, or the first failed
  // gate's Status) and returns its completion (Completion::ready(status) for
  // backends that finish on the worker; nccl returns its device stream's).
  using Task = std::function<Completion(const Status& gate)>;
  // A gate: runs on the worker, returns when the dependency completed, with
  // its Status.
  using Gate = std::function<Status()>;

  // `inline_when_idle`: a collective enqueued while the queue is idle (no
  // item queued or running) runs on the calling thread (Note [Idle queues
  // of one rank]); for a backend whose collectives never wait for a peer.
  explicit CommStream(std::string name, bool inline_when_idle = false);
  ~CommStream();  // runs every queued item to completion, then joins
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  // Thread-safe. `label` names the op in the Completion ("all_reduce #3 ...").
  CommWork enqueue(uint64_t sequence, CommQueue queue, std::string label, Task task);
  void enqueue_gate(Gate gate);

 private:
  struct Item {
    Task task;  // empty for a gate
    Gate gate;
    std::shared_ptr<CompletionSource> source;  // null for a gate
    uint64_t sequence = 0;
  };
  void run();
  // Runs `item` (a collective) if the queue is idle; false (nothing done) otherwise.
  bool run_inline_if_idle(Item& item);
  // Runs a collective and completes its source (the worker or an inline caller).
  void execute(Item& item);

  std::string name_;
  const bool inline_when_idle_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  bool worker_busy_ = false;   // the worker runs an item
  bool inline_busy_ = false;   // a caller runs one: the worker starts nothing meanwhile
  Status gate_failure_;        // the thread running an item only
  std::thread worker_;
};

// The gate local and mpi append: the worker waits on the host for the
// completion (or synchronizes the event); a failure names the gate and queue.
CommStream::Gate host_gate(CommQueue queue, const Completion* completion, Event* event);

}  // namespace strata::comm::detail
