#pragma once
// Internal: the swap store's small pool of checksum threads.
//
// Checksums are part of a swap operation's completion (a read completes
// only after its blocks were verified), but they must not run on the thread
// that waits (it would serialise hashing behind the wait) nor on an I/O
// engine worker (it would hold up unrelated pieces). Engine callbacks post
// hashing tasks here instead. Tasks run in FIFO order; the destructor runs
// what is queued, then joins.

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::nvme {

class VerifyPool {
 public:
  explicit VerifyPool(unsigned threads);
  ~VerifyPool();
  VerifyPool(const VerifyPool&) = delete;
  VerifyPool& operator=(const VerifyPool&) = delete;

  // Queues `task`; it runs on a pool thread with no pool lock held.
  void post(std::function<void()> task);
  unsigned threads() const { return static_cast<unsigned>(threads_.size()); }

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace strata::nvme
