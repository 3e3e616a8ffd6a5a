#include "comm_stream.h"

#include <pthread.h>

#include <exception>

#include <fmt/format.h>

namespace strata::comm {

Result<CommQueue> parse_queue(std::string_view text, std::string_view what) {
  for (CommQueue q : kAllCommQueues) {
    if (text == queue_name(q)) return q;
  }
  return InvalidArgument(fmt::format("{}: unknown comm queue '{}'; choose reduce, gather or update", what, text));
}

Status CommWork::wait_for(std::chrono::milliseconds timeout) const {
  if (!completion_.wait_for(timeout)) {
    return Unavailable(fmt::format("collective #{} on queue {} still running after {} ms", sequence_,
                                   queue_name(queue_), timeout.count()));
  }
  return completion_.status();
}

namespace detail {

CommStream::CommStream(std::string name, bool inline_when_idle)
    : name_(std::move(name)), inline_when_idle_(inline_when_idle) {
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

CommWork CommStream::enqueue(uint64_t sequence, CommQueue queue, std::string label, Task task) {
  Item item;
  item.task = std::move(task);
  item.source = std::make_shared<CompletionSource>(std::move(label));
  item.sequence = sequence;
  Completion completion = item.source->completion();
  if (inline_when_idle_ && run_inline_if_idle(item)) return CommWork(std::move(completion), sequence, queue);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
  return CommWork(std::move(completion), sequence, queue);
}

bool CommStream::run_inline_if_idle(Item& item) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!queue_.empty() || worker_busy_ || inline_busy_) return false;
    inline_busy_ = true;
  }
  execute(item);
  bool queued_meanwhile;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inline_busy_ = false;
    queued_meanwhile = !queue_.empty();
  }
  if (queued_meanwhile) cv_.notify_one();
  return true;
}

void CommStream::execute(Item& item) {
  Completion done;
  try {
    done = item.task(gate_failure_);
  } catch (const std::exception& e) {
    done = Completion::ready(Internal(fmt::format("{}: collective #{} threw: {}", name_, item.sequence, e.what())));
  }
  // Completes on this thread when the collective finished here (local,
  // mpi), else on the thread that completes `done` (nccl's stream).
  done.then([source = std::move(item.source)](const Status& s) { source->complete(s); });
}

void CommStream::enqueue_gate(Gate gate) {
  Item item;
  item.gate = std::move(gate);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
}

void CommStream::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      worker_busy_ = false;
      cv_.wait(lock, [this] { return (stopping_ && queue_.empty()) || (!queue_.empty() && !inline_busy_); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
      worker_busy_ = true;
    }
    if (item.gate) {
      Status s;
      try {
        s = item.gate();
      } catch (const std::exception& e) {
        s = Internal(fmt::format("{}: a gate threw: {}", name_, e.what()));
      }
      if (!s.ok() && gate_failure_.ok()) gate_failure_ = std::move(s);  // the queue is failed from now on
      continue;
    }
    execute(item);
  }
}

CommStream::Gate host_gate(CommQueue queue, const Completion* completion, Event* event) {
  if (completion != nullptr) {
    return [gate = *completion, queue] {
      const std::string label = gate.label();
      return gate.wait().with_context(fmt::format("gate '{}' on comm queue {} failed",
                                                  label.empty() ? "unlabelled completion" : label, queue_name(queue)));
    };
  }
  return [event, queue] {
    return event->synchronize().with_context(fmt::format("gate (device event) on comm queue {} failed",
                                                         queue_name(queue)));
  };
}

}  // namespace detail
}  // namespace strata::comm
