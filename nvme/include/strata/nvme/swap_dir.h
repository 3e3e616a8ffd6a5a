#pragma once
// Swap folders on an nvme_path: `<nvme_path>/strata-<job>/rank<R>/` holds a
// rank's swap file and a `lock` file. A live job holds an exclusive flock on
// the lock file, so a second job (or a second store in the same process)
// cannot use the folder, and a folder whose lock nobody holds belongs to a
// dead job. The lock file records pid, host, start time and a state:
// `open` while in use (a dead job leaves it: stale) or `kept` when the job
// closed cleanly and asked to keep its swap files for a later reopen.

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
};

// `<nvme_path>/strata-<job>/rank<rank>`
std::string swap_folder_path(const std::string& nvme_path, const std::string& job, int rank);
// Checks a job name: 1-64 characters of [A-Za-z0-9._-].
Status validate_job_name(const std::string& job);

// Every rank folder of every job under `nvme_path`.
Result<std::vector<SwapFolder>> list_swap_folders(const std::string& nvme_path);

struct CleanOptions {
  std::string job;            // empty: every job
  bool include_kept = false;  // also remove folders kept for reopen
  bool dry_run = false;
};
// Removes stale (and, if asked, kept) rank folders, and job folders left
// empty. Never touches active folders. Returns the folders removed (or that
// would be, for a dry run).
Result<std::vector<SwapFolder>> clean_swap_folders(const std::string& nvme_path, const CleanOptions& options);

// RAII exclusive lock on a rank folder (internal to the swap store, public
// for tests and tools).
class SwapFolderLock {
 public:
  // Creates the folder (0700) if needed and takes the lock. Fails with
  // FailedPrecondition naming the owner when another process holds it.
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
