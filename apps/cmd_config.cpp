// strata config check|show|defaults: DeepSpeed JSON configs, checked strictly.
//
//   strata config check ds_config.json [--world-size 8] [--hidden-size 4096]
//   strata config show ds_config.json [--world-size 8]
//   strata config defaults [--markdown | --deepspeed-keys]
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/printable.h"
#include "strata/core/config.h"
#include "strata/core/config_schema.h"
#include "strata/core/deepspeed_keys.h"

namespace strata::cli {
namespace {

struct ConfigCommandOptions {
  std::string file;
  int64_t world_size = 1;
  int64_t hidden_size = 0;
  bool strict_auto = false;
  bool quiet = false;
  bool markdown = false;
  bool deepspeed_keys = false;
};

ConfigOptions to_config_options(const ConfigCommandOptions& opts) {
  ConfigOptions options;
  options.world_size = opts.world_size;
  if (opts.hidden_size > 0) options.hidden_size = opts.hidden_size;
  options.allow_unresolved_auto = !opts.strict_auto;
  return options;
}

void print_issues(const ConfigCheck& check, bool warnings) {
  for (const ConfigIssue& issue : check.issues) {
    if (issue.severity == IssueSeverity::kWarning && !warnings) continue;
    std::fprintf(stderr, "%s\n", format_issue(issue, check.config.source).c_str());
  }
}

int run_check(const ConfigCommandOptions& opts) {
  const ConfigCheck check = check_config_file(opts.file, to_config_options(opts));
  print_issues(check, !opts.quiet);
  if (!check.ok()) {
    std::fprintf(stderr, "%s: invalid: %zu error(s), %zu warning(s)\n", printable(opts.file).c_str(), check.error_count(),
                 check.warning_count());
    return 1;
  }
  const Config& c = check.config;
  const auto& z = c.zero_optimization;
  std::string batch = "batch unresolved";
  if (c.batch.train_batch_size && c.batch.train_micro_batch_size_per_gpu && c.batch.gradient_accumulation_steps) {
    batch = fmt::format("batch {} = {} x {} x world {}", *c.batch.train_batch_size, *c.batch.train_micro_batch_size_per_gpu,
                        *c.batch.gradient_accumulation_steps, c.world_size);
  }
  const bool precision_open = c.is_unresolved("fp16.enabled") || c.is_unresolved("bf16.enabled");
  fmt::print("{}: OK: ZeRO stage {}, optimizer offload {}, param offload {}, {}, {}{}, {}; {} warning(s)\n", opts.file,
             z.stage, offload_device_name(z.offload_optimizer.device), offload_device_name(z.offload_param.device),
             precision_open ? std::string_view("precision unresolved") : train_precision_name(c.precision()),
             optimizer_type_name(c.optimizer.type), c.optimizer.given ? "" : " (default)", batch, check.warning_count());
  return 0;
}

int run_show(const ConfigCommandOptions& opts) {
  const ConfigCheck check = check_config_file(opts.file, to_config_options(opts));
  print_issues(check, !opts.quiet);
  if (!check.ok()) {
    std::fprintf(stderr, "%s: invalid: %zu error(s); nothing to show\n", printable(opts.file).c_str(), check.error_count());
    return 1;
  }
  fmt::print("{}\n", config_to_json(check.config).dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  return 0;
}

int run_defaults(const ConfigCommandOptions& opts) {
  if (opts.deepspeed_keys) {
    fmt::print("{}", deepspeed_keys_markdown());
  } else if (opts.markdown) {
    fmt::print("{}", config_keys_markdown());
  } else {
    fmt::print("{}\n", config_defaults_json().dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  return 0;
}

CommandRegistration config_command("config", [](CLI::App& root) {
  CLI::App* group = ensure_subcommand(root, "config", "Check, show and document DeepSpeed JSON configs");

  auto check_opts = std::make_shared<ConfigCommandOptions>();
  CLI::App* check = group->add_subcommand("check", "Check a config; exit 0 when valid, else list every problem");
  check->add_option("file", check_opts->file, "DeepSpeed JSON config")->required();
  check->add_option("--world-size", check_opts->world_size, "Data-parallel ranks, for the batch arithmetic")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  check->add_option("--hidden-size", check_opts->hidden_size, "Model hidden size, to resolve \"auto\" bucket sizes");
  check->add_flag("--strict-auto", check_opts->strict_auto, "Treat an unresolved \"auto\" as an error");
  check->add_flag("-q,--quiet", check_opts->quiet, "Print errors only, not warnings");
  check->callback([check_opts] { exit_with(run_check(*check_opts)); });

  auto show_opts = std::make_shared<ConfigCommandOptions>();
  CLI::App* show = group->add_subcommand("show", "Print the fully resolved config as JSON");
  show->add_option("file", show_opts->file, "DeepSpeed JSON config")->required();
  show->add_option("--world-size", show_opts->world_size, "Data-parallel ranks, for the batch arithmetic")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  show->add_option("--hidden-size", show_opts->hidden_size, "Model hidden size, to resolve \"auto\" bucket sizes");
  show->add_flag("-q,--quiet", show_opts->quiet, "Do not print warnings");
  show->callback([show_opts] { exit_with(run_show(*show_opts)); });

  auto defaults_opts = std::make_shared<ConfigCommandOptions>();
  CLI::App* defaults = group->add_subcommand("defaults", "Print every key's default (JSON), or the reference (--markdown)");
  defaults->add_flag("--markdown", defaults_opts->markdown, "Print docs/config.md: every key, type, default, range, meaning");
  defaults->add_flag("--deepspeed-keys", defaults_opts->deepspeed_keys,
                     "Print docs/deepspeed-keys.md: every DeepSpeed key and what Strata does with it");
  defaults->callback([defaults_opts] { exit_with(run_defaults(*defaults_opts)); });
});

}  // namespace
}  // namespace strata::cli
