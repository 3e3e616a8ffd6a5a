// Fitting a DeepSpeed config to memory caps: Note [Config fit] in config_fit.h.
#include "strata/offload/config_fit.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include <fmt/format.h>

#include "strata/core/estimator.h"
#include "strata/core/printable.h"
#include "strata/core/spec_model.h"
#include "strata/core/units.h"
#include "strata/offload/nvme_state_tier.h"
#include "strata/offload/partition.h"

namespace strata::offload {
namespace {

// A candidate: the stage and offload devices (asked like the engine asks
// them, Note [Placement questions]) and offload_optimizer.ratio.
struct PlacementChoice : Placement {
  double ratio = 1.0;
};

// Every placement the engine runs, in a fixed order (the last tie-break).
std::vector<PlacementChoice> all_placements() {
  using D = OffloadDevice;
  std::vector<PlacementChoice> out{{{0, D::kNone, D::kNone}, 1.0}};
  for (int stage : {1, 2})
    for (D opt : {D::kNone, D::kCpu, D::kNvme}) out.push_back({{stage, opt, D::kNone}, 1.0});
  for (D opt : {D::kNone, D::kCpu, D::kNvme})
    for (D param : {D::kNone, D::kCpu, D::kNvme})
      if (param == D::kNone || opt != D::kNone) out.push_back({{3, opt, param}, 1.0});
  for (double r : {0.75, 0.5, 0.25}) out.push_back({{3, D::kCpu, D::kNone}, r});
  return out;
}

// `grad`: the gradient dtype the candidate sets (nullopt: the config's own).
std::string label_of(const PlacementChoice& p, DType dtype, const cpu_adam::MomentStorage& moments,
                     std::optional<DType> grad = std::nullopt) {
  std::string s = fmt::format("s{} opt={} param={}", p.stage, offload_device_name(p.optimizer),
                              offload_device_name(p.param));
  if (p.ratio < 1.0) s += fmt::format(" r={:.2f}", p.ratio);
  s += " " + std::string(dtype_name(dtype));
  if (moments != cpu_adam::MomentStorage::fp32()) s += fmt::format(" m={}", moments.name());
  if (grad && *grad != dtype) s += fmt::format(" g={}", dtype_name(*grad));
  return s;
}

// 8-bit moments are stepped by the CPU kernels only: offloaded state, no device part.
bool holds(const PlacementChoice& p, const cpu_adam::MomentStorage& moments) {
  return !moments.blocked() || (p.optimizer_offloaded() && p.ratio >= 1.0);
}

// The config's own storage (validated by the config check).
cpu_adam::MomentStorage own_moments(const Config& c) {
  Result<cpu_adam::MomentStorage> m = cpu_adam::MomentStorage::parse(c.strata.optimizer_state_dtype, "");
  return m.ok() ? *m : cpu_adam::MomentStorage::fp32();
}

std::vector<LayerSpec> retyped(const std::vector<LayerSpec>& layers, DType dtype) {
  std::vector<LayerSpec> out = layers;
  for (LayerSpec& l : out) {
    for (ParamTensorSpec& t : l.params) {
      t.dtype = dtype;
      t.offset_bytes = t.offset_elements * dtype_size(dtype);
    }
    l.param_bytes = l.param_count * dtype_size(dtype);
  }
  return out;
}

void set_precision(Config& c, DType dtype) {
  c.bf16.enabled = dtype == DType::kBF16;
  c.fp16.enabled = dtype == DType::kF16;
}

// What one evaluation of a config says, worst rank.
struct Evaluation {
  Status status = Status::Ok();
  FitMemory memory;
  uint64_t largest_nvme_shard_elements = 0;
  uint64_t largest_gathered_elements = 0;  // stage-3 layers gathered for use: the live cap's floor
  uint64_t largest_grad_elements = 0;      // per-step gradient buffers: the bucket's floor
  uint64_t persistent_params = 0;          // stage 3: padded elements kept whole
  bool gradients_on_nvme = false;          // Note [Gradient shards on NVMe] (auto: where pinned ones do not fit)
  bool device_ok = false, host_ok = false, nvme_ok = false;
  bool fits() const { return status.ok() && device_ok && host_ok && nvme_ok; }
};

class Evaluator {
 public:
  Evaluator(const FitRequest& req, const FitCaps& caps, const std::vector<LayerSpec>& layers, DType dtype)
      : req_(req), caps_(caps), layers_(layers), dtype_(dtype) {}

