// Checks of the folders strata train writes to: see train_paths.h.
#include "train_paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"
#include "strata/core/printable.h"

namespace strata::cli {

// Note [--save-dir up front]
// The first save is steps away; a folder it cannot use must fail now, not
// after the work (a missing parent, a regular file, a FIFO, a link, no write
// permission). The rules are the save's own (checkpoint_io.cpp: a link is
// refused, a missing folder is created with one create_directory): the
// folder may be missing, its parent must exist. Unlike DeepSpeed's
// save_checkpoint (os.makedirs of the whole path) no tree is created, since
// a typo in a parent would then plant folders outside the folder the user
// meant. Nothing is created or deleted here.
Status check_save_dir(const std::string& dir) {
  if (dir.empty()) return InvalidArgument("--save-dir is empty; give the folder to save checkpoints in");
  const std::string shown = printable(dir, 256);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) == 0) {
    if (S_ISLNK(st.st_mode))
      return InvalidArgument(fmt::format("--save-dir '{}' is a symbolic link; give the real folder (a save never "
                                         "follows a link)",
                                         shown));
    if (!S_ISDIR(st.st_mode))
      return InvalidArgument(fmt::format("--save-dir '{}' is {}, not a folder; give a folder (a missing one is "
                                         "created inside its existing parent)",
                                         shown, file_type_name(st.st_mode)));
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      const int err = errno;
      return ErrnoStatus(err, fmt::format("--save-dir '{}': checkpoints cannot be written in this folder", shown));
    }
    return Status::Ok();
  }
  if (const int err = errno; err != ENOENT) return ErrnoStatus(err, fmt::format("--save-dir '{}'", shown));
  std::string trimmed = dir;  // "a/ck/" names the folder "a/ck", whose parent is "a"
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  std::filesystem::path parent = std::filesystem::path(trimmed).parent_path();
  if (parent.empty()) parent = ".";
  const std::string parent_shown = printable(parent.string(), 256);
  struct stat ps {};
  if (::stat(parent.c_str(), &ps) != 0)
    return InvalidArgument(fmt::format("--save-dir '{}': its parent folder '{}' does not exist; create it first (the "
                                       "first save creates only the last folder of the path)",
                                       shown, parent_shown));
  if (!S_ISDIR(ps.st_mode))
    return InvalidArgument(fmt::format("--save-dir '{}': its parent '{}' is {}, not a folder; give a folder inside "
                                       "an existing one",
                                       shown, parent_shown, file_type_name(ps.st_mode)));
  if (::access(parent.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    return ErrnoStatus(err, fmt::format("--save-dir '{}' does not exist and cannot be created in '{}'", shown,
                                        parent_shown));
  }
  return Status::Ok();
}

Status check_swap_folder(const std::string& path, const std::string& named) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return ErrnoStatus(err, fmt::format("{}: the folder for the swap files cannot be used; give an existing folder "
                                        "on the NVMe drive",
                                        named));
  }
  if (!S_ISDIR(st.st_mode))
    return InvalidArgument(
        fmt::format("{} is {}, not a folder; give a folder on the NVMe drive", named, file_type_name(st.st_mode)));
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    return ErrnoStatus(err, fmt::format("{}: no swap folder can be created in it", named));
  }
  return Status::Ok();
}

}  // namespace strata::cli
