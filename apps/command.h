#pragma once
// Subcommand registry of the strata CLI. Each apps/cmd_*.cpp registers its
// subcommands with a file-scope CommandRegistration, so commands live in
// their own files and main.cpp never changes when one is added.
//
//   static strata::cli::CommandRegistration reg("estimate", [](CLI::App& root) {
//     auto* cmd = root.add_subcommand("estimate", "...");
//     cmd->callback([opts] { strata::cli::exit_with(run_estimate(*opts)); });
//   });

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace strata::cli {

using CommandSetup = std::function<void(CLI::App& root)>;

struct CommandRegistration {
  CommandRegistration(std::string name, CommandSetup setup);
};

// Returns the subcommand `name` of `parent`, creating it when absent
// (for command groups such as `bench` or `config` shared by several files).
CLI::App* ensure_subcommand(CLI::App& parent, const std::string& name, const std::string& description);

// Ends the current command with `code` (0 is success) through CLI11.
void exit_with(int code);

// Now, UTC, ISO 8601 to the second ("2026-11-30T17:47:35Z"): the date stamped
// into the JSON a command writes (bench results, calibrated profiles).
std::string utc_timestamp();

// `strata report` sections. Each layer contributes one; `fill` writes the
// section's facts into a JSON object. Sections print in `order`.
using ReportFill = std::function<void(nlohmann::json& section, const std::string& path)>;
struct ReportSectionRegistration {
  ReportSectionRegistration(int order, std::string name, ReportFill fill);
};

struct ReportSection {
  int order;
  std::string name;
  ReportFill fill;
};
std::vector<ReportSection>& report_sections();
std::vector<std::pair<std::string, CommandSetup>>& registered_commands();

}  // namespace strata::cli
