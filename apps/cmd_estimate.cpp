// strata estimate: memory needed per GPU, per node (host) and on NVMe for
// every ZeRO stage and offload choice (see docs/estimate.md).
//
//   strata estimate --params 7B [--largest-layer 200M] [--gpus-per-node 8] [--nodes 1]
//                   [--config ds_config.json] [--gpu-memory 80GB --cpu-memory 512GB]
//                   [--binary] [--json]
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "model_shape_flags.h"
#include "strata/core/printable.h"
#include "strata/core/config.h"
#include <optional>

#include "strata/core/estimator.h"
#include "strata/core/units.h"
#include "strata/model/gpt.h"
#include "config_fit_cli.h"
#include "strata/offload/engine.h"

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
  // --model: the engine's own plan for a real model (layers, padding, buffers).
  std::string model;
  ModelShapeFlags shape;  // with --model: overrides of the preset
};

int estimate_failed(const Status& status) {
  std::fprintf(stderr, "strata estimate: error: %s\n", printable_message(status.message()).c_str());
  return 1;
}

// One row of the engine's plan: a stage and placement, its bytes per rank
// (the largest over ranks), and what would make it fit --gpu-memory.
struct EnginePlanRow {
  int stage = 0;
  OffloadDevice optimizer = OffloadDevice::kNone, param = OffloadDevice::kNone;
  offload::EngineMemory worst;
  bool marked = false;  // the config's own row
  std::string to_fit;
};

struct EnginePlan {
  std::string model;  // GptConfig::describe()
  uint32_t world = 1;
  std::vector<EnginePlanRow> rows;
};

