#pragma once
// Extent checksums: 64-bit xxHash (XXH3), streaming or one-shot. The hash
// library stays out of the public headers.

#include <cstddef>
#include <cstdint>
#include <memory>

namespace strata::nvme {

uint64_t checksum64(const void* data, size_t bytes);

// Streaming form for data that arrives in pieces; digest() equals
// checksum64 of the concatenation.
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(ChecksumStream&&) noexcept;
  ChecksumStream& operator=(ChecksumStream&&) noexcept;
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strata::nvme
