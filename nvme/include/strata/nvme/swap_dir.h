#pragma once
// Swap folders on an nvme_path: `<nvme_path>/strata-<job>/rank<R>/` holds a
// rank's swap file and a `lock` file. A live job holds an exclusive flock on
// the lock file, so a second job (or a second store in the same process)
// cannot use the folder, and a folder whose lock nobody holds belongs to a
// dead job. The lock file records pid, host, start time and a state:
// `open` while in use (a dead job leaves it: stale) or `kept` when the job
// closed cleanly and asked to keep its swap files for a later reopen.
//
// Note [No links in swap folders]
// An nvme_path may be shared, so its `strata-*` entries are hostile input:
// a symbolic link there must never lead list, clean or a store outside the
// folder it was given. Job and rank folders are opened with O_NOFOLLOW and
// checked by device and inode between listing and removal; removal works
// below the opened folder (unlinkat), so it never follows a link either.
// The lock file is opened O_NONBLOCK | O_NOFOLLOW, must be a regular file
// and is read up to kMaxLockFileBytes, so a FIFO or a link to /dev/zero can
// neither block nor exhaust memory.

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::nvme {

enum class SwapFolderState : uint8_t {
  kActive,  // lock held by a live process
  kStale,   // left by a job that died (state open, lock free)
  kKept,    // closed cleanly with its files kept for reopen
};
std::string_view swap_folder_state_name(SwapFolderState state);

struct SwapFolder {
  std::string path;      // the rank folder
  std::string job;
  int rank = -1;
  SwapFolderState state = SwapFolderState::kStale;
  int pid = 0;           // last owner
  std::string host;
  int64_t started_unix = 0;
  uint64_t bytes = 0;    // allocated on disk by the folder's files
  // Identity of the job and rank folders when listed (clean removes only
  // the same folders).
  uint64_t job_dev = 0, job_ino = 0, rank_dev = 0, rank_ino = 0;
};

// Lock files hold a few short lines; longer ones are read only this far.
inline constexpr size_t kMaxLockFileBytes = 4096;

// `<nvme_path>/strata-<job>/rank<rank>`
std::string swap_folder_path(const std::string& nvme_path, const std::string& job, int rank);
// Checks a job name: 1-64 characters of [A-Za-z0-9._-].
Status validate_job_name(const std::string& job);

// Every rank folder of every job under `nvme_path`. Entries that are not
// followed (a `strata-*` or `rank*` entry that is a symbolic link or not a
// directory, a lock that is not a regular file) are described in `refused`
// when given; a folder whose lock is not a regular file is listed as stale.
Result<std::vector<SwapFolder>> list_swap_folders(const std::string& nvme_path,
                                                  std::vector<std::string>* refused = nullptr);

struct CleanOptions {
  std::string job;            // empty: every job
  bool include_kept = false;  // also remove folders kept for reopen
  bool dry_run = false;
};
// Removes stale (and, if asked, kept) rank folders, and job folders left
// empty. Never touches active folders. Returns the folders removed (or that
// would be, for a dry run). Never follows a symbolic link and never removes
// anything outside `nvme_path`; what it refused to touch is described in
// `refused` when given.
Result<std::vector<SwapFolder>> clean_swap_folders(const std::string& nvme_path, const CleanOptions& options,
                                                   std::vector<std::string>* refused = nullptr);

// RAII exclusive lock on a rank folder (internal to the swap store, public
// for tests and tools).
class SwapFolderLock {
 public:
  // Creates the folder (0700) if needed and takes the lock. Fails with
  // FailedPrecondition naming the owner when another process holds it, and
  // when the job or rank folder or the lock is a symbolic link or not of
  // the expected type (see Note [No links in swap folders]).
  static Result<SwapFolderLock> acquire(const std::string& folder, const std::string& job, int rank);
  SwapFolderLock() = default;
  SwapFolderLock(SwapFolderLock&& other) noexcept;
  SwapFolderLock& operator=(SwapFolderLock&& other) noexcept;
  SwapFolderLock(const SwapFolderLock&) = delete;
  SwapFolderLock& operator=(const SwapFolderLock&) = delete;
  ~SwapFolderLock();

  // What the previous owner left: kStale / kKept, or kActive for a new folder.
  SwapFolderState previous_state() const { return previous_state_; }
  bool existed() const { return existed_; }
  // Rewrites the state recorded in the lock file.
  Status set_state(SwapFolderState state);
  // Releases the lock and removes the lock file (the folder stays).
  void release_and_remove();
  const std::string& folder() const { return folder_; }

 private:
  void release();
  int fd_ = -1;
  std::string folder_;
  std::string job_;
  int rank_ = 0;
  int64_t started_unix_ = 0;
  SwapFolderState previous_state_ = SwapFolderState::kActive;
  bool existed_ = false;
};

}  // namespace strata::nvme