  // `all_ranks`: every rank (the final check), as one rank of each run of
  // ranks with the same pieces (Partition::distinct_ranks: what is taken
  // here, the largest over ranks, is the same over a run); else the first
  // and the last.
  Evaluation run(const Config& cfg, bool all_ranks) const {
    Evaluation e;
    Result<EngineOptions> o = engine_options_from_config(cfg);
    if (!o.ok()) {
      e.status = o.status();
      return e;
    }
    o->grad_accum = req_.grad_accum;
    // Each rank's share of the host cap, as strata train gives it: early
    // updates (strata.speculative_optimizer auto) keep their pending state buffers only
    // where it fits (Note [Early, exact updates]).
    if (caps_.host_bytes != 0) o->host_memory_budget = host_share();
    Result<Partition> part = Partition::create(layers_, req_.world, o->sub_group_size);
    if (!part.ok()) {
      e.status = part.status();
      return e;
    }
    std::vector<int> ranks;
    if (all_ranks) {
      ranks = part->distinct_ranks();
    } else if (req_.world <= 2) {
      for (int r = 0; r < req_.world; ++r) ranks.push_back(r);
    } else {
      ranks = {0, req_.world - 1};
    }
    e.memory.device_engine = 0;
    for (int r : ranks) {
      Result<StatePlacement> pl = StatePlacement::compute(*o, layers_, *part, r, req_.device);
      if (!pl.ok()) {
        e.status = pl.status();
        return e;
      }
      const EngineMemory m = plan_engine_memory(*o, *part, *pl);
      e.gradients_on_nvme = e.gradients_on_nvme || pl->gradient_slot_count != 0;
      uint64_t param_nvme = 0, grads_total = 0, grads_largest = 0, gathered_total = 0, gathered_largest = 0;
      for (size_t li = 0; li < part->layer_count(); ++li) {
        const LayerPlacement& where = pl->layers[li];
        const LayerPartition& lp = part->layer(li);
        if (where.shard_on_nvme()) {
          param_nvme += lp.shard_elements * where.param_element_bytes;
          e.largest_nvme_shard_elements = std::max<uint64_t>(e.largest_nvme_shard_elements, lp.shard_elements);
        }
        if (!where.persistent() && !where.acquired_in_place) {
          e.largest_gathered_elements = std::max<uint64_t>(e.largest_gathered_elements, lp.padded_elements);
          const uint64_t b = pl->device_footprint(lp.padded_elements * where.param_element_bytes);
          gathered_total += b;
          gathered_largest = std::max(gathered_largest, b);
        }
        if (where.gradients == GradientBuffer::kPerStep) {
          e.largest_grad_elements = std::max<uint64_t>(e.largest_grad_elements, lp.padded_elements);
          const uint64_t b = pl->device_footprint(lp.padded_elements * dtype_size(o->grad_dtype));
          grads_total += b;
          grads_largest = std::max(grads_largest, b);
        }
        if (r == 0 && pl->params_sharded() && where.persistent()) e.persistent_params += lp.padded_elements;
      }
      // The NVMe stores' room (nvme_state_tier.cpp, param_swap.cpp): the
      // optimizer state's two versions, one more state's worth and a slot
      // per write in flight plus one; the parameter shards twice and a slot.
      uint64_t nvme = 0;
      if (pl->optimizer_on_nvme()) {
        const uint64_t state = (m.nvme - param_nvme - pl->gradient_nvme_bytes) / 2;
        const uint64_t slot = m.pinned_optimizer / static_cast<uint64_t>(std::max<int64_t>(1, o->nvme.buffer_count));
        nvme += 3 * state + (static_cast<uint64_t>(o->nvme.buffer_count) + 1) * slot;
      }
      if (param_nvme != 0) nvme += 2 * param_nvme + std::max<uint64_t>(pl->largest_nvme_shard_bytes, 4096);
      // Gradient shards on NVMe (gradient_spill.cpp): two copies and the slots' worth.
      nvme += 2 * pl->gradient_nvme_bytes + pl->gradient_slot_count * pl->gradient_slot_bytes;
      // Note [Room beside the caps]: the plan bounds gradients by
      // reduce_bucket_size and gathered layers by stage3_max_live_parameters
      // (never below one layer), but measured runs hold more when a cap
      // binds: a layer the model uses twice in the backward (a tied
      // embedding: the LM head at its start, the embedding at its end)
      // keeps its gradient beside the bucket the whole backward, and a
      // gathered copy dropped for room is freed only once the pass that
      // used it has run (tiny GPT, caps at their floors: +200 KiB of
      // gradient and up to +196 KiB of gathered copies past the plan,
      // varying run to run). So a binding cap gets room for one more of its
      // largest layer; a cap that does not bind needs none.
      uint64_t held = 0;
      if (m.device_grads < grads_total && o->grad_accum == 1) held += grads_largest;
      if (m.device_gathered < gathered_total) held += gathered_largest;
      e.memory.device_engine = std::max(e.memory.device_engine, m.device + held);
      e.memory.pinned = std::max(e.memory.pinned, m.pinned);
      e.memory.nvme = std::max(e.memory.nvme, nvme);
    }
    const uint64_t reserve = req_.device_reserve ? req_.device_reserve(dtype_, o->grad_dtype, req_.micro_batch) : 0;
    e.memory.device = e.memory.device_engine + reserve;
    e.device_ok = e.memory.device <= caps_.device_bytes;
    e.host_ok = e.memory.pinned <= host_share();
    e.nvme_ok = e.memory.nvme == 0 ||
                (caps_.nvme_bytes && e.memory.nvme * static_cast<uint64_t>(caps_.ranks_per_node) <= *caps_.nvme_bytes);
    return e;
  }

  uint64_t host_share() const { return caps_.host_bytes / static_cast<uint64_t>(std::max(1, caps_.ranks_per_node)); }

