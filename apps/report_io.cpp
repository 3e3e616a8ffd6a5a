// `strata report` section "io": which I/O engines work here (probed by
// creating a ring / context, not assumed from the build), what `auto`
// picks and why; with --path DIR also the directory's file system, O_DIRECT
// support, direct-I/O alignment and free space.
#include <string>

#include "command.h"
#include "strata/core/units.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/io_engine.h"
#include "strata/nvme/swap_dir.h"

#include <fmt/format.h>

namespace strata::cli {
namespace {

void fill_io(nlohmann::json& s, const std::string& path) {
  nlohmann::json engines = nlohmann::json::object();
  for (const nvme::EngineProbe& p : nvme::probe_engines()) {
    engines[std::string(nvme::engine_kind_name(p.kind))] =
        p.works ? "works (" + p.detail + ")" : (p.compiled ? "fails: " : "unavailable: ") + p.detail;
  }
  s["engines"] = engines;
  nvme::EngineChoice choice = nvme::choose_engine();
  s["auto"] = std::string(nvme::engine_kind_name(choice.kind));
  s["auto_reason"] = choice.reason;
  if (path.empty()) return;
  nlohmann::json p = nlohmann::json::object();
  auto probe = nvme::probe_path(path);
  if (!probe.ok()) {
    p["error"] = probe.status().to_string();
  } else {
    p["file_system"] = probe->fs_type;
    p["o_direct"] = probe->direct_io ? std::string("yes") : "no: " + probe->direct_detail + " (buffered fallback)";
    if (probe->direct_io) {
      p["direct_alignment_bytes"] = probe->direct_alignment;
      p["memory_alignment_bytes"] = probe->memory_alignment;
    }
    p["free"] = format_bytes(probe->free_bytes, true);
    p["free_bytes"] = probe->free_bytes;
    p["total"] = format_bytes(probe->total_bytes, true);
    std::vector<std::string> refused;  // links and odd lock files: never followed or read
    auto folders = nvme::list_swap_folders(path, &refused);
    if (!refused.empty()) p["swap_entries_not_followed"] = refused;
    if (folders.ok()) {
      size_t active = 0, stale = 0, kept = 0;
      for (const nvme::SwapFolder& f : *folders) {
        active += f.state == nvme::SwapFolderState::kActive;
        stale += f.state == nvme::SwapFolderState::kStale;
        kept += f.state == nvme::SwapFolderState::kKept;
      }
      p["swap_folders"] = fmt::format("{} active, {} stale, {} kept{}", active, stale, kept,
                                      stale > 0 ? fmt::format(" (clean: strata swap clean --path {})", path) : "");
    }
  }
  s["path " + path] = p;
}

ReportSectionRegistration io_section(40, "io", fill_io);

}  // namespace
}  // namespace strata::cli