// The engine's plan (offload/: plan_engine_memory, the numbers the engine
// itself predicts before allocating) for every stage and cpu placement of a
// real model: device and pinned bytes per rank, the largest over ranks, on a
// device the host cannot address (a GPU: a device optimizer copies each
// reduced gradient to the host for the norm, and strata.speculative_optimizer
// auto plans the early updates' pending state, which it leaves out on the cpu
// device).
Result<EnginePlan> plan_engine(const EstimateOptions& opts, const Config* config, uint32_t world) {
  Result<model::GptConfig> preset = model::preset(opts.model);
  if (!preset.ok()) return preset.status().with_context("--model");
  model::GptConfig g = *preset;
  opts.shape.apply_to(g);
  offload::EngineOptions base;
  Placement marked{-1, OffloadDevice::kNone, OffloadDevice::kNone};
  if (config != nullptr) {
    g.param_dtype = config->precision_dtype();
    Config runnable = *config;  // every row is planned whole (ratio 1)
    runnable.zero_optimization.offload_optimizer.ratio = 1.0;
    Result<offload::EngineOptions> o = offload::engine_options_from_config(runnable);
    if (!o.ok()) return o.status();
    base = *o;
    marked = {config->zero_optimization.stage, config->zero_optimization.offload_optimizer.device,
              config->zero_optimization.offload_param.device};
  } else {
    base.grad_dtype = g.param_dtype;
    Result<cpu_adam::MomentStorage> moments = cpu_adam::MomentStorage::parse(opts.optimizer_states, "--optimizer-states");
    if (!moments.ok()) return moments.status();
    base.moments = *moments;
  }
  STRATA_CHECK(g.validate().ok(), "model flags were checked");
  Result<std::unique_ptr<model::GptModel>> m = model::GptModel::create(g, 1);
  if (!m.ok()) return m.status();
  const auto layers = (*m)->layers();
  // --gpu-memory (per GPU), --cpu-memory and --nvme-memory (per node): the caps a row's "to fit" is for.
  std::optional<offload::FitRequest> fit_request;
  offload::FitCaps fit_caps;
  if (!opts.gpu_memory.empty()) {
    Result<uint64_t> dev = parse_bytes(opts.gpu_memory, "--gpu-memory");
    Result<uint64_t> host = opts.cpu_memory.empty() ? Result<uint64_t>(~uint64_t{0} / 2) : parse_bytes(opts.cpu_memory, "--cpu-memory");
    if (dev.ok() && host.ok() && *dev != 0 && *host != 0) {
      fit_caps.device_bytes = *dev;
      fit_caps.host_bytes = *host;
      fit_caps.ranks_per_node = static_cast<int>(std::min<uint32_t>(world, std::max<uint32_t>(1, opts.gpus_per_node)));
      fit_caps.nvme_bytes = ~uint64_t{0} / 2;  // unlimited unless --nvme-memory
      if (!opts.nvme_memory.empty()) {
        if (Result<uint64_t> nv = parse_bytes(opts.nvme_memory, "--nvme-memory"); nv.ok() && *nv != 0) fit_caps.nvme_bytes = *nv;
      }
      offload::HardwareProfile profile = offload::builtin_cpu_profile();
      profile.shared_cores = false;
      const Config defaults;
      Result<offload::FitRequest> req = gpt_fit_request(g, config != nullptr ? *config : defaults, static_cast<int>(world), 1,
                                                        std::min(64, g.max_seq_len), 1, profile);
      if (req.ok()) {
        req->device = offload::PlannedDevice::gpu();
        req->device_reserve = nullptr;  // the rows count the engine only
        fit_request = std::move(*req);
      }
    }
  }
  EnginePlan plan{g.describe(), world, {}};
  constexpr OffloadDevice kPlaces[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  for (int stage = 0; stage <= 3; ++stage)
    for (OffloadDevice od : kPlaces)
      for (OffloadDevice pdv : kPlaces) {
        // Parameters leave the device only at stage 3, and only with the optimizer off it too.
        const Placement placement{stage, od, pdv};
        if (placement.params_offloaded() && !(placement.params_sharded() && placement.optimizer_offloaded())) continue;
        offload::EngineOptions o = base;
        o.stage = stage;
        o.offload_optimizer = od;
        o.offload_param = pdv;
        EnginePlanRow row{stage, od, pdv, {}, marked.stage == stage && marked.optimizer == od && marked.param == pdv, {}};
        STRATA_ASSIGN_OR_RETURN(const offload::Partition partition,
                                offload::Partition::create(layers, static_cast<int>(world), o.sub_group_size));
        for (int r : partition.distinct_ranks()) {  // the same largest as every rank, in O(sub-groups) plans
          Result<offload::EngineMemory> p = offload::plan_engine_memory(
              o, layers, static_cast<int>(world), static_cast<int>(r), offload::PlannedDevice::gpu());
          if (!p.ok()) return p.status();
          if (p->device > row.worst.device) row.worst = *p;
          row.worst.pinned = std::max(row.worst.pinned, p->pinned);
          row.worst.nvme = std::max(row.worst.nvme, p->nvme);
        }
        // With --gpu-memory: a row over it says which knobs make it fit, and to what (plan --fit's search).
        const offload::EngineMemory& w = row.worst;
        if (fit_request && (w.device > fit_caps.device_bytes || w.pinned * fit_caps.ranks_per_node > fit_caps.host_bytes ||
                            (fit_caps.nvme_bytes && w.nvme * fit_caps.ranks_per_node > *fit_caps.nvme_bytes)))
          row.to_fit = fit_hint(*fit_request, fit_caps, stage, od, pdv, 1.0, g.param_dtype, o.moments);
        plan.rows.push_back(std::move(row));
      }
  return plan;
}

void print_engine_plan(const EnginePlan& plan, bool binary) {
  fmt::print("\nengine plan per rank: {} on {} rank(s); the engine's own buffers and state (activations not "
             "included), the largest over ranks\n",
             plan.model, plan.world);
  fmt::print("  {:>5}  {:>9}  {:>6}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}\n", "stage", "optimizer", "params",
             "device", "params", "grads", "opt state", "pinned", "nvme");
  auto b = [&](uint64_t v) { return format_bytes(v, binary); };
  for (const EnginePlanRow& row : plan.rows) {
    const offload::EngineMemory& w = row.worst;
    fmt::print("  {:>5}  {:>9}  {:>6}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}{}\n", row.stage,
               offload_device_name(row.optimizer), offload_device_name(row.param), b(w.device), b(w.device_params),
               b(w.device_grads + w.device_gathered), b(w.device_optimizer), b(w.pinned), b(w.nvme),
               row.marked ? "  <- config" : "");
    if (!row.to_fit.empty()) fmt::print("         to fit: {}\n", printable(row.to_fit, 1000));
  }
  fmt::print("  (grads column: gradient buffers plus stage-3 gathered layers)\n");
}

// The same rows for --json, in bytes.
nlohmann::ordered_json engine_plan_json(const EnginePlan& plan) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (const EnginePlanRow& row : plan.rows) {
    const offload::EngineMemory& w = row.worst;
    nlohmann::ordered_json j;
    j["stage"] = row.stage;
    j["offload_optimizer"] = offload_device_name(row.optimizer);
    j["offload_param"] = offload_device_name(row.param);
    j["device_bytes"] = w.device;
    j["device_params_bytes"] = w.device_params;
    j["device_grads_bytes"] = w.device_grads + w.device_gathered;
    j["device_optimizer_bytes"] = w.device_optimizer;
    j["pinned_bytes"] = w.pinned;
    j["nvme_bytes"] = w.nvme;
    j["config_row"] = row.marked;
    if (!row.to_fit.empty()) j["to_fit"] = row.to_fit;
    rows.push_back(std::move(j));
  }
  nlohmann::ordered_json out;
  out["model"] = plan.model;
  out["ranks"] = plan.world;
  out["device"] = "gpu";
  out["rows"] = std::move(rows);
  return out;
}

