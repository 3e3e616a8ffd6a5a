#pragma once
// What a directory's file system offers for swap files: its type, whether
// O_DIRECT works (probed with a real aligned write and read), the direct-I/O
// alignment it asks for, and the space left. Used by `strata report --path`,
// `strata io-bench` and the swap store's up-front space check.

#include <cstdint>
#include <string>

#include "strata/core/status.h"

namespace strata::nvme {

struct PathProbe {
  std::string path;
  std::string fs_type;               // "ext4", "tmpfs", "xfs", ... or the magic in hex
  bool direct_io = false;            // an O_DIRECT write + read of one block worked
  std::string direct_detail;         // why not, when direct_io is false
  uint32_t direct_alignment = 0;     // offset/length alignment for O_DIRECT
  uint32_t memory_alignment = 0;     // buffer address alignment for O_DIRECT
  uint64_t free_bytes = 0;           // available to this user
  uint64_t total_bytes = 0;
};

// Probes `dir` (must exist and be writable; a small temporary file is created and removed).
Result<PathProbe> probe_path(const std::string& dir);

// Bytes available to this user under `path` (statvfs f_bavail).
Result<uint64_t> available_bytes(const std::string& path);

// True when `status` is an O_DIRECT transfer or open the file system refused
// (EINVAL: no O_DIRECT support, or alignment it does not accept), so the
// caller may repeat it through the page cache. Decided on the errno the
// status carries (Status::system_errno), never on its message text: an
// EINVAL from elsewhere that merely mentions "Invalid argument" in its
// message, or an EIO, is not a refusal.
bool direct_io_refused(const Status& status);

// File-system type name for a statfs magic.
std::string fs_type_name(int64_t magic);

}  // namespace strata::nvme
