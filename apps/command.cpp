#include "command.h"

#include <algorithm>
#include <ctime>

namespace strata::cli {

std::vector<std::pair<std::string, CommandSetup>>& registered_commands() {
  static std::vector<std::pair<std::string, CommandSetup>> commands;
  return commands;
}

std::vector<ReportSection>& report_sections() {
  static std::vector<ReportSection> sections;
  return sections;
}

CommandRegistration::CommandRegistration(std::string name, CommandSetup setup) {
  registered_commands().emplace_back(std::move(name), std::move(setup));
}

ReportSectionRegistration::ReportSectionRegistration(int order, std::string name, ReportFill fill) {
  report_sections().push_back({order, std::move(name), std::move(fill)});
}

CLI::App* ensure_subcommand(CLI::App& parent, const std::string& name, const std::string& description) {
  for (CLI::App* sub : parent.get_subcommands([](CLI::App*) { return true; })) {
    if (sub->get_name() == name) return sub;
  }
  CLI::App* sub = parent.add_subcommand(name, description);
  sub->require_subcommand(1);
  return sub;
}

void exit_with(int code) {
  if (code != 0) throw CLI::RuntimeError(code);
}

std::string utc_timestamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace strata::cli
