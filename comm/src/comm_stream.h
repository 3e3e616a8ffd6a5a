#pragma once
// CommStream: the ordered queue every communicator runs its collectives on
// (Note [Comm stream] in docs/comm.md). One worker thread per communicator
// executes tasks in issue order and completes each task's CommWork; callers
// overlap compute with it and wait on the events they need.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "strata/comm/work.h"

namespace strata::comm::detail {

class CommStream {
 public:
  using Task = std::function<Status()>;
  explicit CommStream(std::string name);
  ~CommStream();  // runs every queued task to completion, then joins
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  CommWork enqueue(uint64_t sequence, Task task);

 private:
  struct Item {
    std::shared_ptr<WorkState> state;
    Task task;
  };
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace strata::comm::detail
