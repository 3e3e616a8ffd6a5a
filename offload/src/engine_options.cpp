#include <algorithm>

#include <fmt/format.h>

#include "strata/core/printable.h"
#include "strata/cpu_adam/hyper_params.h"
#include "strata/offload/engine.h"

namespace strata::offload {

Result<SpeculationMode> parse_speculation_mode(std::string_view text, std::string_view field) {
  if (text == "auto") return SpeculationMode::kAuto;
  if (text == "on") return SpeculationMode::kOn;
  if (text == "off") return SpeculationMode::kOff;
  return InvalidArgument(fmt::format("{} '{}' is not auto, on or off", field, printable(text, 32)));
}

const char* speculation_mode_name(SpeculationMode mode) {
  switch (mode) {
    case SpeculationMode::kAuto: return "auto";
    case SpeculationMode::kOn: return "on";
    case SpeculationMode::kOff: return "off";
  }
  return "?";
}

Result<GradientShardsMode> parse_gradient_shards_mode(std::string_view text, std::string_view field) {
  if (text == "auto") return GradientShardsMode::kAuto;
  if (text == "pinned") return GradientShardsMode::kPinned;
  if (text == "nvme") return GradientShardsMode::kNvme;
  return InvalidArgument(fmt::format("{} '{}' is not auto, pinned or nvme", field, printable(text, 32)));
}

std::string gradient_shards_nvme_blocker(const Placement& placement, double ratio) {
  if (!placement.optimizer_offloaded())
    return "the optimizer state is on the device (offload_optimizer.device none): the gradient shards wait there";
  if (ratio < 1.0)
    return fmt::format("offload_optimizer.ratio {} < 1 steps part of each piece on the device", ratio);
  if (!placement.uses_nvme())
    return "neither the optimizer state (offload_optimizer.device nvme) nor the parameter shards "
           "(offload_param.device nvme) are on NVMe: the gradient shards go to one of their folders";
  return {};
}

std::string nvme_pipelines_note(OffloadDevice optimizer, bool pipeline_read, bool pipeline_write) {
  if (optimizer != OffloadDevice::kNvme || (pipeline_read && pipeline_write)) return {};
  return fmt::format(
      "zero_optimization.offload_optimizer.pipeline_read {} and pipeline_write {} (DeepSpeed's defaults are false): "
      "{}, on the step's path; set both true to overlap the optimizer state's NVMe reads and writes with the CPU "
      "step (docs/engine.md, Note [Read-ahead at the step's end])",
      pipeline_read, pipeline_write,
      pipeline_read    ? "each write of the optimizer state is waited for, queued behind the reads ahead"
      : pipeline_write ? "each read of the optimizer state starts only when its piece is opened"
                       : "each read and each write of the optimizer state is waited for");
}

Result<EngineOptions> engine_options_from_config(const Config& cfg) {
  EngineOptions o;
  const ZeroConfig& z = cfg.zero_optimization;
  o.source = cfg.source.empty() ? std::string("config") : cfg.source;
  o.stage = z.stage;
  o.offload_optimizer = z.offload_optimizer.device;
  o.offload_param = z.offload_param.device;
  if (o.offload_param == OffloadDevice::kNvme) {
    const OffloadParamConfig& op = z.offload_param;
    if (op.buffer_count < 1 || op.buffer_count > 65536 || op.buffer_size < 1 || op.max_in_cpu < 0)
      return InvalidArgument(fmt::format("{}: zero_optimization.offload_param buffer_count {} (1..65536), buffer_size "
                                         "{} (>= 1) or max_in_cpu {} (>= 0) is out of range",
                                         o.source, op.buffer_count, op.buffer_size, op.max_in_cpu));
    o.nvme_param.path = op.nvme_path;
    o.nvme_param.buffer_count = op.buffer_count;
    o.nvme_param.buffer_size = op.buffer_size;
    o.nvme_param.max_in_cpu = op.max_in_cpu;
    o.nvme.aio = cfg.aio;
    o.nvme.verify_checksums = cfg.strata.verify_checksums;
  }
  if (o.offload_optimizer == OffloadDevice::kNvme) {
    const OffloadOptimizerConfig& oo = z.offload_optimizer;
    if (oo.buffer_count < 1 || oo.buffer_count > 4096)
      return InvalidArgument(fmt::format("{}: zero_optimization.offload_optimizer.buffer_count {} is not in 1..4096",
                                         o.source, oo.buffer_count));
    o.nvme.path = oo.nvme_path;
    o.nvme.buffer_count = oo.buffer_count;
    o.nvme.pipeline_read = oo.pipeline_read;
    o.nvme.pipeline_write = oo.pipeline_write;
    o.nvme.verify_checksums = cfg.strata.verify_checksums;
    o.nvme.aio = cfg.aio;
  }
  o.ratio = z.offload_optimizer.ratio;
  o.sub_group_size = z.sub_group_size;
  // DeepSpeed's 0 (each gradient reduced on its own) is the engine's 1: the
  // cap is never below one layer, so each layer is reduced on its own.
  o.reduce_bucket_size = std::max<int64_t>(z.reduce_bucket_size, 1);
  o.prefetch_bucket_size = z.stage3_prefetch_bucket_size;
  o.max_live_parameters = z.stage3_max_live_parameters;
  o.max_reuse_distance = z.stage3_max_reuse_distance;
  o.persistence_threshold = z.stage3_param_persistence_threshold;
  o.overlap_optimizer = cfg.strata.overlap_optimizer;
  STRATA_ASSIGN_OR_RETURN(o.speculative_optimizer,
                          parse_speculation_mode(cfg.strata.speculative_optimizer, "strata.speculative_optimizer"));
  STRATA_ASSIGN_OR_RETURN(o.gradient_shards,
                          parse_gradient_shards_mode(cfg.strata.gradient_shards, "strata.gradient_shards"));
  o.grad_dtype = cfg.precision_dtype();
  if (!cfg.data_types.grad_accum_dtype.empty()) {
    Result<DType> g = parse_dtype(cfg.data_types.grad_accum_dtype);
    if (!g.ok() || !is_state_float(*g))
      return InvalidArgument(fmt::format("{}: data_types.grad_accum_dtype '{}' is not fp32, bf16 or fp16", o.source,
                                         cfg.data_types.grad_accum_dtype));
    o.grad_dtype = *g;
  }
  STRATA_ASSIGN_OR_RETURN(o.moments, cpu_adam::MomentStorage::parse(cfg.strata.optimizer_state_dtype,
                                                                  "strata.optimizer_state_dtype"));
  if (cfg.optimizer.given) {
    switch (cfg.optimizer.type) {
      case OptimizerType::kAdam: o.optimizer = cpu_adam::adam_kind(cfg.optimizer.adam_w_mode); break;
      case OptimizerType::kAdamW: o.optimizer = cpu_adam::OptimizerKind::kAdamW; break;
      case OptimizerType::kAdagrad: o.optimizer = cpu_adam::OptimizerKind::kAdagrad; break;
      case OptimizerType::kLion: o.optimizer = cpu_adam::OptimizerKind::kLion; break;
    }
    if (!cfg.is_unresolved("optimizer.params.lr")) o.hyper.lr = cfg.optimizer.lr;
    o.hyper.beta1 = cfg.optimizer.betas[0];
    o.hyper.beta2 = cfg.optimizer.betas[1];
    o.hyper.eps = cfg.optimizer.eps;
    o.hyper.weight_decay = cfg.optimizer.weight_decay;
    o.hyper.bias_correction = cfg.optimizer.bias_correction;
  }
  o.grad_clip = cfg.gradient_clipping;
  if (cfg.batch.gradient_accumulation_steps) {
    const int64_t ga = *cfg.batch.gradient_accumulation_steps;
    if (ga < 1 || ga > 1'000'000)
      return InvalidArgument(
          fmt::format("{}: gradient_accumulation_steps {} is out of range (1..1000000)", o.source, ga));
    o.grad_accum = static_cast<int>(ga);
  }
  o.fp16 = cfg.fp16;
  o.host_memory_budget = cfg.strata.host_memory_budget;
  o.wait_timeout_s = cfg.strata.wait_timeout_s;
  o.scheduler = cfg.scheduler;
  STRATA_RETURN_IF_ERROR(check_placement(o));
  return o;
}

// The one check of where the state may live (engine_options_from_config and
// Engine::create both run it); messages name the config keys.
Status check_placement(const EngineOptions& o) {
  if (o.stage < 0 || o.stage > 3)
    return InvalidArgument(fmt::format("{}: zero_optimization.stage {} is not 0, 1, 2 or 3", o.source, o.stage));
  const Placement choice = o.placement();
  if (choice.params_offloaded() && !choice.params_sharded())
    return InvalidArgument(fmt::format(
        "{}: zero_optimization.offload_param needs stage 3 (parameters are partitioned only there); stage is {}",
        o.source, o.stage));
  if (choice.params_offloaded() && !choice.optimizer_offloaded())
    return Unsupported(fmt::format(
        "{}: offload_param \"{}\" with offload_optimizer \"none\": the updated parameters would be written from "
        "device state into host shards; set zero_optimization.offload_optimizer.device to \"cpu\" as well",
        o.source, offload_device_name(o.offload_param)));
  if (choice.params_on_nvme() && o.nvme_param.path.empty())
    return InvalidArgument(fmt::format("{}: zero_optimization.offload_param.nvme_path is not set: name a folder on "
                                       "the NVMe drive for the parameter shards",
                                       o.source));
  if (choice.optimizer_on_nvme() && o.nvme.path.empty())
    return InvalidArgument(fmt::format("{}: zero_optimization.offload_optimizer.nvme_path is not set: name a folder "
                                       "on the NVMe drive for the optimizer state",
                                       o.source));
  if (!(o.ratio > 0.0 && o.ratio <= 1.0))
    return InvalidArgument(fmt::format("{}: zero_optimization.offload_optimizer.ratio {} must be in (0, 1]", o.source,
                                       o.ratio));
  if (o.ratio < 1.0 && !(choice.params_sharded() && choice.optimizer_in_host_memory() && !choice.params_offloaded()))
    return Unsupported(fmt::format(
        "{}: zero_optimization.offload_optimizer.ratio {} (partial offload) needs stage 3, offload_optimizer \"cpu\" "
        "and offload_param \"none\" (stage is {}, offload_optimizer {}, offload_param {}); set ratio to 1.0 or "
        "change the placement",
        o.source, o.ratio, o.stage, offload_device_name(o.offload_optimizer), offload_device_name(o.offload_param)));
  if (!(o.wait_timeout_s >= 0.001 && o.wait_timeout_s <= 604800))
    return InvalidArgument(fmt::format("{}: strata.wait_timeout_s {} is out of range (0.001 .. 604800 seconds): every "
                                       "wait of the engine is bounded, by 600 s unless set",
                                       o.source, o.wait_timeout_s));
  return Status::Ok();
}

}  // namespace strata::offload
