#pragma once
// The folders `strata train` writes to, checked before anything is built so
// that a folder it cannot use fails at start-up, not at the first save or
// the first swap file (Note [--save-dir up front], train_paths.cpp). The
// checks create and delete nothing; every error names the flag or key (the
// value escaped) and says what to give instead.
#include <string>

#include "strata/core/status.h"

namespace strata::cli {

// --save-dir DIR: a folder that is writable, or missing inside an existing,
// writable parent (the first save creates it); not a link, a regular file, a
// FIFO or another special file; not empty.
Status check_save_dir(const std::string& dir);

// The folder the engine makes its NVMe swap folders in (DIR/strata-train-
// <pid>/rank<r>): an existing, writable folder. `named` says where the path
// came from, already escaped ("--nvme-path '/mnt/nvme'", or the config key).
Status check_swap_folder(const std::string& path, const std::string& named);

}  // namespace strata::cli
