#include "strata/nvme/aligned_buffer.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>

namespace strata::nvme {

// Note [Huge pages for I/O buffers]
// On this project's VMs (virtio-blk, max_segments 254) a 1 MiB O_DIRECT
// request over 4 KiB pages has 256 segments and is split; over one 2 MiB
// page it is one segment. Measured with io-bench (512 MiB reads, 1 MiB
// blocks, depth 32, registered buffer, alternating runs): 1.17-1.27 GB/s
// with 4 KiB pages, 3.40-3.73 GB/s with 2 MiB pages (docs/performance.md,
// issue 9). THP is usually in "madvise" mode, so nothing gets huge pages
// unless asked: AlignedBuffer asks for buffers >= 2 MiB, and IoEngine::
// register_buffer() collapses a registered region (a SlotPool's) before
// registering it (IoEngineOptions::huge_page_buffers).
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

std::string back_with_huge_pages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end <= begin) return "";
  void* p = reinterpret_cast<void*>(begin);
  if (::madvise(p, end - begin, MADV_HUGEPAGE) != 0 || ::madvise(p, end - begin, MADV_COLLAPSE) != 0) {
    return fmt::format("2 MiB pages refused for a {} byte I/O buffer ({}): 4 KiB pages, so a 1 MiB request spans "
                       "256 of them (slower on disks with a low segment limit, e.g. virtio)",
                       bytes, std::strerror(errno));
  }
  return "";
}

Result<AlignedBuffer> AlignedBuffer::allocate(size_t bytes, size_t alignment, bool pin) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return InvalidArgument(fmt::format("AlignedBuffer: alignment {} is not a power of two", alignment));
  }
  // Buffers of 2 MiB or more are backed by 2 MiB pages where the kernel
  // allows (MADV_HUGEPAGE before the first touch): an O_DIRECT request into
  // 4 KiB pages has one segment per page, which disks with a low segment
  // limit (virtio-blk) split; verify_writes read-backs land here. See
  // Note [Huge pages for I/O buffers].
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
