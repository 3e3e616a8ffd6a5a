// strata swap list|clean: swap folders left on an nvme_path.
//
//   strata swap list  --path NVME_PATH [--json]
//   strata swap clean --path NVME_PATH [--job NAME] [--include-kept] [--dry-run]
//
// `list` shows every <nvme_path>/strata-<job>/rank<R> folder as active (a
// live job holds its lock), stale (its job died) or kept (closed cleanly
// with keep_files). `clean` removes stale folders (and kept ones with
// --include-kept); it never touches an active one, never follows a symbolic
// link and never removes anything outside --path (what it refused is printed
// on stderr; see Note [No links in swap folders] in nvme/swap_dir.h).
#include <ctime>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"
#include "strata/nvme/swap_dir.h"

namespace strata::cli {
namespace {

struct SwapCliOptions {
  std::string path;
  std::string job;
  bool include_kept = false;
  bool dry_run = false;
  bool json = false;
};

std::string when(int64_t unix_seconds) {
  if (unix_seconds <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::gmtime(&t));
  return buf;
}

void print_folders(const std::vector<nvme::SwapFolder>& folders) {
  fmt::print("{:<20} {:>5} {:<7} {:>8} {:<20} {:>12}  {}\n", "job", "rank", "state", "pid", "started (UTC)", "bytes",
             "folder");
  for (const nvme::SwapFolder& f : folders) {
    // Names come from the file system: escaped so none can forge a line.
    fmt::print("{:<20} {:>5} {:<7} {:>8} {:<20} {:>12}  {}\n", printable(f.job, 64), f.rank,
               nvme::swap_folder_state_name(f.state), f.pid, when(f.started_unix), format_bytes(f.bytes, true),
               printable(f.path));
  }
}

// Entries list/clean did not follow or touch (links, odd lock files).
void print_refused(const std::vector<std::string>& refused) {
  for (const std::string& why : refused) fmt::print(stderr, "strata swap: refused: {}\n", why);
}

int run_list(const SwapCliOptions& opts) {
  std::vector<std::string> refused;
  auto folders = nvme::list_swap_folders(opts.path, &refused);
  print_refused(refused);
  if (!folders.ok()) {
    fmt::print(stderr, "strata swap list: {}\n", printable_message(folders.status().to_string()));
    return 1;
  }
  if (opts.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const nvme::SwapFolder& f : *folders) {
      out.push_back({{"job", f.job}, {"rank", f.rank}, {"state", std::string(nvme::swap_folder_state_name(f.state))},
                     {"pid", f.pid}, {"host", f.host}, {"started_unix", f.started_unix}, {"bytes", f.bytes},
                     {"path", f.path}});
    }
    // Folder names need not be UTF-8: replace what JSON cannot carry.
    fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
    return 0;
  }
  if (folders->empty()) {
    fmt::print("no Strata swap folders under {}\n", opts.path);
    return 0;
  }
  print_folders(*folders);
  size_t stale = 0;
  for (const auto& f : *folders) stale += f.state == nvme::SwapFolderState::kStale;
  if (stale > 0) fmt::print("\n{} stale folder(s): remove with `strata swap clean --path {}`\n", stale, opts.path);
  return 0;
}

int run_clean(const SwapCliOptions& opts) {
  if (!opts.job.empty()) {
    Status st = nvme::validate_job_name(opts.job);
    if (!st.ok()) {
      fmt::print(stderr, "strata swap clean: --job: {}\n", printable_message(st.message()));
      return 1;
    }
  }
  nvme::CleanOptions co{opts.job, opts.include_kept, opts.dry_run};
  std::vector<std::string> refused;
  auto removed = nvme::clean_swap_folders(opts.path, co, &refused);
  print_refused(refused);
  if (!removed.ok()) {
    fmt::print(stderr, "strata swap clean: {}\n", printable_message(removed.status().to_string()));
    return 1;
  }
  uint64_t bytes = 0;
  for (const auto& f : *removed) {
    fmt::print("{} {} ({}, job {}, rank {}, {})\n", opts.dry_run ? "would remove" : "removed", printable(f.path),
               nvme::swap_folder_state_name(f.state), printable(f.job, 64), f.rank, format_bytes(f.bytes, true));
    bytes += f.bytes;
  }
  fmt::print("{} folder(s), {} {}\n", removed->size(), format_bytes(bytes, true),
             opts.dry_run ? "would be freed" : "freed");
  return 0;
}

CommandRegistration swap_command("swap", [](CLI::App& root) {
  CLI::App* swap = ensure_subcommand(root, "swap", "Swap folders on NVMe paths: list and clean up after dead jobs");
  swap->require_subcommand(1);
  {
    auto opts = std::make_shared<SwapCliOptions>();
    CLI::App* cmd = swap->add_subcommand("list", "List swap folders (active, stale, kept) under an nvme_path");
    cmd->add_option("--path", opts->path, "The nvme_path")->required();
    cmd->add_flag("--json", opts->json, "Print JSON");
    cmd->callback([opts] { exit_with(run_list(*opts)); });
  }
  {
    auto opts = std::make_shared<SwapCliOptions>();
    CLI::App* cmd = swap->add_subcommand("clean", "Remove stale swap folders of dead jobs (never active ones)");
    cmd->add_option("--path", opts->path, "The nvme_path")->required();
    cmd->add_option("--job", opts->job, "Only this job's folders");
    cmd->add_flag("--include-kept", opts->include_kept, "Also remove folders kept for reopen (keep_files)");
    cmd->add_flag("--dry-run", opts->dry_run, "Only print what would be removed");
    cmd->callback([opts] { exit_with(run_clean(*opts)); });
  }
});

}  // namespace
}  // namespace strata::cli
