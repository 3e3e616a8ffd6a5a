#pragma once
// Internal: opening the O_DIRECT twin of a file and learning its alignment.
#include <cstdint>
#include <string>

namespace strata::nvme {

struct DirectProbe {
  int fd = -1;               // O_DIRECT descriptor, or -1
  uint32_t alignment = 4096; // max(offset alignment, memory alignment)
  std::string reason;        // why there is no direct descriptor
};

// `flags` are the open flags of the buffered descriptor (without O_CREAT).
DirectProbe probe_direct(int buffered_fd, const std::string& path, int flags);

}  // namespace strata::nvme
