#pragma once
// A host thread that runs tasks in submission order, each after an optional
// gate Completion, and gives each task's outcome as a Completion. The
// engine's CPU optimizer runs on one, so the thread that drives the model
// never blocks on an optimizer step. Failures are sticky, as on a device
// stream: once a task (or its gate) fails, later tasks are skipped and
// complete with that Status; a task submitted as not sticky reports its
// failure only through its own Completion (the engine's updates: a failed
// one is rolled back and the steps after it must still run).
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "strata/core/completion.h"
#include "strata/core/status.h"

namespace strata::offload {

class SerialWorker {
 public:
  using Task = std::function<Status()>;
  explicit SerialWorker(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}
  ~SerialWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  Completion submit(Task task, Completion gate = {}, std::string label = {}, bool sticky = true) {
    CompletionSource source(label.empty() ? name_ : std::move(label));
    Completion done = source.completion();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Item{std::move(task), std::move(gate), std::move(source), sticky});
    }
    cv_.notify_all();
    return done;
  }
  // Seconds spent running tasks (not waiting for gates) since creation.
  double busy_seconds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return busy_seconds_;
  }

 private:
  struct Item {
    Task task;
    Completion gate;
    CompletionSource source;
    bool sticky = true;
  };
  void run() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      Status st = failed_;
      if (st.ok()) st = item.gate.wait();
      if (st.ok()) {
        const auto t0 = std::chrono::steady_clock::now();
        st = item.task();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(mutex_);
        busy_seconds_ += s;
      }
      if (!st.ok() && failed_.ok() && item.sticky) failed_ = st;
      item.task = nullptr;  // drop captures before waking waiters
      item.source.complete(st);
    }
  }
  std::string name_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  Status failed_;
  double busy_seconds_ = 0;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace strata::offload
