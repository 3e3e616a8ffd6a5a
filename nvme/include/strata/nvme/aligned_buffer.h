#pragma once
// AlignedBuffer: an owned, move-only host allocation aligned for O_DIRECT
// (4 KiB by default), optionally pinned with mlock. Pinning degrades
// gracefully: when RLIMIT_MEMLOCK refuses it the buffer stays usable and
// pinned() says false, so callers can report it once.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "strata/core/status.h"

namespace strata::nvme {

// Backs the 2 MiB-aligned part of [data, +bytes) with 2 MiB pages
// (MADV_HUGEPAGE, then MADV_COLLAPSE for pages already faulted in, locked
// ones included). Returns "" when done or when no whole 2 MiB page fits,
// else why not (for a note). Why it matters: Note [Huge pages for I/O
// buffers] in aligned_buffer.cpp. Call before the region is registered with
// io_uring (registration pins the pages it finds).
std::string back_with_huge_pages(void* data, size_t bytes);

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates `bytes` (rounded up to `alignment`), zero-filled.
  static Result<AlignedBuffer> allocate(size_t bytes, size_t alignment = 4096, bool pin = false);

  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() const { return data_; }
  size_t size() const { return size_bytes_; }
  size_t alignment() const { return alignment_; }
  bool pinned() const { return pinned_; }
  std::span<std::byte> span() const { return {data_, size_bytes_}; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void release();
  std::byte* data_ = nullptr;
  size_t size_bytes_ = 0;
  size_t alignment_ = 0;
  bool pinned_ = false;
};

}  // namespace strata::nvme