int run_estimate(const EstimateOptions& opts) {
  EstimateInput input;
  std::optional<Config> config_copy;
  if (opts.params.empty() && opts.model.empty())
    return estimate_failed(
        InvalidArgument("give --params (e.g. 7B) or --model (a preset, for the engine's exact plan)"));
  if (!opts.params.empty()) {
    auto params = parse_count(opts.params, "--params");
    if (!params.ok()) return estimate_failed(params.status());
    input.params = *params;
  } else {
    Result<model::GptConfig> preset = model::preset(opts.model);
    if (!preset.ok()) return estimate_failed(preset.status().with_context("--model"));
    model::GptConfig g = *preset;
    opts.shape.apply_to(g);
    Status valid = g.validate();
    if (!valid.ok()) return estimate_failed(valid);
    input.params = static_cast<uint64_t>(g.param_count());
  }
  if (!opts.largest_layer.empty()) {
    auto layer = parse_count(opts.largest_layer, "--largest-layer");
    if (!layer.ok()) return estimate_failed(layer.status());
    input.largest_layer_params = *layer;
  }
  input.gpus_per_node = opts.gpus_per_node;
  input.nodes = opts.nodes;
  for (auto [text, flag, slot] : {std::tuple{&opts.gpu_memory, "--gpu-memory", &input.gpu_memory_bytes},
                                  std::tuple{&opts.cpu_memory, "--cpu-memory", &input.cpu_memory_bytes},
                                  std::tuple{&opts.nvme_memory, "--nvme-memory", &input.nvme_memory_bytes}}) {
    if (text->empty()) continue;
    auto bytes = parse_bytes(*text, flag);
    if (!bytes.ok()) return estimate_failed(bytes.status());
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
                   printable(opts.config, 256).c_str(), check.error_count());
      return 1;
    }
    input.from_config(check.config);
    config_copy = check.config;
  }
  if (opts.config.empty() || opts.precision_given) {
    auto precision = ledger_precision(opts.precision, opts.grad_dtype, opts.optimizer_states);
    if (!precision.ok()) return estimate_failed(precision.status());
    input.precision = *precision;
  }
  auto estimate = estimate_memory(input);
  if (!estimate.ok()) return estimate_failed(estimate.status());
  std::optional<EnginePlan> plan;
  if (!opts.model.empty()) {
    Result<EnginePlan> planned =
        plan_engine(opts, config_copy ? &*config_copy : nullptr, static_cast<uint32_t>(input.world_size()));
    if (!planned.ok()) return estimate_failed(planned.status());
    plan = std::move(*planned);
  }
  if (opts.json) {
    nlohmann::ordered_json out = estimate_to_json(*estimate);
    if (plan) out["engine_plan"] = engine_plan_json(*plan);
    fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}", format_estimate(*estimate, opts.binary));
    if (plan) print_engine_plan(*plan, opts.binary);
  }
  return 0;
}

CommandRegistration estimate_command("estimate", [](CLI::App& root) {
  auto opts = std::make_shared<EstimateOptions>();
  CLI::App* cmd = root.add_subcommand(
      "estimate", "Memory per GPU, per node and on NVMe for every ZeRO stage and offload choice");
  cmd->add_option("--params", opts->params, "Parameter count: 7B, 7e9, 350M (or give --model)");
  cmd->add_option("--model", opts->model,
                  "A model preset (tiny, small, gpt2, ...): adds the engine's exact per-rank plan for every stage");
  add_model_shape_flags(*cmd, opts->shape, "With --model: ");
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
  auto* states = cmd->add_option("--optimizer-states", opts->optimizer_states, "Adam m and v dtype: fp32 (default), bf16, or int8 (block-wise 8-bit; offloaded state only)");
  cmd->add_flag("--binary", opts->binary, "Print GiB instead of GB");
  cmd->add_flag("--json", opts->json, "Print JSON");
  cmd->callback([opts, precision, grad, states] {
    opts->precision_given = precision->count() + grad->count() + states->count() > 0;
    exit_with(run_estimate(*opts));
  });
});

}  // namespace
}  // namespace strata::cli