 private:
  const FitRequest& req_;
  const FitCaps& caps_;
  const std::vector<LayerSpec>& layers_;
  DType dtype_;
};

// Lowers `knob` (now `current`) to the largest value in [floor, current]
// for which `ok` holds; when none does, to `floor`. Returns whether `ok` holds after.
template <typename Ok>
bool lower_knob(int64_t& knob, int64_t floor, Ok ok) {
  if (ok()) return true;
  const int64_t current = knob;
  if (floor >= current) return false;
  knob = floor;
  if (!ok()) return false;
  int64_t lo = floor, hi = current;  // ok(lo), !ok(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    knob = mid;
    if (ok()) lo = mid;
    else hi = mid;
  }
  knob = lo;
  return true;
}

std::string bytes(uint64_t b) { return format_bytes(b, true); }

std::string shortfall(const Evaluation& e, const FitCaps& caps, uint64_t host_share) {
  if (!e.status.ok()) return e.status.message();
  std::vector<std::string> parts;
  if (!e.device_ok && e.memory.device == e.memory.device_engine)
    parts.push_back(fmt::format("device needs {} per rank, the cap is {}", bytes(e.memory.device),
                                bytes(caps.device_bytes)));
  else if (!e.device_ok)
    parts.push_back(fmt::format("device needs {} per rank (engine {} + the model's own buffers {}), the cap is {}",
                                bytes(e.memory.device), bytes(e.memory.device_engine),
                                bytes(e.memory.device - e.memory.device_engine), bytes(caps.device_bytes)));
  if (!e.host_ok)
    parts.push_back(fmt::format("host needs {} of pinned memory per rank, the cap's share is {}",
                                bytes(e.memory.pinned), bytes(host_share)));
  if (!e.nvme_ok) {
    const uint64_t need = e.memory.nvme * static_cast<uint64_t>(caps.ranks_per_node);
    if (caps.nvme_bytes)
      parts.push_back(fmt::format("NVMe needs {}, {} has {} free", bytes(need),
                                  caps.nvme_path.empty() ? std::string("the NVMe folder") : printable(caps.nvme_path, 200),
                                  bytes(*caps.nvme_bytes)));
    else
      parts.push_back(fmt::format("NVMe needs {} and no NVMe folder was given", bytes(need)));
  }
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

std::string bound_of(const Evaluation& e, const FitCaps& caps, uint64_t host_share, const StepTimePrediction& p) {
  const double dev = caps.device_bytes ? static_cast<double>(e.memory.device) / caps.device_bytes : 0;
  const double host = host_share ? static_cast<double>(e.memory.pinned) / host_share : 0;
  const double nvme = caps.nvme_bytes && *caps.nvme_bytes
                          ? static_cast<double>(e.memory.nvme * caps.ranks_per_node) / *caps.nvme_bytes
                          : 0;
  std::pair<double, const char*> tiers[] = {{dev, "device"}, {host, "host"}, {nvme, "NVMe"}};
  const auto* tight = &tiers[0];
  for (const auto& t : tiers)
    if (t.first > tight->first) tight = &t;
  return fmt::format("{} at {:.0f}% of its cap; the step waits on {}", tight->second, 100 * tight->first, p.bound);
}

// The keys a fit may change, read as DeepSpeed writes them.
struct KeyView {
  const char* path;
  std::string (*get)(const Config&);
};
std::string num(int64_t v) { return fmt::format("{}", v); }
std::string boolean(bool v) { return v ? "true" : "false"; }
std::string json_string(std::string_view v) { return fmt::format("\"{}\"", printable(v, 200)); }
const KeyView kKeys[] = {
    {"zero_optimization.stage", [](const Config& c) -> std::string { return num(c.zero_optimization.stage); }},
    {"zero_optimization.offload_optimizer.device",
     [](const Config& c) -> std::string { return json_string(offload_device_name(c.zero_optimization.offload_optimizer.device)); }},
    {"zero_optimization.offload_optimizer.ratio",
     [](const Config& c) -> std::string { return fmt::format("{:g}", c.zero_optimization.offload_optimizer.ratio); }},
    {"zero_optimization.offload_param.device",
     [](const Config& c) -> std::string { return json_string(offload_device_name(c.zero_optimization.offload_param.device)); }},
    {"bf16.enabled", [](const Config& c) -> std::string { return boolean(c.bf16.enabled); }},
    {"strata.optimizer_state_dtype", [](const Config& c) -> std::string { return json_string(c.strata.optimizer_state_dtype); }},
    {"data_types.grad_accum_dtype",
     [](const Config& c) -> std::string {
       return c.data_types.grad_accum_dtype.empty() ? std::string("null") : json_string(c.data_types.grad_accum_dtype);
     }},
    {"fp16.enabled", [](const Config& c) -> std::string { return boolean(c.fp16.enabled); }},
    {"zero_optimization.offload_optimizer.nvme_path",
     [](const Config& c) -> std::string { return json_string(c.zero_optimization.offload_optimizer.nvme_path); }},
    {"zero_optimization.offload_param.nvme_path",
     [](const Config& c) -> std::string { return json_string(c.zero_optimization.offload_param.nvme_path); }},
    {"zero_optimization.reduce_bucket_size", [](const Config& c) -> std::string { return num(c.zero_optimization.reduce_bucket_size); }},
    {"zero_optimization.stage3_max_live_parameters",
     [](const Config& c) -> std::string { return num(c.zero_optimization.stage3_max_live_parameters); }},
    {"zero_optimization.stage3_prefetch_bucket_size",
     [](const Config& c) -> std::string { return num(c.zero_optimization.stage3_prefetch_bucket_size); }},
    {"zero_optimization.sub_group_size", [](const Config& c) -> std::string { return num(c.zero_optimization.sub_group_size); }},
    {"zero_optimization.offload_optimizer.buffer_count",
     [](const Config& c) -> std::string { return num(c.zero_optimization.offload_optimizer.buffer_count); }},
    {"zero_optimization.offload_optimizer.pipeline_read",
     [](const Config& c) -> std::string { return boolean(c.zero_optimization.offload_optimizer.pipeline_read); }},
    {"zero_optimization.offload_optimizer.pipeline_write",
     [](const Config& c) -> std::string { return boolean(c.zero_optimization.offload_optimizer.pipeline_write); }},
    {"zero_optimization.offload_param.buffer_count",
     [](const Config& c) -> std::string { return num(c.zero_optimization.offload_param.buffer_count); }},
    {"zero_optimization.offload_param.buffer_size",
     [](const Config& c) -> std::string { return num(c.zero_optimization.offload_param.buffer_size); }},
    {"zero_optimization.offload_param.max_in_cpu",
     [](const Config& c) -> std::string { return num(c.zero_optimization.offload_param.max_in_cpu); }},
    {"train_micro_batch_size_per_gpu",
     [](const Config& c) -> std::string { return c.batch.train_micro_batch_size_per_gpu ? num(*c.batch.train_micro_batch_size_per_gpu) : std::string("unset"); }},
    {"gradient_accumulation_steps",
     [](const Config& c) -> std::string { return c.batch.gradient_accumulation_steps ? num(*c.batch.gradient_accumulation_steps) : std::string("unset"); }},
    {"train_batch_size",
     [](const Config& c) -> std::string { return c.batch.train_batch_size ? num(*c.batch.train_batch_size) : std::string("unset"); }},
    {"strata.gradient_shards", [](const Config& c) -> std::string { return json_string(c.strata.gradient_shards); }},
    {"strata.device_memory", [](const Config& c) -> std::string { return num(static_cast<int64_t>(c.strata.device_memory)); }},
    {"strata.host_memory_budget",
     [](const Config& c) -> std::string { return num(static_cast<int64_t>(c.strata.host_memory_budget)); }},
};

bool is_placement_key(const std::string& key) {
  return key == "zero_optimization.stage" || key == "zero_optimization.offload_optimizer.device" ||
         key == "zero_optimization.offload_optimizer.ratio" || key == "zero_optimization.offload_param.device" ||
         key == "bf16.enabled" || key == "fp16.enabled" || key == "strata.optimizer_state_dtype";
}

std::vector<FitChange> diff(const Config& before, const Config& after, const std::map<std::string, std::string>& why) {
  std::vector<FitChange> out;
  for (const KeyView& k : kKeys) {
    const std::string a = k.get(before), b = k.get(after);
    if (a == b) continue;
    auto it = why.find(k.path);
    out.push_back({k.path, a, b, it != why.end() ? it->second : std::string()});
  }
  return out;
}

StepTimeInput step_input(const FitRequest& req, const Config& cfg, const EngineOptions& o, DType dtype,
                         const Evaluation& e) {
  StepTimeInput in;
  for (const LayerSpec& l : req.layers) in.params += l.param_count;
  in.layers = static_cast<int>(std::max<size_t>(1, req.layers.size()));
  in.world = req.world;
  in.tokens_per_rank = static_cast<double>(req.micro_batch) * req.seq * req.grad_accum;
  in.flops_per_token = req.flops_per_token;
  in.placement = o.placement();
  in.ratio = o.ratio;
  in.param_dtype = dtype;
  in.grad_dtype = o.grad_dtype;
  in.moments = o.moments;
  in.max_live_parameters = o.max_live_parameters;
  in.persistent_params = e.persistent_params;
  in.max_in_cpu = o.nvme_param.max_in_cpu;
  in.nvme_pipeline = cfg.zero_optimization.offload_optimizer.pipeline_read &&
                     cfg.zero_optimization.offload_optimizer.pipeline_write;
  in.speculation = o.speculative_optimizer;
  in.gradients_on_nvme = e.gradients_on_nvme;
  return in;
}

// The user's config with the request's batch and the caps written in, the
// base every candidate starts from.
Config base_config(const FitRequest& req, const FitCaps& caps) {
  Config c = req.config;
  c.batch.train_micro_batch_size_per_gpu = req.micro_batch;
  c.batch.gradient_accumulation_steps = req.grad_accum;
  c.batch.train_batch_size = static_cast<int64_t>(req.micro_batch) * req.grad_accum * req.world;
  c.strata.device_memory = caps.device_bytes;
  c.strata.host_memory_budget = caps.host_bytes;
  // The batch keys are set now, "auto" or not.
  std::erase_if(c.unresolved, [](const std::string& path) {
    return path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" || path == "gradient_accumulation_steps";
  });
  return c;
}

using Reasons = std::map<std::string, std::string>;  // why each key changed, by its path

// The base config with the candidate's placement, dtypes and moment storage
// set, and what NVMe needs: the folder the fit was given, overlapped I/O.
Config placed_config(const FitRequest& req, const FitCaps& caps, const PlacementChoice& p, DType dtype,
                     const cpu_adam::MomentStorage& moments, std::optional<DType> grad, Reasons& why) {
  Config c = base_config(req, caps);
  auto& z = c.zero_optimization;
  z.stage = p.stage;
  z.offload_optimizer.device = p.optimizer;
  z.offload_param.device = p.param;
  z.offload_optimizer.ratio = p.ratio;
  set_precision(c, dtype);
  c.strata.optimizer_state_dtype = std::string(moments.name());
  if (grad) {
    c.data_types.grad_accum_dtype = std::string(dtype_name(*grad));
    why["data_types.grad_accum_dtype"] = "gradients in the dtype the fit was allowed (--grad-dtypes) and that fits";
  }
  if (p.optimizer_on_nvme() && z.offload_optimizer.nvme_path.empty()) {
    z.offload_optimizer.nvme_path = caps.nvme_path;
    why["zero_optimization.offload_optimizer.nvme_path"] = "the NVMe folder the fit was given";
  }
  if (p.params_on_nvme() && z.offload_param.nvme_path.empty()) {
    z.offload_param.nvme_path = caps.nvme_path;
    why["zero_optimization.offload_param.nvme_path"] = "the NVMe folder the fit was given";
  }
  if (p.optimizer_on_nvme() &&
      !(z.offload_optimizer.pipeline_read && z.offload_optimizer.pipeline_write)) {
    z.offload_optimizer.pipeline_read = z.offload_optimizer.pipeline_write = true;
    const char* r = "the optimizer state's NVMe reads and writes overlap its step (the step-time model's nvme_pipeline)";
    why["zero_optimization.offload_optimizer.pipeline_read"] = r;
    why["zero_optimization.offload_optimizer.pipeline_write"] = r;
  }
  return c;
}

// The host: the NVMe slots first (no cost in the model), then what stays in host memory.
void fit_host(Config& c, const PlacementChoice& p, const Evaluator& eval, int world, Reasons& why) {
  auto& z = c.zero_optimization;
  auto host_ok = [&] { return eval.run(c, false).host_ok; };
  const int64_t min_sub = static_cast<int64_t>(kShardAlign) * world;
  if (!host_ok() && p.optimizer_on_nvme() && z.offload_optimizer.buffer_count > 2) {
    const int64_t was = z.offload_optimizer.buffer_count;
    lower_knob(z.offload_optimizer.buffer_count, 2, host_ok);
    if (z.offload_optimizer.buffer_count != was)
      why["zero_optimization.offload_optimizer.buffer_count"] =
          "each slot pins one sub-group's optimizer state: fewer slots fit the host cap (2 still overlap a read "
          "with a step)";
  }
  if (!host_ok() && p.params_on_nvme() && z.offload_param.buffer_count > 2) {
    lower_knob(z.offload_param.buffer_count, 2, host_ok);
    why["zero_optimization.offload_param.buffer_count"] =
        "each slot pins the largest NVMe shard: fewer slots fit the host cap";
  }
  if (!host_ok() && p.optimizer_on_nvme() && z.sub_group_size > min_sub) {
    lower_knob(z.sub_group_size, min_sub, host_ok);
    why["zero_optimization.sub_group_size"] =
        "an NVMe slot holds one sub-group's master weights and moments: smaller sub-groups make the pinned slots "
        "fit the host cap";
  }
  if (!host_ok() && p.params_on_nvme() && z.offload_param.max_in_cpu > 0) {
    lower_knob(z.offload_param.max_in_cpu, 0, host_ok);
    why["zero_optimization.offload_param.max_in_cpu"] =
        "the shards kept in pinned host memory must fit the host cap beside the other host buffers; the rest are "
        "read from NVMe";
  }
  if (!host_ok() && p.optimizer_on_nvme() && z.offload_optimizer.buffer_count > 1) {
    lower_knob(z.offload_optimizer.buffer_count, 1, host_ok);
    why["zero_optimization.offload_optimizer.buffer_count"] =
        "one slot is all the host cap leaves room for (reads no longer overlap the step)";
  }
  if (!host_ok() && p.params_on_nvme() && z.offload_param.buffer_count > 1) {
    lower_knob(z.offload_param.buffer_count, 1, host_ok);
    why["zero_optimization.offload_param.buffer_count"] = "one slot is all the host cap leaves room for";
  }
}

// The device's first knob: the gradient bucket (no cost in the model).
void lower_gradient_bucket(Config& c, const PlacementChoice& p, const Evaluator& eval, int grad_accum, Reasons& why) {
  auto& z = c.zero_optimization;
  const Evaluation e = eval.run(c, false);
  if (e.device_ok || !p.gradients_sharded() || grad_accum != 1 || e.largest_grad_elements == 0) return;
  const int64_t floor = static_cast<int64_t>(e.largest_grad_elements);
  if (z.reduce_bucket_size <= floor) return;
  lower_knob(z.reduce_bucket_size, floor, [&] { return eval.run(c, false).device_ok; });
  why["zero_optimization.reduce_bucket_size"] =
      "the bucket must fit the device beside the live layers (never below the largest layer)";
}

// The device's next knob: the live gathered layers.
void lower_live_parameters(Config& c, const PlacementChoice& p, const Evaluator& eval, Reasons& why) {
  auto& z = c.zero_optimization;
  const Evaluation e = eval.run(c, false);
  if (e.device_ok || !p.params_sharded() || e.largest_gathered_elements == 0) return;
  const int64_t floor = static_cast<int64_t>(e.largest_gathered_elements);
  if (z.stage3_max_live_parameters <= floor) return;
  lower_knob(z.stage3_max_live_parameters, floor, [&] { return eval.run(c, false).device_ok; });
  why["zero_optimization.stage3_max_live_parameters"] =
      "the gathered layers must fit the device beside the gradients (never below the largest layer)";
}

// Layers below the persistence threshold stay whole on the device: partition them too.
void partition_small_layers(Config& c, const PlacementChoice& p, const Evaluator& eval, int world, Reasons& why) {
  auto& z = c.zero_optimization;
  auto device_ok = [&] { return eval.run(c, false).device_ok; };
  if (device_ok() || !p.params_sharded() || z.stage3_param_persistence_threshold <= 0) return;
  lower_knob(z.stage3_param_persistence_threshold, 0, device_ok);
  why["zero_optimization.stage3_param_persistence_threshold"] =
      "the layers below it stay whole on the device and do not fit beside the rest; partitioned, they are "
      "gathered for each use";
  lower_live_parameters(c, p, eval, why);
  fit_host(c, p, eval, world, why);  // partitioned shards go to host memory under offload_param.max_in_cpu
}

void cap_prefetch_bucket(Config& c, const PlacementChoice& p, Reasons& why) {
  auto& z = c.zero_optimization;
  if (!p.params_sharded() || z.stage3_prefetch_bucket_size <= z.stage3_max_live_parameters) return;
  z.stage3_prefetch_bucket_size = z.stage3_max_live_parameters;
  why["zero_optimization.stage3_prefetch_bucket_size"] =
      "the prefetch window cannot hold more than stage3_max_live_parameters";
}

// The parameter slots must hold the largest shard left on NVMe.
void size_parameter_slots(Config& c, const PlacementChoice& p, const Evaluator& eval, Reasons& why) {
  auto& slots = c.zero_optimization.offload_param;
  const Evaluation e = eval.run(c, false);
  if (!p.params_on_nvme() || e.largest_nvme_shard_elements == 0 ||
      static_cast<uint64_t>(slots.buffer_size) >= e.largest_nvme_shard_elements)
    return;
  slots.buffer_size = static_cast<int64_t>(e.largest_nvme_shard_elements);
  why["zero_optimization.offload_param.buffer_size"] =
      "a parameter slot must hold the largest shard on NVMe (the engine refuses a smaller one)";
}

// The keys base_config wrote from the request and the caps.
void explain_request_keys(Reasons& why) {
  why["strata.device_memory"] = "the device cap the fit was made for (strata train runs under it)";
  why["strata.host_memory_budget"] = "the host cap the fit was made for (strata train refuses a plan above it)";
  why["train_micro_batch_size_per_gpu"] = why["gradient_accumulation_steps"] = why["train_batch_size"] =
      "the batch the fit was made for";
}

// Gradient shards on NVMe (auto's choice under the host cap): written out,
// so the config says where they wait and why.
void write_gradient_shards(Config& c, const Evaluation& final_check, Reasons& why) {
  if (!final_check.status.ok() || !final_check.gradients_on_nvme || c.strata.gradient_shards != "auto") return;
  c.strata.gradient_shards = "nvme";
  why["strata.gradient_shards"] =
      "the reduced gradient shards do not fit the host cap in pinned memory: they wait on NVMe, in the optimizer "
      "state's folder or the parameter shards' (one more write and read of each gradient per step)";
}

// The fitted config's candidate: its memory, options and predicted step,
// and what bounds it (fits) or what it lacks (does not).
FitCandidate finished_candidate(FitCandidate cand, const FitRequest& req, const FitCaps& caps, const Evaluator& eval,
                                const Config& c, const Evaluation& e, DType dtype, const Reasons& why) {
  cand.config = c;
  cand.memory = e.memory;
  cand.fits = e.fits();
  if (!e.status.ok()) {
    cand.bound = e.status.message();
    return cand;
  }
  Result<EngineOptions> o = engine_options_from_config(c);
  if (!o.ok()) {
    cand.fits = false;
    cand.bound = o.status().message();
    return cand;
  }
  o->grad_accum = req.grad_accum;
  cand.options = *o;
  Result<StepTimePrediction> pr = predict_step_time(step_input(req, c, *o, dtype, e), req.profile);
  if (pr.ok()) cand.predicted = *pr;
  else cand.fits = false;
  cand.bound = !pr.ok()                 ? pr.status().message()
               : cand.fits              ? bound_of(e, caps, eval.host_share(), *pr)
                                        : shortfall(e, caps, eval.host_share());
  cand.changes = diff(req.config, c, why);
  return cand;
}

// One candidate: the placement, dtype and moment storage set, the knobs lowered until it fits.
FitCandidate fit_one(const FitRequest& req, const FitCaps& caps, const PlacementChoice& p, DType dtype,
                     const cpu_adam::MomentStorage& moments, std::optional<DType> grad = std::nullopt) {
  FitCandidate cand;
  cand.label = label_of(p, dtype, moments, grad);
  const std::vector<LayerSpec> layers = retyped(req.layers, dtype);
  const Evaluator eval(req, caps, layers, dtype);
  Reasons why;
  Config c = placed_config(req, caps, p, dtype, moments, grad, why);
  if (const Evaluation e = eval.run(c, false); !e.status.ok()) {
    cand.config = c;
    cand.bound = e.status.message();
    return cand;
  }
  fit_host(c, p, eval, req.world, why);
  lower_gradient_bucket(c, p, eval, req.grad_accum, why);
  lower_live_parameters(c, p, eval, why);
  partition_small_layers(c, p, eval, req.world, why);
  cap_prefetch_bucket(c, p, why);
  size_parameter_slots(c, p, eval, why);
  explain_request_keys(why);
  const Evaluation final_check = eval.run(c, true);  // every rank
  write_gradient_shards(c, final_check, why);
  return finished_candidate(std::move(cand), req, caps, eval, c, final_check, dtype, why);
}

Status check_inputs(const FitRequest& req, const FitCaps& caps) {
  if (caps.device_bytes == 0)
    return InvalidArgument("--device-memory is 0: give the device's capacity per rank, e.g. --device-memory 2GiB");
  if (caps.host_bytes == 0)
    return InvalidArgument("--host-memory is 0: give the pinned host memory the engine may use per node, e.g. "
                           "--host-memory 8GiB");
  if (caps.nvme_bytes && *caps.nvme_bytes == 0)
    return InvalidArgument("--nvme-size is 0 (or the NVMe folder has no free space): give a folder with room, or "
                           "leave NVMe out");
  if (req.world < 1 || static_cast<uint64_t>(req.world) > kMaxModeledWorld)
    return InvalidArgument(
        fmt::format("--ranks {} (the world size) is out of range (1..{})", req.world, kMaxModeledWorld));
  if (caps.ranks_per_node < 1 || caps.ranks_per_node > req.world)
    return InvalidArgument(fmt::format("ranks per node {} is not in 1..{}", caps.ranks_per_node, req.world));
  if (req.micro_batch < 1 || req.seq < 1 || req.grad_accum < 1)
    return InvalidArgument("--batch, --seq and --grad-accum must be >= 1");
  if (req.layers.empty()) return InvalidArgument("the model has no layers");
  if (!(req.flops_per_token > 0)) return InvalidArgument("the model's FLOPs per token must be > 0");
  for (DType d : req.dtypes)
    if (!is_state_float(d))
      return InvalidArgument(fmt::format("--dtype {} is not a parameter dtype (fp32, bf16, fp16)", dtype_name(d)));
  for (DType d : req.grad_dtypes)
    if (!is_state_float(d))
      return InvalidArgument(fmt::format("--grad-dtypes {} is not a gradient dtype (fp32, bf16, fp16)", dtype_name(d)));
  return Status::Ok();
}

// The search without suggestions.
FitResult search(const FitRequest& req, const FitCaps& caps) {
  std::vector<DType> dtypes = req.dtypes;
  if (dtypes.empty()) dtypes.push_back(req.config.precision_dtype());
  std::vector<cpu_adam::MomentStorage> storages = req.moment_storages;
  if (storages.empty()) storages.push_back(own_moments(req.config));
  std::vector<std::optional<DType>> grads(req.grad_dtypes.begin(), req.grad_dtypes.end());
  if (grads.empty()) grads.push_back(std::nullopt);  // the config's own
  FitResult r;
  size_t index = 0;
  std::vector<std::pair<size_t, FitCandidate>> fitting;
  for (const cpu_adam::MomentStorage& m : storages)
    for (const std::optional<DType>& g : grads)
      for (DType dt : dtypes)
        for (const PlacementChoice& p : all_placements()) {
          if ((p.uses_nvme() && !caps.nvme_bytes) || !holds(p, m)) continue;
          FitCandidate c = fit_one(req, caps, p, dt, m, g);
          if (c.fits) fitting.emplace_back(index++, std::move(c));
          else r.rejected.push_back(std::move(c)), ++index;
        }
  // The config's own placement and dtype wins a tie: keep the user's keys where they fit.
  const auto& uz = req.config.zero_optimization;
  auto own = [&](const FitCandidate& c) {
    const auto& z = c.config.zero_optimization;
    return z.stage == uz.stage && z.offload_optimizer.device == uz.offload_optimizer.device &&
           z.offload_param.device == uz.offload_param.device && z.offload_optimizer.ratio == uz.offload_optimizer.ratio &&
           c.config.precision_dtype() == req.config.precision_dtype() &&
           c.config.strata.optimizer_state_dtype == req.config.strata.optimizer_state_dtype &&
           c.config.data_types.grad_accum_dtype == req.config.data_types.grad_accum_dtype;
  };
  std::stable_sort(fitting.begin(), fitting.end(), [&](const auto& a, const auto& b) {
    if (a.second.predicted.step_ms != b.second.predicted.step_ms)
      return a.second.predicted.step_ms < b.second.predicted.step_ms;
    if (own(a.second) != own(b.second)) return own(a.second);
    if (a.second.changes.size() != b.second.changes.size()) return a.second.changes.size() < b.second.changes.size();
    return a.first < b.first;
  });
  for (auto& [i, c] : fitting) r.fitting.push_back(std::move(c));
  return r;
}

// The rejected candidate closest to fitting: the smallest largest overshoot over its caps.
const FitCandidate* closest(const FitResult& r, const FitCaps& caps) {
  const FitCandidate* best = nullptr;
  double best_over = 0;
  for (const FitCandidate& c : r.rejected) {
    if (c.memory.device == 0 && c.memory.pinned == 0) continue;  // not evaluated (an error)
    const double host_share = static_cast<double>(caps.host_bytes) / caps.ranks_per_node;
    double over = std::max(static_cast<double>(c.memory.device) / caps.device_bytes,
                           static_cast<double>(c.memory.pinned) / std::max(1.0, host_share));
    if (c.memory.nvme != 0)
      over = std::max(over, caps.nvme_bytes ? static_cast<double>(c.memory.nvme * caps.ranks_per_node) /
                                                  static_cast<double>(*caps.nvme_bytes)
                                            : 1e30);
    if (best == nullptr || over < best_over) best = &c, best_over = over;
  }
  return best;
}

// Placement keys of the winner: why not the config's own placement.
void explain_placement(FitResult& r, const FitRequest& req, const FitCaps& caps) {
  const auto& uz = req.config.zero_optimization;
  const PlacementChoice own{{uz.stage, uz.offload_optimizer.device, uz.offload_param.device},
                            uz.offload_optimizer.ratio};
  const DType own_dtype = req.config.precision_dtype();
  const cpu_adam::MomentStorage own_storage = own_moments(req.config);
  std::string reason;
  const bool own_runnable = !(own.uses_nvme() && !caps.nvme_bytes);
  if (!own_runnable) {
    reason = fmt::format("the config's own placement ({}) needs NVMe and no NVMe folder was given",
                         label_of(own, own_dtype, own_storage));
  } else {
    const FitCandidate mine = fit_one(req, caps, own, own_dtype, own_storage);
    reason = mine.fits ? fmt::format("predicted {:.1f} ms per step vs {:.1f} ms with the config's own placement ({})",
                                     r.fitting.empty() ? 0.0 : r.fitting.front().predicted.step_ms,
                                     mine.predicted.step_ms, mine.label)
                       : fmt::format("the config's own placement ({}) does not fit: {}", mine.label, mine.bound);
  }
  for (FitCandidate& c : r.fitting)
    for (FitChange& ch : c.changes)
      if (ch.reason.empty() && is_placement_key(ch.key)) ch.reason = reason;
}

}  // namespace

std::string describe_fit_change(const FitChange& c) {
  return fmt::format("{} {} -> {}: {}", c.key, c.before, c.after, c.reason.empty() ? "changed" : c.reason);
}

Result<FitCandidate> fit_placement(const FitRequest& req, const FitCaps& caps, int stage, OffloadDevice optimizer,
                                   OffloadDevice param, double ratio, DType dtype,
                                   const cpu_adam::MomentStorage& moments) {
  STRATA_RETURN_IF_ERROR(check_inputs(req, caps));
  const PlacementChoice p{{stage, optimizer, param}, ratio};
  if (!holds(p, moments))
    return InvalidArgument(fmt::format("{}: int8 optimizer states need the optimizer state offloaded (cpu or nvme) "
                                       "with ratio 1",
                                       label_of(p, dtype, moments)));
  return fit_one(req, caps, p, dtype, moments);
}

Result<FitResult> fit_config(const FitRequest& req, const FitCaps& caps) {
  STRATA_RETURN_IF_ERROR(check_inputs(req, caps));
  FitResult r = search(req, caps);
  if (r.ok()) {
    explain_placement(r, req, caps);
    return r;
  }
  const FitCandidate* near = closest(r, caps);
  r.missing = near != nullptr ? fmt::format("the closest placement, {}: {}", near->label, near->bound)
                              : std::string("no placement could be planned");
  // The smallest single changes that fit: a dtype or storage the request
  // did not allow, searched alone and suggested when it fits.
  auto suggest_if_it_fits = [&](const FitRequest& changed, const std::string& what) {
    const FitResult t = search(changed, caps);
    if (t.ok())
      r.suggestions.push_back(fmt::format("{}: {} fits, predicted {:.1f} ms per step", what, t.fitting.front().label,
                                          t.fitting.front().predicted.step_ms));
  };
  const std::vector<DType> allowed = req.dtypes.empty() ? std::vector<DType>{req.config.precision_dtype()} : req.dtypes;
  if (std::find(allowed.begin(), allowed.end(), DType::kBF16) == allowed.end()) {
    FitRequest bf = req;
    bf.dtypes = {DType::kBF16};
    suggest_if_it_fits(bf, "bf16 parameters and gradients (--dtype bf16, or bf16.enabled)");
  }
  // bf16 gradients: half the gradient buffers and shards (a row's effective
  // gradient dtype is the config's key, or the parameter dtype without one).
  const bool bf16_grads_tried =
      std::find(req.grad_dtypes.begin(), req.grad_dtypes.end(), DType::kBF16) != req.grad_dtypes.end() ||
      (req.grad_dtypes.empty() && req.config.data_types.grad_accum_dtype == "bf16");
  if (!bf16_grads_tried) {
    FitRequest half = req;
    half.grad_dtypes = {DType::kBF16};
    suggest_if_it_fits(half, "bf16 gradients (--grad-dtypes bf16, or data_types.grad_accum_dtype \"bf16\"; half the "
                             "gradient buffers and shards)");
  }
  const std::vector<cpu_adam::MomentStorage> allowed_storages =
      req.moment_storages.empty() ? std::vector<cpu_adam::MomentStorage>{own_moments(req.config)} : req.moment_storages;
  if (std::find(allowed_storages.begin(), allowed_storages.end(), cpu_adam::MomentStorage::int8()) ==
      allowed_storages.end()) {
    FitRequest eight = req;
    eight.moment_storages = {cpu_adam::MomentStorage::int8()};
    suggest_if_it_fits(eight, "8-bit optimizer states (--optimizer-states int8, or strata.optimizer_state_dtype "
                              "\"int8\"; about half the offloaded state's bytes)");
  }
  // Both bounds fit an int: req.world is at most kMaxModeledWorld (2^24).
  const int most_ranks = static_cast<int>(std::min<uint64_t>(uint64_t{64} * static_cast<uint64_t>(req.world),
                                                             kMaxModeledWorld));
  for (int w = req.world * 2; w <= most_ranks; w *= 2) {
    FitRequest more = req;
    more.world = w;
    FitCaps c2 = caps;
    if (caps.ranks_per_node == req.world) c2.ranks_per_node = w;  // all on this node: they share its host
    FitResult t = search(more, c2);
    if (t.ok()) {
      r.suggestions.push_back(fmt::format("--ranks {} (ZeRO shards the state {} ways): {} fits, predicted {:.1f} ms "
                                          "per step",
                                          w, w, t.fitting.front().label, t.fitting.front().predicted.step_ms));
      break;
    }
  }
  for (int b = req.micro_batch / 2; b >= 1; b /= 2) {
    FitRequest smaller = req;
    smaller.micro_batch = b;
    const int64_t accum = static_cast<int64_t>(req.grad_accum) * req.micro_batch / b;
    if (accum > 1'000'000) break;
    smaller.grad_accum = static_cast<int>(accum);
    FitResult t = search(smaller, caps);
    if (t.ok()) {
      r.suggestions.push_back(fmt::format("--batch {} --grad-accum {} (the same global batch, smaller activations): "
                                          "{} fits, predicted {:.1f} ms per step",
                                          b, accum, t.fitting.front().label, t.fitting.front().predicted.step_ms));
      break;
    }
    if (b == 1) break;
  }
  return r;
}

}  // namespace strata::offload
