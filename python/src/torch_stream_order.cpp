// Note [Torch's stream and the engine's] (torch_stream_order.h).
#include "torch_stream_order.h"

#include <fmt/format.h>

#include "strata/core/borrowed_stream.h"

namespace strata::python {
namespace {

class HostOrder final : public TorchStreamOrder {
 public:
  Status wait_for(const Completion& ready, uintptr_t, const std::string&) override { return ready.wait(); }
  Result<Completion> issued_so_far(uintptr_t, const std::string&) override { return Completion(); }
  Waiter waiter(uintptr_t, const std::string&) override { return {offload::AcquireWaiter::host(), nullptr}; }
  bool waits_on_host() const override { return true; }
};

class DeviceOrder final : public TorchStreamOrder {
 public:
  explicit DeviceOrder(Device& device) : device_(device) {}
  Status wait_for(const Completion& ready, uintptr_t torch_stream, const std::string& what) override {
    // Known already: resident (nothing to order), or failed (the acquire fails here, as on the cpu device,
    // instead of lending the layer and failing torch's stream for good).
    if (ready.done()) return ready.status();
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Stream> stream, stream_of(torch_stream, what));
    return stream->wait(ready);
  }
  Result<Completion> issued_so_far(uintptr_t torch_stream, const std::string& what) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return Completion();  // the engine is gone: nothing of it waits any more
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Stream> stream, stream_of(torch_stream, what));
    return stream->record_completion();
  }
  Waiter waiter(uintptr_t torch_stream, const std::string& what) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Result<std::shared_ptr<Stream>> stream = stream_of(torch_stream, what);
    if (!stream.ok()) return {};
    return {offload::AcquireWaiter::stream(**stream), *stream};
  }
  bool waits_on_host() const override { return false; }
  void close() override {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    streams_.clear();
  }
  Status drain() override {
    std::lock_guard<std::mutex> lock(mutex_);
    Status first = Status::Ok();
    for (auto& [handle, stream] : streams_) {
      Status synced = stream->synchronize();
      if (!synced.ok() && first.ok()) first = synced.with_context(fmt::format("torch's stream {:#x}", handle));
    }
    streams_.clear();  // fresh wrappers from here on: no failure of the given-up step carries over
    return first;
  }

 private:
  // Torch's streams live as long as torch does; a borrowed wrapper per handle is kept for the engine's life.
  // Called with mutex_ held.
  Result<std::shared_ptr<Stream>> stream_of(uintptr_t torch_stream, const std::string& what) {
    if (closed_) return FailedPrecondition(fmt::format("{}: the engine is closed", what));
    auto found = streams_.find(torch_stream);
    if (found != streams_.end()) return found->second;
    Result<std::unique_ptr<Stream>> borrowed = borrow_stream(device_, reinterpret_cast<void*>(torch_stream));
    if (!borrowed.ok())
      return borrowed.status().with_context(fmt::format("{}: torch's stream {:#x}", what, torch_stream));
    std::shared_ptr<Stream> stream = std::move(*borrowed);
    streams_.emplace(torch_stream, stream);
    return stream;
  }
  Device& device_;
  std::mutex mutex_;
  std::map<uintptr_t, std::shared_ptr<Stream>> streams_;  // shared: an acquire keeps its waiter's (Waiter::keep)
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<TorchStreamOrder> make_host_order() { return std::make_unique<HostOrder>(); }
std::unique_ptr<TorchStreamOrder> make_device_order(Device& device) { return std::make_unique<DeviceOrder>(device); }

Result<std::shared_ptr<Stream>> RecordedStreamOrder::stream_of(uintptr_t torch_stream) {
  if (closed_) return FailedPrecondition("the engine is closed");
  auto found = streams_.find(torch_stream);
  if (found != streams_.end()) return found->second;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> made, device_.create_stream());
  std::shared_ptr<Stream> stream = std::move(made);
  streams_.emplace(torch_stream, stream);
  return stream;
}

Status RecordedStreamOrder::wait_for(const Completion& ready, uintptr_t torch_stream, const std::string& what) {
  std::shared_ptr<Stream> stream;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({"wait", torch_stream, what});
    STRATA_ASSIGN_OR_RETURN(stream, stream_of(torch_stream));
  }
  STRATA_RETURN_IF_ERROR(stream->wait(ready));
  return stream->record_completion().wait();  // the stand-in for the GPU reaching torch's next kernel
}

TorchStreamOrder::Waiter RecordedStreamOrder::waiter(uintptr_t torch_stream, const std::string&) {
  std::lock_guard<std::mutex> lock(mutex_);
  Result<std::shared_ptr<Stream>> stream = stream_of(torch_stream);
  if (!stream.ok()) return {};
  return {offload::AcquireWaiter::stream(**stream), *stream};
}

Result<Completion> RecordedStreamOrder::issued_so_far(uintptr_t torch_stream, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return Completion();
  entries_.push_back({"record", torch_stream, what});
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Stream> stream, stream_of(torch_stream));
  return stream->record_completion();
}

Status RecordedStreamOrder::drain() {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back({"drain", 0, "the step given up"});
  Status first = Status::Ok();
  for (auto& [handle, stream] : streams_) {
    Status synced = stream->synchronize();
    if (!synced.ok() && first.ok()) first = synced;
  }
  streams_.clear();
  return first;
}

void RecordedStreamOrder::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  streams_.clear();
}

std::vector<StreamOrderEntry> RecordedStreamOrder::entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_;
}

}  // namespace strata::python
