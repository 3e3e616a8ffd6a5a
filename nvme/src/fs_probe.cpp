// File-system probing: type, O_DIRECT support and alignment, free space.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "file_probe.h"
#include "strata/nvme/fs_probe.h"

namespace strata::nvme {
namespace {

// Asks the kernel for the direct-I/O alignment (statx STATX_DIOALIGN, Linux
// 6.1+). Returns false when the kernel or file system does not say.
bool query_dio_align(int fd, uint32_t* offset_align, uint32_t* memory_align) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_offset_align != 0) {
    *offset_align = stx.stx_dio_offset_align;
    *memory_align = stx.stx_dio_mem_align;
    return true;
  }
#endif
  return false;
}

}  // namespace

DirectProbe probe_direct(int buffered_fd, const std::string& path, int flags) {
  DirectProbe probe;
  int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    probe.reason = err == EINVAL ? std::string("file system refuses O_DIRECT")
                                 : fmt::format("O_DIRECT open failed: {}", std::strerror(err));
    return probe;
  }
  uint32_t offset_align = 0, memory_align = 0;
  if (query_dio_align(fd, &offset_align, &memory_align)) {
    probe.alignment = std::max<uint32_t>({offset_align, memory_align, 512});
  } else {
    probe.alignment = 4096;  // safe everywhere when the kernel does not say
  }
  probe.fd = fd;
  return probe;
}

bool direct_io_refused(const Status& status) { return !status.ok() && status.system_errno() == EINVAL; }

std::string fs_type_name(int64_t magic) {
  switch (static_cast<uint64_t>(magic)) {
    case 0xEF53: return "ext4";
    case 0x01021994: return "tmpfs";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x794C7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x65735546: return "fuse";
    case 0x2FC12FC1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0x858458F6: return "ramfs";
    default: return fmt::format("0x{:x}", static_cast<uint64_t>(magic));
  }
}

Result<uint64_t> available_bytes(const std::string& path) {
  struct statvfs vfs {};
  if (statvfs(path.c_str(), &vfs) != 0) return ErrnoStatus(errno, fmt::format("statvfs {}", path));
  return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

Result<PathProbe> probe_path(const std::string& dir) {
  PathProbe probe;
  probe.path = dir;
  struct statfs fs {};
  if (statfs(dir.c_str(), &fs) != 0) {
    return ErrnoStatus(errno, fmt::format("statfs {} (does the directory exist?)", dir));
  }
  probe.fs_type = fs_type_name(static_cast<int64_t>(fs.f_type));
  struct statvfs vfs {};
  if (statvfs(dir.c_str(), &vfs) == 0) {
    probe.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    probe.total_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  }
  std::string tmpl = dir + "/.strata-probe-XXXXXX";
  int fd = mkostemp(tmpl.data(), O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("create a probe file in {} (is it writable?)", dir));
  const std::string path = tmpl;
  const size_t kBlock = 8192;
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, 2 * kBlock) != 0) {
    ::close(fd);
    ::unlink(path.c_str());
    return OutOfMemory("probe buffer");
  }
  std::memset(mem, 0x5a, 2 * kBlock);
  DirectProbe direct = probe_direct(fd, path, O_RDWR);
  if (direct.fd >= 0) {
    uint32_t offset_align = 0, memory_align = 0;
    if (!query_dio_align(direct.fd, &offset_align, &memory_align)) offset_align = memory_align = 0;
    ssize_t w = pwrite(direct.fd, mem, kBlock, 0);
    if (w != static_cast<ssize_t>(kBlock)) {
      probe.direct_detail = fmt::format("O_DIRECT write of {} bytes failed: {}", kBlock,
                                        w < 0 ? std::strerror(errno) : "short write");
    } else {
      probe.direct_io = true;
      if (offset_align == 0) {
        // The kernel did not say: try 512-byte units at a 512-aligned address.
        char* at512 = static_cast<char*>(mem) + kBlock + 512;
        bool small_ok = pread(direct.fd, at512, 512, 512) == 512;
        offset_align = memory_align = small_ok ? 512 : 4096;
      }
      probe.direct_alignment = offset_align;
      probe.memory_alignment = memory_align;
    }
    ::close(direct.fd);
  } else {
    probe.direct_detail = direct.reason;
  }
  std::free(mem);
  ::close(fd);
  ::unlink(path.c_str());
  return probe;
}

}  // namespace strata::nvme
