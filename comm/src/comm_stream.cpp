#include "comm_stream.h"

#include <pthread.h>

#include <exception>

#include <fmt/format.h>

namespace strata::comm {

namespace detail {

void WorkState::complete(Status s) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    status = std::move(s);
    done = true;
  }
  done_cv.notify_all();
}

CommStream::CommStream(std::string name) : name_(std::move(name)) {
  worker_ = std::thread([this] { run(); });
  // Thread names are at most 15 characters; best effort, for debuggers.
  pthread_setname_np(worker_.native_handle(), name_.substr(0, 15).c_str());
}

CommStream::~CommStream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

CommWork CommStream::enqueue(uint64_t sequence, Task task) {
  auto state = std::make_shared<WorkState>();
  state->sequence = sequence;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(Item{state, std::move(task)});
  }
  cv_.notify_one();
  return CommWork(std::move(state));
}

void CommStream::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    Status status;
    try {
      status = item.task();
    } catch (const std::exception& e) {
      status = Internal(fmt::format("{}: collective #{} threw: {}", name_, item.state->sequence, e.what()));
    }
    item.state->complete(std::move(status));
  }
}

}  // namespace detail

bool CommWork::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

Status CommWork::wait() const {
  if (!state_) return Status::Ok();
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done_cv.wait(lock, [this] { return state_->done; });
  return state_->status;
}

Status CommWork::wait_for(std::chrono::milliseconds timeout) const {
  if (!state_) return Status::Ok();
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (!state_->done_cv.wait_for(lock, timeout, [this] { return state_->done; })) {
    return Unavailable(fmt::format("collective #{} still running after {} ms", state_->sequence, timeout.count()));
  }
  return state_->status;
}

uint64_t CommWork::sequence() const { return state_ ? state_->sequence : 0; }

}  // namespace strata::comm
