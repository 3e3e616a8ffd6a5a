// strata estimate: memory needed per GPU, per node (host) and on NVMe for
// every ZeRO stage and offload choice (see docs/estimate.md).
//
//   strata estimate --params 7B [--largest-layer 200M] [--gpus-per-node 8] [--nodes 1]
//                   [--config ds_config.json] [--gpu-memory 80GB --cpu-memory 512GB]
//                   [--binary] [--json]
#include <cstdio>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/config.h"
#include "strata/core/estimator.h"
#include "strata/core/units.h"

namespace strata::cli {
namespace {

struct EstimateOptions {
  std::string params;
  std::string largest_layer;
  uint32_t gpus_per_node = 1;
  uint32_t nodes = 1;
  std::string config;
  std::string gpu_memory, cpu_memory, nvme_memory;
  std::string precision = "bf16";
  std::string grad_dtype;
  std::string optimizer_states = "fp32";
  bool precision_given = false;
  bool binary = false;
  bool json = false;
};

int fail(const Status& status) {
  std::fprintf(stderr, "strata estimate: error: %s\n", status.message().c_str());
  return 1;
}

int run_estimate(const EstimateOptions& opts) {
  EstimateInput input;
  auto params = parse_count(opts.params, "--params");
  if (!params.ok()) return fail(params.status());
  input.params = *params;
  if (!opts.largest_layer.empty()) {
    auto layer = parse_count(opts.largest_layer, "--largest-layer");
    if (!layer.ok()) return fail(layer.status());
    input.largest_layer_params = *layer;
  }
  input.gpus_per_node = opts.gpus_per_node;
  input.nodes = opts.nodes;
  for (auto [text, flag, slot] : {std::tuple{&opts.gpu_memory, "--gpu-memory", &input.gpu_memory_bytes},
                                  std::tuple{&opts.cpu_memory, "--cpu-memory", &input.cpu_memory_bytes},
                                  std::tuple{&opts.nvme_memory, "--nvme-memory", &input.nvme_memory_bytes}}) {
    if (text->empty()) continue;
    auto bytes = parse_bytes(*text, flag);
    if (!bytes.ok()) return fail(bytes.status());
    *slot = *bytes;
  }
  if (!opts.config.empty()) {
    ConfigOptions config_options;
    config_options.world_size = static_cast<int64_t>(input.world_size());
    const ConfigCheck check = check_config_file(opts.config, config_options);
    for (const ConfigIssue& issue : check.issues) {
      if (issue.severity == IssueSeverity::kError) std::fprintf(stderr, "%s\n", format_issue(issue, opts.config).c_str());
    }
    if (!check.ok()) {
      std::fprintf(stderr, "strata estimate: error: %s is not a valid config (%zu error(s)); see strata config check\n",
                   opts.config.c_str(), check.error_count());
      return 1;
    }
    input.from_config(check.config);
  }
  if (opts.config.empty() || opts.precision_given) {
    auto precision = ledger_precision(opts.precision, opts.grad_dtype, opts.optimizer_states);
    if (!precision.ok()) return fail(precision.status());
    input.precision = *precision;
  }
  auto estimate = estimate_memory(input);
  if (!estimate.ok()) return fail(estimate.status());
  if (opts.json) {
    fmt::print("{}\n", estimate_to_json(*estimate).dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}", format_estimate(*estimate, opts.binary));
  }
  return 0;
}

CommandRegistration estimate_command("estimate", [](CLI::App& root) {
  auto opts = std::make_shared<EstimateOptions>();
  CLI::App* cmd = root.add_subcommand(
      "estimate", "Memory per GPU, per node and on NVMe for every ZeRO stage and offload choice");
  cmd->add_option("--params", opts->params, "Parameter count: 7B, 7e9, 350M")->required();
  cmd->add_option("--largest-layer", opts->largest_layer, "Parameters of the largest layer (stage-3 gather buffers)");
  // Bounded ranges: CLI11's PositiveNumber printed DBL_MAX (310 digits) in its error.
  cmd->add_option("--gpus-per-node", opts->gpus_per_node, "GPUs per node")->check(CLI::Range(1, 4096));
  cmd->add_option("--nodes", opts->nodes, "Nodes")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--config", opts->config, "DeepSpeed config: marks its row, takes buffers and precision from it");
  cmd->add_option("--gpu-memory", opts->gpu_memory, "Memory per GPU, e.g. 80GB");
  cmd->add_option("--cpu-memory", opts->cpu_memory, "Host memory per node, e.g. 512GB");
  cmd->add_option("--nvme-memory", opts->nvme_memory, "NVMe capacity per node, e.g. 3.84TB");
  auto* precision = cmd->add_option("--precision", opts->precision, "Parameter dtype: bf16 (default), fp16, fp32");
  auto* grad = cmd->add_option("--grad-dtype", opts->grad_dtype, "Gradient dtype on the GPU (default: the parameter dtype)");
  auto* states = cmd->add_option("--optimizer-states", opts->optimizer_states, "Adam m and v dtype: fp32 (default) or bf16");
  cmd->add_flag("--binary", opts->binary, "Print GiB instead of GB");
  cmd->add_flag("--json", opts->json, "Print JSON");
  cmd->callback([opts, precision, grad, states] {
    opts->precision_given = precision->count() + grad->count() + states->count() > 0;
    exit_with(run_estimate(*opts));
  });
});

}  // namespace
}  // namespace strata::cli
