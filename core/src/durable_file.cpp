// Durable small files (durable_file.h).
#include "strata/core/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata {
namespace fs = std::filesystem;

Status fsync_folder(const fs::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open folder '{}' to fsync it", printable(folder.string(), 256)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, fmt::format("fsync folder '{}'", printable(folder.string(), 256)));
  return Status::Ok();
}

Status write_file_atomically(const fs::path& folder, const std::string& name, std::string_view data) {
  const fs::path tmp = folder / (name + ".tmp");
  const fs::path dst = folder / name;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("create '{}'", printable(tmp.string(), 256)));
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, fmt::format("write '{}'", printable(tmp.string(), 256)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, fmt::format("fsync '{}'", printable(tmp.string(), 256)));
  }
  ::close(fd);
  if (::rename(tmp.c_str(), dst.c_str()) != 0)
    return ErrnoStatus(errno, fmt::format("rename '{}' to '{}'", printable(tmp.string(), 256), name));
  return fsync_folder(folder);
}

}  // namespace strata
