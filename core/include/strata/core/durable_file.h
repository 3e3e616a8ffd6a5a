#pragma once
// Making small files and renames durable: what a crash-safe writer (a
// checkpoint's manifest and `latest`, an exported model) needs after its
// data is written.
#include <filesystem>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata {

// fsync of a folder, so the renames and creations in it survive a crash
// (it only opens the folder to fsync it). Errors name the folder.
Status fsync_folder(const std::filesystem::path& folder);

// Writes `data` to `folder/name` through `name.tmp` (created or truncated,
// never through a link), fsyncs it, renames it over `name` and fsyncs the
// folder: a crash leaves either the old file or the new one.
Status write_file_atomically(const std::filesystem::path& folder, const std::string& name, std::string_view data);

}  // namespace strata
