// Resolution and cross-key rules of the config (see config_parse.cpp for
// the walk). Every rule reports through the Checker, so a file with five
// problems shows five messages, each with the JSON path and the fix.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "config_internal.h"
#include "config_values.h"
#include "strata/core/config.h"
#include "strata/core/config_schema.h"
#include "strata/core/placement.h"

namespace strata {
namespace config_detail {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

bool type_listed(std::string_view applies_to, std::string_view type) {
  size_t start = 0;
  while (start <= applies_to.size()) {
    size_t end = applies_to.find('|', start);
    if (end == std::string_view::npos) end = applies_to.size();
    if (applies_to.substr(start, end - start) == type) return true;
    start = end + 1;
  }
  return false;
}

std::string pretty_list(std::string_view applies_to) {
  std::string out(applies_to);
  std::replace(out.begin(), out.end(), '|', ',');
  size_t pos = 0;
  while ((pos = out.find(',', pos)) != std::string::npos) {
    out.replace(pos, 1, ", ");
    pos += 2;
  }
  return out;
}

void apply_one(Config& config, const ConfigKey& key, const json& value) {
  if (key.parent() == "scheduler.params") {
    config.scheduler.params[std::string(key.name())] = value;
  } else if (key.set != nullptr) {
    key.set(config, value);
  }
}

void mark_unresolved(Checker& c, Config& config, const std::string& path, std::string_view why) {
  if (config.is_unresolved(path)) return;
  config.unresolved.push_back(path);
  const ConfigKey* key = find_config_key(path);
  const std::string def = key == nullptr ? std::string("?")
                          : key->default_note.empty() ? std::string(key->default_json)
                                                      : std::string(key->default_note);
  const std::string message = fmt::format("\"auto\" is unresolved{}", why.empty() ? "" : fmt::format(" ({})", why));
  const bool batch_key = path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" ||
                         path == "gradient_accumulation_steps";
  const std::string hint =
      batch_key ? std::string("the launcher must supply it, or write a number: any two of the three batch keys give the third")
                : fmt::format("the launcher must supply it; until then the default ({}) stands", def);
  if (c.options.allow_unresolved_auto) c.warn(c.written(path), message, hint);
  else c.error(c.written(path), message, "write a value instead of \"auto\"");
}

// "auto" values other than the batch triple.
void resolve_autos(Checker& c, Config& config) {
  const std::optional<int64_t> hidden = c.options.hidden_size;
  for (const std::string& path : c.autos) {
    const ConfigKey* key = find_config_key(path);
    if (key == nullptr) continue;
    auto supplied = c.options.auto_values.find(path);
    if (supplied != c.options.auto_values.end()) {
      const ordered_json value = ordered_json::parse(supplied->second.dump());
      if (value.is_string() && value.get<std::string>() == "auto") {
        mark_unresolved(c, config, path, "the value supplied for it is \"auto\" again");
      } else if (c.check_value(*key, value, fmt::format("{} (value supplied for \"auto\")", c.written(path)))) {
        apply_one(config, *key, supplied->second);
        if (path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" ||
            path == "gradient_accumulation_steps") {
          c.values.emplace_back(path, value);
        }
      }
      continue;
    }
    if (path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" || path == "gradient_accumulation_steps") {
      continue;  // resolve_batch
    }
    auto& zero = config.zero_optimization;
    if (path == "zero_optimization.reduce_bucket_size" || path == "zero_optimization.stage3_prefetch_bucket_size" ||
        path == "zero_optimization.stage3_param_persistence_threshold") {
      if (hidden && *hidden > 0) {
        const int64_t h = *hidden;
        if (path == "zero_optimization.reduce_bucket_size") zero.reduce_bucket_size = h * h;
        if (path == "zero_optimization.stage3_prefetch_bucket_size")
          zero.stage3_prefetch_bucket_size = static_cast<int64_t>(0.9 * static_cast<double>(h) * static_cast<double>(h));
        if (path == "zero_optimization.stage3_param_persistence_threshold") zero.stage3_param_persistence_threshold = 10 * h;
      } else {
        c.warn(c.written(path), fmt::format("\"auto\" resolved to the default {}", key->default_json),
               "give the model's hidden size to size it from the model (hidden^2, 0.9 hidden^2, 10 hidden)");
      }
      continue;
    }
    mark_unresolved(c, config, path, "");
  }
}

void resolve_batch(Checker& c, Config& config) {
  const int64_t world = config.world_size;
  auto& T = config.batch.train_batch_size;
  auto& M = config.batch.train_micro_batch_size_per_gpu;
  auto& G = config.batch.gradient_accumulation_steps;
  const char* kT = "train_batch_size";
  const char* kM = "train_micro_batch_size_per_gpu";
  const char* kG = "gradient_accumulation_steps";
  const bool t_auto = !T && c.is_auto(kT);
  const bool m_auto = !M && c.is_auto(kM);
  const bool g_auto = !G && c.is_auto(kG);
  const std::string world_note =
      !c.options.world_size_origin.empty() ? fmt::format(" (world size {} from {})", world, c.options.world_size_origin)
      : world == 1 && c.options.world_size == 1 ? " (world size 1; pass --world-size N)"
                                                : "";

  // Products of user numbers are checked, never wrapped: a micro batch of
  // 2^62 times 4 ranks must be an error, not "batch 0".
  auto product_of = [&](std::initializer_list<int64_t> factors, const std::string& what) -> std::optional<int64_t> {
    int64_t p = 1;
    for (int64_t f : factors) {
      if (__builtin_mul_overflow(p, f, &p)) {
        c.error(c.written(kM), fmt::format("{} overflows a 64-bit integer", what),
                "use realistic batch sizes: the product of micro batch, accumulation steps and world size must fit "
                "in 2^63 - 1");
        return std::nullopt;
      }
    }
    return p;
  };
  auto divide = [&](int64_t numerator, int64_t denominator, const std::string& denominator_text,
                    std::optional<int64_t>& out) {
    if (denominator <= 0 || numerator % denominator != 0 || numerator / denominator == 0) {
      c.error(c.written(kT),
              fmt::format("train_batch_size {} is not a multiple of {} = {}{}", numerator, denominator_text, denominator,
                          world_note),
              fmt::format("make train_batch_size a multiple of {}", denominator));
      return;
    }
    out = numerator / denominator;
  };

  if (T && M && G) {
    const std::optional<int64_t> checked = product_of(
        {*M, *G, world}, fmt::format("train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x world size {}",
                                     *M, *G, world));
    if (!checked) return;
    const int64_t product = *checked;
    if (*T != product) {
      c.error(c.written(kT),
              fmt::format("train_batch_size {} != train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x "
                          "world size {} = {}{}",
                          *T, *M, *G, world, product, world_note),
              fmt::format("set train_batch_size to {}, or give only two of the three and let the third be derived",
                          product));
    }
  } else if (T && M) {
    if (!g_auto && c.present(kG)) return;
    const std::string what = fmt::format("train_micro_batch_size_per_gpu {} x world size {}", *M, world);
    if (const auto d = product_of({*M, world}, what)) divide(*T, *d, what, G);
  } else if (T && G) {
    const std::string what = fmt::format("gradient_accumulation_steps {} x world size {}", *G, world);
    if (const auto d = product_of({*G, world}, what)) divide(*T, *d, what, M);
  } else if (M && G) {
    T = product_of({*M, *G, world},
                   fmt::format("train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x world size {}", *M,
                               *G, world));
  } else if (T) {
    if (m_auto || g_auto) {
      if (m_auto) mark_unresolved(c, config, kM, "two of the three batch keys are unknown");
      if (g_auto) mark_unresolved(c, config, kG, "two of the three batch keys are unknown");
      return;
    }
    G = 1;
    divide(*T, world, fmt::format("world size"), M);
  } else if (M) {
    if (t_auto && g_auto) {
      mark_unresolved(c, config, kT, "two of the three batch keys are unknown");
      mark_unresolved(c, config, kG, "two of the three batch keys are unknown");
      return;
    }
    if (g_auto) {
      mark_unresolved(c, config, kG, "");
      return;
    }
    G = 1;
    T = product_of({*M, world}, fmt::format("train_micro_batch_size_per_gpu {} x world size {}", *M, world));
  } else if (G) {
    if (t_auto || m_auto) {
      if (t_auto) mark_unresolved(c, config, kT, "two of the three batch keys are unknown");
      if (m_auto) mark_unresolved(c, config, kM, "two of the three batch keys are unknown");
      return;
    }
    c.error(c.written(kG), "gradient_accumulation_steps alone does not determine the batch",
            "add train_micro_batch_size_per_gpu (or train_batch_size)");
  } else {
    bool any_auto = false;
    for (const char* key : {kT, kM, kG}) {
      if (c.is_auto(key)) {
        mark_unresolved(c, config, key, "");
        any_auto = true;
      }
    }
    if (!any_auto) {
      c.warn("train_batch_size", "no batch size given",
             "add train_micro_batch_size_per_gpu (and gradient_accumulation_steps) before training with this config");
    }
  }
}

void check_offload(Checker& c, Config& config) {
  auto& zero = config.zero_optimization;
  const int stage = zero.stage;
  const std::string oo = "zero_optimization.offload_optimizer";
  const std::string op = "zero_optimization.offload_param";

  // Deprecated keys together with their replacements.
  auto deprecated_conflict = [&](const char* old_key, const std::string& section) {
    const std::string old_path = fmt::format("zero_optimization.{}", old_key);
    const ordered_json* old_value = c.given(old_path);
    if (old_value != nullptr && old_value->is_boolean() && old_value->get<bool>() && c.present(section)) {
      c.error(c.written(old_path), fmt::format("given together with '{}'", c.written(section)),
              fmt::format("remove the deprecated '{}'", old_key));
    }
  };
  deprecated_conflict("cpu_offload", oo);
  deprecated_conflict("cpu_offload_param", op);

  auto where = [&](const std::string& section, const char* old_key) {
    if (c.present(section + ".device")) return c.written(section + ".device");
    const std::string old_path = fmt::format("zero_optimization.{}", old_key);
    if (c.present(old_path)) return c.written(old_path);
    return c.written(section);
  };
  // As written; parameter offload below stage 3 is resolved to none next.
  const Placement asked = placement_of(zero);
  if (asked.optimizer_offloaded() && !asked.optimizer_sharded()) {
    c.error(where(oo, "cpu_offload"),
            fmt::format("optimizer offload ({}) needs ZeRO stage 1, 2 or 3, but zero_optimization.stage is 0",
                        offload_device_name(zero.offload_optimizer.device)),
            "set zero_optimization.stage to 1, 2 or 3, or set offload_optimizer.device to \"none\"");
  }
  if (asked.params_offloaded() && !asked.params_sharded()) {
    // DeepSpeed ignores it there (parameters are partitioned, and so
    // offloaded, only at stage 3): accepted with DeepSpeed's meaning, and
    // resolved to none so every reader of the config sees what runs.
    c.warn(where(op, "cpu_offload_param"),
           fmt::format("parameter offload ({}) has no effect below ZeRO stage 3 (zero_optimization.stage is {}): "
                       "parameters are partitioned, and so offloaded, only at stage 3; DeepSpeed ignores it too",
                       offload_device_name(zero.offload_param.device), stage),
           "set zero_optimization.stage to 3 to offload parameters, or remove offload_param");
    zero.offload_param.device = OffloadDevice::kNone;
  }
  const Placement chosen = placement_of(zero);  // what runs
  auto check_nvme = [&](const std::string& section, OffloadDevice device, const std::string& nvme_path) {
    if (device == OffloadDevice::kNvme && nvme_path.empty()) {
      c.error(c.present(section + ".nvme_path") ? c.written(section + ".nvme_path") : c.written(section) + ".nvme_path",
              "device is nvme but nvme_path is not set",
              "set nvme_path to a directory on a local NVMe drive, e.g. \"/local_nvme\"");
    } else if (device != OffloadDevice::kNvme && !nvme_path.empty()) {
      c.warn(c.written(section + ".nvme_path"),
             fmt::format("ignored: device is {}", offload_device_name(device)), "set device to \"nvme\" to use it");
    }
  };
  check_nvme(oo, zero.offload_optimizer.device, zero.offload_optimizer.nvme_path);
  check_nvme(op, zero.offload_param.device, zero.offload_param.nvme_path);
  // The read-ahead and write-behind are the NVMe tier's. DeepSpeed accepts
  // them with any device and does nothing, so a config that sets them
  // elsewhere still loads, with a warning saying they do nothing.
  for (const auto& [key, on] : {std::pair{"pipeline_read", zero.offload_optimizer.pipeline_read},
                                std::pair{"pipeline_write", zero.offload_optimizer.pipeline_write}}) {
    if (on && !chosen.optimizer_on_nvme()) {
      c.warn(c.written(oo + "." + key),
             fmt::format("has no effect: offload_optimizer.device is {}, and the pipelines move the optimizer "
                         "state's NVMe reads and writes",
                         offload_device_name(zero.offload_optimizer.device)),
             "set offload_optimizer.device to \"nvme\" to use it, or remove it");
    }
  }
  // The engine refuses this at start-up (early_updates_blocker). A warning,
  // not an error: `strata train --offload-optimizer cpu` or a bench row may
  // still offload the state, and the engine checks what finally runs.
  if (config.strata.speculative_optimizer == "on" && !chosen.optimizer_offloaded()) {
    c.warn(c.written("strata.speculative_optimizer"),
           "on needs the optimizer state offloaded: early updates step offloaded state on the CPU while the backward "
           "runs, and offload_optimizer.device is none, so a run with this config as written is refused",
           "set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\" (or pass --offload-optimizer), or "
           "set strata.speculative_optimizer to \"auto\" or \"off\"");
  }

  const double ratio = zero.offload_optimizer.ratio;
  if (ratio < 1.0) {
    if (!chosen.params_sharded()) {
      c.error(c.written(oo + ".ratio"),
              fmt::format("ratio {} (partial optimizer offload) needs ZeRO stage 3, but zero_optimization.stage is {}",
                          ratio, stage),
              "set ratio to 1.0, or set zero_optimization.stage to 3");
    } else if (!chosen.optimizer_offloaded()) {
      c.warn(c.written(oo + ".ratio"), "has no effect: offload_optimizer.device is none", "");
    }
  }
  for (const auto& [section, device, pinned] :
       {std::tuple{oo, zero.offload_optimizer.device, zero.offload_optimizer.pin_memory},
        std::tuple{op, zero.offload_param.device, zero.offload_param.pin_memory}}) {
    if (device == OffloadDevice::kNvme && !pinned) {
      c.warn(c.written(section + ".pin_memory"), "NVMe offload without pinned buffers copies through pageable memory",
             "set pin_memory to true unless the locked-memory limit forbids it");
    }
  }

  if (!chosen.params_sharded()) {
    for (const auto& [path, value] : c.values) {
      // Its own warning (warn_keys_without_effect) says it has no effect at any stage.
      if (path == "zero_optimization.stage3_model_persistence_threshold") continue;
      if (path.rfind("zero_optimization.stage3_", 0) == 0) {
        c.warn(c.written(path), fmt::format("has no effect below stage 3 (zero_optimization.stage is {})", stage), "");
      }
    }
  }
  if (!c.present("zero_optimization.overlap_comm") || c.given("zero_optimization.overlap_comm") == nullptr ||
      c.given("zero_optimization.overlap_comm")->is_null()) {
    zero.overlap_comm = chosen.params_sharded();
  }
  if (zero.zero_hpz_partition_size > 1 || zero.zero_quantized_weights || zero.zero_quantized_gradients) {
    c.warn(c.written("zero_optimization"), "ZeRO++ (hpZ, quantized weights or gradients) is not implemented by Strata",
           "the settings are ignored; remove them to silence this warning");
  }
  if (config.aio.use_gds) {
    c.warn(c.written("aio.use_gds"), "GPUDirect Storage is not implemented by Strata",
           "NVMe data moves through pinned host memory; remove use_gds to silence this warning");
  }
  if (config.aio.block_size % 4096 != 0) {
    c.error(c.written("aio.block_size"),
            fmt::format("{} is not a multiple of 4096 (O_DIRECT needs aligned requests)", config.aio.block_size),
            "use a power of two such as 1048576 (1 MiB)");
  }
}

// Note [Keys without effect]
// Some zero_optimization keys name a DeepSpeed mechanism that Strata's
// engine does not have. They are accepted (a DeepSpeed config must load
// unchanged), and each one the file sets to something Strata does not do
// draws a warning that says so and why, so nobody tunes a knob that turns
// nothing. A boolean set to what Strata always does (reduce_scatter true,
// round_robin_gradients false) asks for nothing missing: no warning.
void warn_keys_without_effect(Checker& c, const Config& config) {
  const ZeroConfig& zero = config.zero_optimization;
  const char* kAllgatherBucket = "zero_optimization.allgather_bucket_size";
  const char* kReduceScatter = "zero_optimization.reduce_scatter";
  const char* kRoundRobin = "zero_optimization.round_robin_gradients";
  const char* kModelPersistence = "zero_optimization.stage3_model_persistence_threshold";
  if (c.given(kAllgatherBucket) != nullptr) {
    c.warn(c.written(kAllgatherBucket),
           "accepted, but has no effect in Strata: each sub-group is all-gathered as one collective, so there is no "
           "all-gather bucket (in DeepSpeed: elements all-gathered at once)",
           "zero_optimization.sub_group_size sets how much one all-gather moves; remove allgather_bucket_size to "
           "silence this warning");
  }
  if (c.given(kReduceScatter) != nullptr && !zero.reduce_scatter) {
    c.warn(c.written(kReduceScatter),
           "false is accepted, but has no effect in Strata: gradients are always reduce-scattered, each piece summed "
           "in rank order, which is what makes the losses identical at every stage (in DeepSpeed, false means "
           "all-reduce)",
           "remove reduce_scatter (or set it to true) to silence this warning");
  }
  if (c.given(kRoundRobin) != nullptr && zero.round_robin_gradients) {
    c.warn(c.written(kRoundRobin),
           "true is accepted, but has no effect in Strata: each layer's gradients are copied to the host (D2H) as "
           "that layer's reduction finishes, not spread across ranks round robin",
           "remove round_robin_gradients (or set it to false) to silence this warning");
  }
  if (c.given(kModelPersistence) != nullptr) {
    c.warn(c.written(kModelPersistence),
           "accepted, but has no effect in Strata: a layer stays whole on every rank when it has fewer elements than "
           "zero_optimization.stage3_param_persistence_threshold, and the total of such layers is not capped",
           "use stage3_param_persistence_threshold; remove this key to silence this warning");
  }
}

void check_params_belong(Checker& c, std::string_view parent, std::string_view type_key, std::string_view type) {
  auto check = [&](const std::string& path) {
    const ConfigKey* key = find_config_key(path);
    if (key == nullptr || key->parent() != parent || key->applies_to.empty()) return;
    if (!type_listed(key->applies_to, type)) {
      c.error(c.written(path), fmt::format("'{}' is not a parameter of {} {}", key->name(), type_key, type),
              fmt::format("it belongs to {}; remove it or change {}", pretty_list(key->applies_to), type_key));
    }
  };
  for (const auto& [path, value] : c.values) check(path);
  for (const std::string& path : c.autos) check(path);
}

void check_optimizer(Checker& c, Config& config) {
  if (!c.present("optimizer")) return;
  if (!c.present("optimizer.type")) {
    c.error(c.written("optimizer") + ".type", "the optimizer section has no type",
            "add \"type\": \"AdamW\" (or Adam, Adagrad, Lion)");
    return;
  }
  auto& opt = config.optimizer;
  check_params_belong(c, "optimizer.params", "optimizer.type", optimizer_type_name(opt.type));
  if (opt.amsgrad) {
    c.error(c.written("optimizer.params.amsgrad"), "AMSGrad is not implemented by Strata",
            "set amsgrad to false or remove it");
  }
  if (opt.type == OptimizerType::kAdamW && c.present("optimizer.params.adam_w_mode") && !opt.adam_w_mode) {
    c.warn(c.written("optimizer.params.adam_w_mode"), "AdamW always decouples weight decay; false is ignored",
           "use \"type\": \"Adam\" with adam_w_mode false for L2 regularization");
    opt.adam_w_mode = true;
  }
  if (opt.type == OptimizerType::kAdamW) opt.adam_w_mode = true;
}

void check_scheduler(Checker& c, Config& config) {
  auto& sched = config.scheduler;
  if (!c.present("scheduler")) return;
  if (!c.present("scheduler.type")) {
    c.error(c.written("scheduler") + ".type", "the scheduler section has no type",
            "add \"type\": \"WarmupLR\" (or WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)");
    return;
  }
  const std::string_view type = scheduler_type_name(sched.type);
  if (sched.type == SchedulerType::kNone) {
    if (c.present("scheduler.params")) {
      c.warn(c.written("scheduler.params"), "ignored: scheduler.type is none", "");
    }
    sched.params = json::object();
    return;
  }
  check_params_belong(c, "scheduler.params", "scheduler.type", type);
  for (const ConfigKey& key : config_keys()) {
    if (key.parent() != "scheduler.params" || key.type == KeyType::kSection) continue;
    if (!key.applies_to.empty() && !type_listed(key.applies_to, type)) continue;
    const std::string name(key.name());
    if (sched.params.contains(name)) continue;
    const std::string path(key.path);
    if (c.is_auto(path)) {
      sched.params[name] = key.default_value();
      continue;
    }
    if (key.has(kKeyRequired)) {
      c.error(fmt::format("{}.{}", c.present("scheduler.params") ? c.written("scheduler.params") : "scheduler.params", name),
              fmt::format("required by {} but not given", type),
              name == "total_num_steps" ? "set it to the number of optimizer steps of the run"
                                        : "set it (see docs/config.md)");
      continue;
    }
    sched.params[name] = key.default_value();
  }
  const json& p = sched.params;
  if ((sched.type == SchedulerType::kWarmupDecayLR || sched.type == SchedulerType::kWarmupCosineLR) &&
      p.contains("total_num_steps") && p["total_num_steps"].is_number() && p.contains("warmup_num_steps") &&
      p["warmup_num_steps"].is_number() && !c.is_auto("scheduler.params.total_num_steps") &&
      p["total_num_steps"].get<double>() < p["warmup_num_steps"].get<double>()) {
    c.error(c.written("scheduler.params.total_num_steps"),
            fmt::format("total_num_steps {} is shorter than warmup_num_steps {}", p["total_num_steps"].dump(),
                        p["warmup_num_steps"].dump()),
            "make total_num_steps at least warmup_num_steps");
  }
  if (sched.type == SchedulerType::kOneCycle && p.contains("cycle_min_lr") && p.contains("cycle_max_lr") &&
      p["cycle_min_lr"].is_number() && p["cycle_max_lr"].is_number() &&
      p["cycle_min_lr"].get<double>() > p["cycle_max_lr"].get<double>()) {
    c.error(c.written("scheduler.params.cycle_min_lr"), "cycle_min_lr is above cycle_max_lr", "swap the two values");
  }
}

void check_precision(Checker& c, Config& config) {
  if (config.fp16.enabled && config.bf16.enabled) {
    c.error(c.written("bf16.enabled"), "fp16 and bf16 are both enabled",
            "enable only one of them: bf16 (no loss scaling needed) or fp16 (with the loss scaler)");
  }
  if (config.ignored.contains("amp.enabled") && config.ignored["amp.enabled"] == true) {
    c.error(c.written("amp.enabled"), "apex AMP is not supported by Strata",
            "remove the amp section and enable bf16 (or fp16 with loss scaling) instead");
  }
  if (config.fp16.fp16_master_weights_and_grads && !config.fp16.enabled) {
    c.warn(c.written("fp16.fp16_master_weights_and_grads"), "has no effect: fp16 is not enabled", "");
  }
  if (config.precision() == TrainPrecision::kFp32 && config.strata.optimizer_state_dtype == "bf16") {
    c.warn(c.written("strata.optimizer_state_dtype"), "bf16 optimizer states with fp32 training",
           "this saves memory but loses precision in m and v; usually used with bf16.enabled");
  }
  if (config.strata.gradient_shards == "nvme") {
    // Note [Gradient shards on NVMe] (offload/src/gradient_spill.h): they
    // wait in the optimizer state's folder, or the parameter shards' with the
    // state in host memory; the state is stepped on the host, whole.
    const OffloadOptimizerConfig& offload = config.zero_optimization.offload_optimizer;
    const OffloadDevice param = config.zero_optimization.offload_param.device;
    const Placement chosen = placement_of(config.zero_optimization);
    if (!chosen.optimizer_offloaded() || !chosen.uses_nvme())
      c.error(c.written("strata.gradient_shards"),
              fmt::format("gradient shards on NVMe wait in the optimizer state's folder or the parameter shards'; "
                          "zero_optimization.offload_optimizer.device is {} and offload_param.device is {}",
                          offload_device_name(offload.device), offload_device_name(param)),
              "set zero_optimization.offload_optimizer.device to \"nvme\" (or \"cpu\" with offload_param.device "
              "\"nvme\" at stage 3), or strata.gradient_shards to \"auto\" or \"pinned\"");
    else if (offload.ratio < 1.0)
      c.error(c.written("strata.gradient_shards"),
              fmt::format("gradient shards on NVMe with zero_optimization.offload_optimizer.ratio {}: part of each "
                          "piece is stepped on the device, from a device gradient",
                          offload.ratio),
              "set offload_optimizer.ratio to 1, or strata.gradient_shards to \"auto\" or \"pinned\"");
  }
  if (config.strata.optimizer_state_dtype == "int8") {
    // The block-wise 8-bit moments are a CPU kernel format (cpu_adam): the
    // state must be stepped on the host, by Adam or AdamW.
    const OffloadOptimizerConfig& offload = config.zero_optimization.offload_optimizer;
    if (!placement_of(config.zero_optimization).optimizer_offloaded())
      c.error(c.written("strata.optimizer_state_dtype"),
              "int8 optimizer states are for offloaded state; zero_optimization.offload_optimizer.device is none",
              "set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\" (stage 1-3), or use bf16 "
              "states on the device");
    else if (offload.ratio < 1.0)
      c.error(c.written("strata.optimizer_state_dtype"),
              fmt::format("int8 optimizer states with zero_optimization.offload_optimizer.ratio {} keep part of the "
                          "state on the device, which has no int8 kernel",
                          offload.ratio),
              "set offload_optimizer.ratio to 1, or use bf16 states");
    if (config.optimizer.given &&
        (config.optimizer.type == OptimizerType::kAdagrad || config.optimizer.type == OptimizerType::kLion))
      c.error(c.written("strata.optimizer_state_dtype"),
              fmt::format("int8 optimizer states are implemented for Adam and AdamW, not optimizer.type {}",
                          config.optimizer.type == OptimizerType::kAdagrad ? "Adagrad" : "Lion"),
              "use fp32 or bf16 states with this optimizer");
  }
}

}  // namespace

void resolve(Checker& c, Config& config) {
  config.world_size = c.options.world_size;
  if (c.options.world_size < 1) {
    c.error("", fmt::format("world size {} is not a positive number of ranks", c.options.world_size),
            "pass --world-size N with N >= 1");
    config.world_size = 1;
  }
  resolve_autos(c, config);
  resolve_batch(c, config);
  check_offload(c, config);
  warn_keys_without_effect(c, config);
  check_optimizer(c, config);
  check_scheduler(c, config);
  check_precision(c, config);
}

}  // namespace config_detail

