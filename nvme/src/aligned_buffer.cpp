#include "strata/nvme/aligned_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>

namespace strata::nvme {

Result<AlignedBuffer> AlignedBuffer::allocate(size_t bytes, size_t alignment, bool pin) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return InvalidArgument(fmt::format("AlignedBuffer: alignment {} is not a power of two", alignment));
  }
  // Buffers of 2 MiB or more are backed by 2 MiB pages where the kernel
  // allows (MADV_HUGEPAGE before the first touch): an O_DIRECT request into
  // 4 KiB pages has one segment per page, which disks with a low segment
  // limit (virtio-blk) split; verify_writes read-backs land here. Measured:
  // Note [Huge pages for I/O buffers] in apps/cmd_io_bench.cpp.
  constexpr size_t kHugePage = 2u << 20;
  if (bytes >= kHugePage) alignment = std::max(alignment, kHugePage);
  size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (rounded == 0) rounded = alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) return OutOfMemory(fmt::format("AlignedBuffer: cannot allocate {} bytes", rounded));
  if (bytes >= kHugePage) ::madvise(p, rounded, MADV_HUGEPAGE);  // advice only: 4 KiB pages otherwise
  std::memset(p, 0, rounded);
  AlignedBuffer buffer;
  buffer.data_ = static_cast<std::byte*>(p);
  buffer.size_bytes_ = bytes;
  buffer.alignment_ = alignment;
  buffer.pinned_ = pin && mlock(p, rounded) == 0;
  return buffer;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      alignment_(std::exchange(other.alignment_, 0)),
      pinned_(std::exchange(other.pinned_, false)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    alignment_ = std::exchange(other.alignment_, 0);
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { release(); }

void AlignedBuffer::release() {
  if (data_ == nullptr) return;
  if (pinned_) munlock(data_, (size_bytes_ + alignment_ - 1) / alignment_ * alignment_);
  std::free(data_);
  data_ = nullptr;
}

}  // namespace strata::nvme
