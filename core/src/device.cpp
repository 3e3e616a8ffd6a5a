// Device interface: DeviceBuffer ownership and the synchronizing fallbacks
// of the optional Stream methods.
#include "strata/core/device.h"

#include <utility>

#include <fmt/format.h>

namespace strata {

std::string_view copy_kind_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return "H2D";
    case CopyKind::kDeviceToHost: return "D2H";
    case CopyKind::kDeviceToDevice: return "D2D";
  }
  return "?";
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) device_->free_device_memory(data_, size_bytes_, /*synchronize=*/true);
  device_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

void* DeviceBuffer::release() {
  device_ = nullptr;
  size_bytes_ = 0;
  return std::exchange(data_, nullptr);
}

Result<DeviceBuffer> Device::allocate(size_t bytes, MemoryStats& account) {
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, allocate(bytes));
  if (buffer) {
    std::lock_guard<std::mutex> lock(counted_mutex_);
    auto it = counted_of(Tier::kDevice).find(buffer.data());
    STRATA_CHECK(it != counted_of(Tier::kDevice).end(),
                 fmt::format("the {} device did not count its allocation at {}", caps().backend, buffer.data()));
    it->second.account = &account;
    account.on_allocate(Tier::kDevice, it->second.bytes);
  }
  return buffer;
}

Result<void*> Device::allocate_pinned_host(size_t bytes, MemoryStats& account) {
  STRATA_ASSIGN_OR_RETURN(void* data, allocate_pinned_host(bytes));
  std::lock_guard<std::mutex> lock(counted_mutex_);
  auto it = counted_of(Tier::kPinnedHost).find(data);
  STRATA_CHECK(it != counted_of(Tier::kPinnedHost).end(),
               fmt::format("the {} device did not count its pinned allocation at {}", caps().backend, data));
  it->second.account = &account;
  account.on_allocate(Tier::kPinnedHost, it->second.bytes);
  return data;
}

void Device::count_allocation(Tier tier, const void* data, uint64_t bytes) {
  if (tier == Tier::kDevice) stats_.on_allocate(tier, bytes);
  std::lock_guard<std::mutex> lock(counted_mutex_);
  counted_of(tier)[data] = Counted{bytes, nullptr};
}

void Device::count_free(Tier tier, const void* data, uint64_t bytes) {
  if (tier == Tier::kDevice) stats_.on_free(tier, bytes);
  std::lock_guard<std::mutex> lock(counted_mutex_);
  auto it = counted_of(tier).find(data);
  if (it == counted_of(tier).end()) return;
  STRATA_CHECK(it->second.bytes == bytes, fmt::format("{} at {} freed as {} bytes, counted as {}", tier_name(tier),
                                                      data, bytes, it->second.bytes));
  if (it->second.account != nullptr) it->second.account->on_free(tier, bytes);
  counted_of(tier).erase(it);
}

Status Stream::memset_async(void* dst, int value, size_t bytes) {
  STRATA_RETURN_IF_ERROR(synchronize());
  return device().memset(dst, value, bytes);
}

Status Stream::wait(Event& event) {
  if (&event.device() != &device())
    return InvalidArgument("Stream::wait: the event belongs to another device; record it on a stream of this device");
  return event.synchronize();
}

Status Stream::wait(const Completion& completion) { return completion.wait(); }

// The synchronizing fallback: exact (the stream's Status) but blocking. The
// cpu and cuda backends override it with a non-blocking version.
Completion Stream::record_completion() { return Completion::ready(synchronize(), "stream work"); }

Status Stream::free_async(DeviceBuffer&& buffer) {
  if (!buffer) return Status::Ok();
  if (buffer.device() != &device())
    return InvalidArgument("Stream::free_async: the buffer belongs to another device");
  STRATA_RETURN_IF_ERROR(synchronize());
  const size_t bytes = buffer.size_bytes();
  void* data = buffer.release();
  device().free_device_memory(data, bytes, /*synchronize=*/false);
  return Status::Ok();
}

void Stream::release_device_memory(Device& device, void* data, size_t bytes) {
  device.free_device_memory(data, bytes, /*synchronize=*/false);
}

bool Stream::query() {
  synchronize().ignore();  // the error stays sticky; the next synchronize() reports it
  return true;
}

}  // namespace strata