nlohmann::ordered_json config_to_json(const Config& config) {
  using nlohmann::ordered_json;
  ordered_json root = ordered_json::object();
  auto slot = [&root](std::string_view path) -> ordered_json& {
    ordered_json* node = &root;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part(path.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
      node = &(*node)[part];
      if (dot == std::string_view::npos) return *node;
      start = dot + 1;
    }
  };
  const std::string_view opt_type = optimizer_type_name(config.optimizer.type);
  for (const ConfigKey& key : config_keys()) {
    if (key.type == KeyType::kSection || key.has(kKeyDeprecated)) continue;
    const std::string path(key.path);
    if (key.has(kKeyIgnored)) {
      if (config.ignored.contains(path)) slot(path) = config.ignored[path];
      continue;
    }
    if (key.parent() == "scheduler.params") {
      const std::string name(key.name());
      if (config.scheduler.type != SchedulerType::kNone && config.scheduler.params.contains(name)) {
        slot(path) = config.is_unresolved(path) ? ordered_json("auto")
                                                : ordered_json::parse(config.scheduler.params[name].dump());
      }
      continue;
    }
    if (key.parent() == "optimizer.params" && !key.applies_to.empty() &&
        !config_detail::type_listed(key.applies_to, opt_type)) {
      continue;
    }
    if (key.get == nullptr) continue;
    slot(path) = config.is_unresolved(path) ? ordered_json("auto") : ordered_json::parse(key.get(config).dump());
  }
  return root;
}

}  // namespace strata
