// The swap store's checksum threads. See verify_pool.h.
#include "verify_pool.h"

#include <algorithm>

namespace strata::nvme {

VerifyPool::VerifyPool(unsigned threads) {
  threads = std::max(1u, threads);
  threads_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

VerifyPool::~VerifyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void VerifyPool::post(std::function<void()> task) {
  // Notify under the lock: the task may finish the last operation of a
  // store whose destructor then destroys this pool, and must not find the
  // condition variable still being signalled (found by TSan).
  std::lock_guard<std::mutex> lock(mu_);
  tasks_.push_back(std::move(task));
  cv_.notify_one();
}

void VerifyPool::run() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything queued has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace strata::nvme
