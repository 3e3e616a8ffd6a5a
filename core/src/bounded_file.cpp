#include "strata/core/bounded_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <fmt/format.h>

#include "strata/core/printable.h"

namespace strata {
std::string_view file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a special file";
}

Status check_path_text(std::string_view path, std::string_view what) {
  const size_t nul = path.find('\0');
  if (nul == std::string_view::npos) return Status::Ok();
  return InvalidArgument(fmt::format("{} '{}' holds a NUL byte at offset {}; a path cannot contain one (the system "
                                     "would open the name up to it)",
                                     what, printable(path, 256), nul));
}

Result<std::string> read_regular_file(const std::string& path, uint64_t max_bytes, const FileDescription& file) {
  const std::string name = fmt::format("{} '{}'{}", file.what, printable(path, 256),
                                       file.flag.empty() ? "" : fmt::format(" ({})", file.flag));
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", name));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", name));
  if (!S_ISREG(st.st_mode))
    return InvalidArgument(fmt::format("{} is not a regular file ({}); {}", name, file_type_name(st.st_mode), file.hint));
  const auto too_large = [&] {
    return InvalidArgument(fmt::format("{} is larger than {} bytes; {}", name, max_bytes, file.hint));
  };
  if (static_cast<uint64_t>(st.st_size) > max_bytes) return too_large();
  std::string text;
  text.resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  for (;;) {
    if (done == text.size()) {
      if (done > max_bytes) return too_large();
      text.resize(done + 65536);  // the file may have grown since fstat: keep reading, bounded
    }
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, fmt::format("read {} at offset {}", name, done));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done > max_bytes) return too_large();
  text.resize(done);
  return text;
}

}  // namespace strata
