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

std::string read_fd_text(int fd) {
  std::string text;
  char buf[512];
  off_t offset = 0;
  while (true) {
    ssize_t n = pread(fd, buf, sizeof(buf), offset);
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
    offset += n;
  }
  return text;
}

Status mkdir_one(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, fmt::format("create swap folder {} (is the nvme_path writable?)", path));
  }
  return Status::Ok();
}

uint64_t allocated_bytes(const std::string& folder) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// Reads one rank folder's lock without disturbing a live owner.
SwapFolder inspect(const std::string& folder, const std::string& job, int rank) {
  SwapFolder info;
  info.path = folder;
  info.job = job;
  info.rank = rank;
  info.bytes = allocated_bytes(folder);
  std::string lock_path = folder + "/" + kLockName;
  int fd = ::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    info.state = SwapFolderState::kStale;  // no lock file: nobody can be using it
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

Result<std::vector<SwapFolder>> list_swap_folders(const std::string& nvme_path) {
  std::error_code ec;
  if (!fs::is_directory(nvme_path, ec)) {
    return NotFound(fmt::format("nvme_path {} is not a directory", nvme_path));
  }
  std::vector<SwapFolder> folders;
  for (const auto& job_entry : fs::directory_iterator(nvme_path, ec)) {
    std::string name = job_entry.path().filename().string();
    if (name.rfind(kJobPrefix, 0) != 0 || !job_entry.is_directory()) continue;
    std::string job = name.substr(std::strlen(kJobPrefix));
    std::error_code ec2;
    for (const auto& rank_entry : fs::directory_iterator(job_entry.path(), ec2)) {
      std::string rank_name = rank_entry.path().filename().string();
      if (rank_name.rfind("rank", 0) != 0 || !rank_entry.is_directory()) continue;
      int rank = std::atoi(rank_name.c_str() + 4);
      folders.push_back(inspect(rank_entry.path().string(), job, rank));
    }
  }
  std::sort(folders.begin(), folders.end(), [](const SwapFolder& a, const SwapFolder& b) {
    return std::tie(a.job, a.rank) < std::tie(b.job, b.rank);
  });
  if (ec) return ErrnoStatus(ec.value(), fmt::format("list {}", nvme_path));
  return folders;
}

Result<std::vector<SwapFolder>> clean_swap_folders(const std::string& nvme_path, const CleanOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::vector<SwapFolder> folders, list_swap_folders(nvme_path));
  std::vector<SwapFolder> removed;
  for (const SwapFolder& f : folders) {
    if (!options.job.empty() && f.job != options.job) continue;
    if (f.state == SwapFolderState::kActive) continue;
    if (f.state == SwapFolderState::kKept && !options.include_kept) continue;
    if (!options.dry_run) {
      // Take the lock while removing so a job starting now cannot race us.
      std::string lock_path = f.path + "/" + kLockName;
      int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) {
        ::close(fd);
        continue;  // became active meanwhile
      }
      std::error_code ec;
      fs::remove_all(f.path, ec);
      if (fd >= 0) ::close(fd);
      if (ec) return ErrnoStatus(ec.value(), fmt::format("remove stale swap folder {}", f.path));
      std::error_code ec2;
      fs::path job_dir = fs::path(f.path).parent_path();
      if (fs::is_empty(job_dir, ec2)) fs::remove(job_dir, ec2);
    }
    removed.push_back(f);
  }
  return removed;
}

// ---------------------------------------------------------------------------

Result<SwapFolderLock> SwapFolderLock::acquire(const std::string& folder, const std::string& job, int rank) {
  fs::path rank_dir(folder);
  STRATA_RETURN_IF_ERROR(mkdir_one(rank_dir.parent_path().string()));
  std::error_code ec;
  bool existed = fs::exists(rank_dir, ec);
  STRATA_RETURN_IF_ERROR(mkdir_one(folder));
  std::string lock_path = folder + "/" + kLockName;
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open swap lock file {}", lock_path));
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
