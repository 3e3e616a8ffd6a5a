// Swap folders: locking, stale detection and cleaning. See swap_dir.h.
#include "strata/nvme/swap_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <tuple>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"
#include "strata/core/printable.h"

namespace strata::nvme {
namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = "lock";
constexpr const char* kJobPrefix = "strata-";

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

std::map<std::string, std::string> parse_lock_text(const std::string& text) {
  std::map<std::string, std::string> kv;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    size_t eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    pos = end + 1;
  }
  return kv;
}

// Reads at most kMaxLockFileBytes: see Note [No links in swap folders].
std::string read_fd_text(int fd) {
  std::string text;
  char buf[512];
  off_t offset = 0;
  while (text.size() < kMaxLockFileBytes) {
    size_t want = std::min(sizeof(buf), kMaxLockFileBytes - text.size());
    ssize_t n = pread(fd, buf, want, offset);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  return text;
}

std::string link_target(const std::string& path) {
  std::error_code ec;
  fs::path target = fs::read_symlink(path, ec);
  return ec ? std::string("?") : printable(target.string(), 256);
}

// Why `path` (an entry that must be a real directory) is refused, or "".
std::string not_a_plain_directory(const std::string& path, const struct stat& st) {
  if (S_ISLNK(st.st_mode)) {
    return fmt::format("{} is a symbolic link (to {}): not followed; swap folders are never links, remove the link "
                       "yourself if it is not needed",
                       printable(path), link_target(path));
  }
  if (!S_ISDIR(st.st_mode)) {
    return fmt::format("{} is {}, not a swap folder: skipped", printable(path), file_type_name(st.st_mode));
  }
  return "";
}

// Opens the lock file without following a link and without blocking on a
// FIFO; -1 with `why` set when it is missing (why empty) or refused.
int open_lock(int dir_fd, const std::string& lock_path, int flags, std::string* why) {
  int fd = ::openat(dir_fd, kLockName, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    struct stat st {};
    if (err != ENOENT && ::fstatat(dir_fd, kLockName, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      *why = fmt::format("{} is {}, not a lock file: not read", printable(lock_path), file_type_name(st.st_mode));
    } else if (err != ENOENT) {
      *why = fmt::format("{}: {}", printable(lock_path), std::strerror(err));
    }
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = fmt::format("{} is {}, not a lock file: not read", printable(lock_path), file_type_name(st.st_mode));
    ::close(fd);
    return -1;
  }
  // Back to blocking mode for flock semantics; the file is regular, so reads never block.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

Status mkdir_one(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, fmt::format("create swap folder {} (is the nvme_path writable?)", path));
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat swap folder {}", path));
  std::string why = not_a_plain_directory(path, st);
  if (!why.empty()) return FailedPrecondition(why);
  return Status::Ok();
}

uint64_t allocated_bytes(int dir_fd) {
  uint64_t total = 0;
  int fd = ::dup(dir_fd);
  if (fd < 0) return 0;
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return 0;
  }
  while (struct dirent* ent = ::readdir(dir)) {
    struct stat st {};
    if (::fstatat(dir_fd, ent->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
      total += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  ::closedir(dir);
  return total;
}

// Reads one rank folder's lock without disturbing a live owner.
SwapFolder inspect(int rank_fd, const std::string& folder, const std::string& job, int rank,
                   std::vector<std::string>* refused) {
  SwapFolder info;
  info.path = folder;
  info.job = job;
  info.rank = rank;
  info.bytes = allocated_bytes(rank_fd);
  std::string why;
  int fd = open_lock(rank_fd, folder + "/" + kLockName, O_RDONLY, &why);
  if (fd < 0) {
    // No lock file (or one that is not a file): nobody can be using the folder.
    info.state = SwapFolderState::kStale;
    if (!why.empty() && refused != nullptr) refused->push_back(why + "; the folder counts as stale");
    return info;
  }
  auto kv = parse_lock_text(read_fd_text(fd));
  info.pid = kv.count("pid") ? std::atoi(kv["pid"].c_str()) : 0;
  info.host = kv.count("host") ? kv["host"] : "";
  info.started_unix = kv.count("started") ? std::atoll(kv["started"].c_str()) : 0;
  if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
    info.state = SwapFolderState::kActive;
  } else {
    info.state = kv["state"] == "kept" ? SwapFolderState::kKept : SwapFolderState::kStale;
    flock(fd, LOCK_UN);
  }
  ::close(fd);
  return info;
}

// A directory opened below `parent_fd` without following a link; -1 with
// errno set (ELOOP / ENOTDIR for a link or a non-directory).
int open_dir_at(int parent_fd, const std::string& name) {
  return ::openat(parent_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

bool same_inode(int fd, uint64_t dev, uint64_t ino) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev && static_cast<uint64_t>(st.st_ino) == ino;
}

// Removes everything below the open directory `dir_fd` with unlinkat, never
// following a link (a link is removed, not its target), and never crossing
// into another file system.
Status remove_contents_at(int dir_fd, const std::string& where, dev_t dev, int depth) {
  if (depth > 64) return FailedPrecondition(fmt::format("{}: nested more than 64 folders deep; not removed", where));
  int fd = ::dup(dir_fd);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", where));
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(err, fmt::format("list {}", where));
  }
  std::vector<std::string> names;
  while (struct dirent* ent = ::readdir(dir)) {
    std::string name = ent->d_name;
    if (name != "." && name != "..") names.push_back(std::move(name));
  }
  ::closedir(dir);
  for (const std::string& name : names) {
    std::string path = where + "/" + name;
    struct stat st {};
    if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      if (st.st_dev != dev) return FailedPrecondition(fmt::format("{} is a mount point: not removed", path));
      int sub = open_dir_at(dir_fd, name);
      if (sub < 0) return ErrnoStatus(errno, fmt::format("open {} (not following links)", path));
      Status st_sub = remove_contents_at(sub, path, dev, depth + 1);
      ::close(sub);
      STRATA_RETURN_IF_ERROR(st_sub);
      if (::unlinkat(dir_fd, name.c_str(), AT_REMOVEDIR) != 0) return ErrnoStatus(errno, fmt::format("remove {}", path));
    } else if (::unlinkat(dir_fd, name.c_str(), 0) != 0) {
      return ErrnoStatus(errno, fmt::format("remove {}", path));
    }
  }
  return Status::Ok();
}

// RAII close of a descriptor.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string_view swap_folder_state_name(SwapFolderState state) {
  switch (state) {
    case SwapFolderState::kActive: return "active";
    case SwapFolderState::kStale: return "stale";
    case SwapFolderState::kKept: return "kept";
  }
  return "unknown";
}

std::string swap_folder_path(const std::string& nvme_path, const std::string& job, int rank) {
  return fmt::format("{}/{}{}/rank{}", nvme_path, kJobPrefix, job, rank);
}

Status validate_job_name(const std::string& job) {
  bool ok = !job.empty() && job.size() <= 64;
  for (char c : job) {
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
  }
  if (!ok || job == "." || job == "..") {
    return InvalidArgument(fmt::format("job name '{}': use 1-64 characters of A-Z a-z 0-9 . _ -", job));
  }
  return Status::Ok();
}

Result<std::vector<SwapFolder>> list_swap_folders(const std::string& nvme_path, std::vector<std::string>* refused) {
  Fd root(::open(nvme_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.fd < 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFound(fmt::format("nvme_path {} is not a directory", nvme_path));
    return ErrnoStatus(err, fmt::format("open nvme_path {}", nvme_path));
  }
  std::vector<std::string> job_names;
  {
    int fd = ::dup(root.fd);
    DIR* dir = fd >= 0 ? ::fdopendir(fd) : nullptr;
    if (dir == nullptr) {
      int err = errno;
      if (fd >= 0) ::close(fd);
      return ErrnoStatus(err, fmt::format("list {}", nvme_path));
    }
    while (struct dirent* ent = ::readdir(dir)) {
      std::string name = ent->d_name;
      if (name.rfind(kJobPrefix, 0) == 0) job_names.push_back(std::move(name));
    }
    ::closedir(dir);
  }
  std::vector<SwapFolder> folders;
  auto refuse = [&](std::string why) {
    if (refused != nullptr) refused->push_back(std::move(why));
  };
  for (const std::string& name : job_names) {
    std::string job_path = nvme_path + "/" + name;
    struct stat jst {};
    if (::fstatat(root.fd, name.c_str(), &jst, AT_SYMLINK_NOFOLLOW) != 0) continue;
    std::string why = not_a_plain_directory(job_path, jst);
    if (!why.empty()) {
      refuse(why);
      continue;
    }
    Fd job_fd(open_dir_at(root.fd, name));
    if (job_fd.fd < 0 || !same_inode(job_fd.fd, jst.st_dev, jst.st_ino)) {
      refuse(fmt::format("{} changed while listed (or cannot be opened): skipped", printable(job_path)));
      continue;
    }
    std::string job = name.substr(std::strlen(kJobPrefix));
    std::vector<std::string> rank_names;
    {
      int fd = ::dup(job_fd.fd);
      DIR* dir = fd >= 0 ? ::fdopendir(fd) : nullptr;
      if (dir == nullptr) {
        if (fd >= 0) ::close(fd);
        continue;
      }
      while (struct dirent* ent = ::readdir(dir)) {
        std::string rname = ent->d_name;
        if (rname.rfind("rank", 0) == 0) rank_names.push_back(std::move(rname));
      }
      ::closedir(dir);
    }
    for (const std::string& rname : rank_names) {
      std::string rank_path = job_path + "/" + rname;
      struct stat rst {};
      if (::fstatat(job_fd.fd, rname.c_str(), &rst, AT_SYMLINK_NOFOLLOW) != 0) continue;
      std::string rwhy = not_a_plain_directory(rank_path, rst);
      if (!rwhy.empty()) {
        refuse(rwhy);
        continue;
      }
      Fd rank_fd(open_dir_at(job_fd.fd, rname));
      if (rank_fd.fd < 0 || !same_inode(rank_fd.fd, rst.st_dev, rst.st_ino)) {
        refuse(fmt::format("{} changed while listed (or cannot be opened): skipped", printable(rank_path)));
        continue;
      }
      SwapFolder f = inspect(rank_fd.fd, rank_path, job, std::atoi(rname.c_str() + 4), refused);
      f.job_dev = jst.st_dev;
      f.job_ino = jst.st_ino;
      f.rank_dev = rst.st_dev;
      f.rank_ino = rst.st_ino;
      folders.push_back(std::move(f));
    }
  }
  std::sort(folders.begin(), folders.end(), [](const SwapFolder& a, const SwapFolder& b) {
    return std::tie(a.job, a.rank, a.path) < std::tie(b.job, b.rank, b.path);
  });
  return folders;
}

Result<std::vector<SwapFolder>> clean_swap_folders(const std::string& nvme_path, const CleanOptions& options,
                                                   std::vector<std::string>* refused) {
  STRATA_ASSIGN_OR_RETURN(std::vector<SwapFolder> folders, list_swap_folders(nvme_path, refused));
  auto refuse = [&](std::string why) {
    if (refused != nullptr) refused->push_back(std::move(why));
  };
  std::vector<SwapFolder> removed;
  Fd root(::open(nvme_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (root.fd < 0) return ErrnoStatus(errno, fmt::format("open nvme_path {}", nvme_path));
  for (const SwapFolder& f : folders) {
    if (!options.job.empty() && f.job != options.job) continue;
    if (f.state == SwapFolderState::kActive) continue;
    if (f.state == SwapFolderState::kKept && !options.include_kept) continue;
    if (!options.dry_run) {
      // Reopen both folders below the nvme_path without following links and
      // check they are the ones listed (see Note [No links in swap folders]).
      const std::string job_name = std::string(kJobPrefix) + f.job;
      const std::string rank_name = fs::path(f.path).filename().string();
      Fd job_fd(open_dir_at(root.fd, job_name));
      if (job_fd.fd < 0 || !same_inode(job_fd.fd, f.job_dev, f.job_ino)) {
        refuse(fmt::format("{}/{} was replaced (by a link?) after it was listed: not followed, nothing removed",
                           printable(nvme_path), printable(job_name)));
        continue;
      }
      Fd rank_fd(open_dir_at(job_fd.fd, rank_name));
      if (rank_fd.fd < 0 || !same_inode(rank_fd.fd, f.rank_dev, f.rank_ino)) {
        refuse(fmt::format("{} was replaced (by a link?) after it was listed: not followed, nothing removed",
                           printable(f.path)));
        continue;
      }
      // Take the lock while removing so a job starting now cannot race us.
      std::string why;
      Fd lock_fd(open_lock(rank_fd.fd, f.path + "/" + kLockName, O_RDWR, &why));
      if (lock_fd.fd >= 0 && flock(lock_fd.fd, LOCK_EX | LOCK_NB) != 0) continue;  // became active meanwhile
      STRATA_RETURN_IF_ERROR(remove_contents_at(rank_fd.fd, f.path, static_cast<dev_t>(f.rank_dev), 0)
                                 .with_context("remove stale swap folder"));
      if (::unlinkat(job_fd.fd, rank_name.c_str(), AT_REMOVEDIR) != 0) {
        return ErrnoStatus(errno, fmt::format("remove stale swap folder {}", f.path));
      }
      // The job folder goes when it is left empty (ENOTEMPTY otherwise: kept).
      ::unlinkat(root.fd, job_name.c_str(), AT_REMOVEDIR);
    }
    removed.push_back(f);
  }
  return removed;
}

// ---------------------------------------------------------------------------

Result<SwapFolderLock> SwapFolderLock::acquire(const std::string& folder, const std::string& job, int rank) {
  fs::path rank_dir(folder);
  STRATA_RETURN_IF_ERROR(mkdir_one(rank_dir.parent_path().string()));
  struct stat existing {};
  bool existed = ::lstat(folder.c_str(), &existing) == 0;
  STRATA_RETURN_IF_ERROR(mkdir_one(folder));
  std::string lock_path = folder + "/" + kLockName;
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    struct stat st {};
    if (::lstat(lock_path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      return FailedPrecondition(fmt::format("{} is {}, not a lock file; remove it (swap folders hold only Strata's "
                                            "files)",
                                            lock_path, file_type_name(st.st_mode)));
    }
    return ErrnoStatus(err, fmt::format("open swap lock file {}", lock_path));
  }
  {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return FailedPrecondition(fmt::format("{} is {}, not a lock file; remove it", lock_path,
                                            file_type_name(st.st_mode)));
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    auto kv = parse_lock_text(read_fd_text(fd));
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return FailedPrecondition(fmt::format(
          "swap folder {} is in use by pid {} on {} (job '{}'); two jobs cannot share a swap folder: "
          "pick another job name or nvme_path, or stop that process",
          folder, kv["pid"], kv["host"], job));
    }
    return ErrnoStatus(err, fmt::format("lock {}", lock_path));
  }
  SwapFolderLock lock;
  auto kv = parse_lock_text(read_fd_text(fd));
  lock.existed_ = existed;
  lock.previous_state_ = !existed || kv.empty()       ? SwapFolderState::kActive
                         : kv["state"] == "kept"      ? SwapFolderState::kKept
                                                      : SwapFolderState::kStale;
  lock.fd_ = fd;
  lock.folder_ = folder;
  lock.job_ = job;
  lock.rank_ = rank;
  lock.started_unix_ = static_cast<int64_t>(std::time(nullptr));
  STRATA_RETURN_IF_ERROR(lock.set_state(SwapFolderState::kActive));
  return lock;
}

Status SwapFolderLock::set_state(SwapFolderState state) {
  STRATA_CHECK(fd_ >= 0, "SwapFolderLock::set_state on a released lock");
  std::string text = fmt::format("pid={}\nhost={}\njob={}\nrank={}\nstarted={}\nstate={}\n", getpid(), hostname(),
                                 job_, rank_, started_unix_, state == SwapFolderState::kKept ? "kept" : "open");
  if (ftruncate(fd_, 0) != 0) return ErrnoStatus(errno, fmt::format("truncate lock file in {}", folder_));
  if (pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    return ErrnoStatus(errno, fmt::format("write lock file in {}", folder_));
  }
  return Status::Ok();
}

void SwapFolderLock::release_and_remove() {
  if (fd_ < 0) return;
  std::string lock_path = folder_ + "/" + kLockName;
  ::unlink(lock_path.c_str());
  release();
}

SwapFolderLock::SwapFolderLock(SwapFolderLock&& other) noexcept { *this = std::move(other); }

SwapFolderLock& SwapFolderLock::operator=(SwapFolderLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    folder_ = std::move(other.folder_);
    job_ = std::move(other.job_);
    rank_ = other.rank_;
    started_unix_ = other.started_unix_;
    previous_state_ = other.previous_state_;
    existed_ = other.existed_;
  }
  return *this;
}

SwapFolderLock::~SwapFolderLock() { release(); }

void SwapFolderLock::release() {
  if (fd_ >= 0) {
    flock(fd_, LOCK_UN);
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace strata::nvme
