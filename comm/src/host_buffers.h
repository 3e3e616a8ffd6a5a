#pragma once
// Host-memory buffers and copies shared by the backends whose collectives
// run on host memory (local, mpi).

#include <cstdlib>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

#include "strata/comm/communicator.h"
#include "strata/core/units.h"

namespace strata::comm {

// A 64-byte aligned host buffer; `backend` names the communicator in errors.
inline Result<CommBuffer> allocate_host_comm_buffer(size_t bytes, std::string_view backend) {
  if (bytes == 0) return CommBuffer();
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return OutOfMemory(fmt::format("{} comm buffer of {}", backend, format_bytes(bytes, true)));
  return CommBuffer(p, bytes, [](void* q) { std::free(q); });
}

inline Status host_copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status::Ok();
}

}  // namespace strata::comm
