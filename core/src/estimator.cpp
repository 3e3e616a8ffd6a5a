// Memory estimator (see estimator.h and docs/estimate.md).
// Note [Ledger with offload]
// Per rank, with Psi parameters, N ranks and shard S = ceil(Psi / N):
//   GPU model state
//     stage 0: (p + g + K) Psi
//     stage 1: (p + g) Psi + K S            (optimizer offload drops K S)
//     stage 2: p Psi + (g + K) S            (optimizer offload drops (g + K) S:
//                                            gradients go to the host shard)
//     stage 3: (p + g + K) S                (optimizer offload drops (g + K) S,
//                                            parameter offload drops p S)
//   Host (optimizer cpu): (K + 4) S  (optimizer state + fp32 gradient shard)
//   Host (optimizer nvme): 4 S, NVMe: K S  (gradients stay in pinned host
//                                           memory; only the state streams)
//   Host (param cpu): p S, NVMe (param nvme): p S
// Partial optimizer offload (ratio r < 1, stage 3, a config's own row)
// keeps (1 - r) of the shard's optimizer state and gradients on the GPU.
#include "strata/core/estimator.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "strata/core/units.h"

namespace strata {
namespace {

// Saturating arithmetic, but never silently: a saturated value marks the
// whole estimate as out of range and estimate_memory() refuses it.
thread_local bool t_saturated = false;
uint64_t mul_sat(uint64_t a, uint64_t b) {
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  if (product > UINT64_MAX) {
    t_saturated = true;
    return UINT64_MAX;
  }
  return static_cast<uint64_t>(product);
}
uint64_t add_sat(uint64_t a, uint64_t b) {
  if (a > UINT64_MAX - b) {
    t_saturated = true;
    return UINT64_MAX;
  }
  return a + b;
}
uint64_t u(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }


Result<uint32_t> dtype_bytes(std::string_view name, std::string_view what) {
  if (name == "fp32") return 4u;
  if (name == "fp16" || name == "bf16") return 2u;
  return InvalidArgument(fmt::format("{} '{}' is not a dtype (use fp32, fp16 or bf16)", what, name));
}

std::string gb(uint64_t bytes, bool binary) {
  if (bytes == 0) return "0";
  return format_bytes(bytes, binary);
}

std::string fit_text(const std::optional<bool>& fits) {
  if (!fits) return "-";
  return *fits ? "yes" : "NO";
}

}  // namespace

Result<LedgerPrecision> ledger_precision(std::string_view param_dtype, std::string_view grad_dtype,
                                         std::string_view optimizer_state_dtype) {
  LedgerPrecision p;
  STRATA_ASSIGN_OR_RETURN(p.param_bytes, dtype_bytes(param_dtype, "parameter dtype (--precision)"));
  if (grad_dtype.empty()) {
    p.grad_bytes = p.param_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(p.grad_bytes, dtype_bytes(grad_dtype, "gradient dtype (--grad-dtype)"));
  }
  if (optimizer_state_dtype == "fp32") {
    p.optimizer_state_bytes = 12;
  } else if (optimizer_state_dtype == "bf16") {
    p.optimizer_state_bytes = 8;
  } else if (optimizer_state_dtype == "int8") {
    p.optimizer_state_bytes = 6;
    p.moment_block = 256;  // cpu_adam::kDefaultMomentBlockElements (core cannot include cpu_adam)
  } else {
    return InvalidArgument(fmt::format("optimizer state dtype (--optimizer-states) '{}' is not fp32, bf16 or int8",
                                       optimizer_state_dtype));
  }
  return p;
}

uint64_t LedgerPrecision::optimizer_state_of(uint64_t n) const {
  const uint64_t scales = moment_block == 0 ? 0 : mul_sat(8, n / moment_block + (n % moment_block != 0));
  return add_sat(mul_sat(optimizer_state_bytes, n), scales);
}

LedgerPrecision ledger_precision_of(const Config& config) {
  auto p = ledger_precision(train_precision_name(config.precision()), config.data_types.grad_accum_dtype,
                            config.strata.optimizer_state_dtype);
  return p.ok() ? *p : LedgerPrecision{};
}

void EstimateInput::from_config(const Config& config) {
  precision = ledger_precision_of(config);
  zero = config.zero_optimization;
  aio = config.aio;
  overlap_comm_given = true;
  config_row = placement_of(config.zero_optimization);
}

std::vector<Placement> estimate_placements() {
  constexpr OffloadDevice kDevices[] = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
  std::vector<Placement> out;
  out.push_back({0, OffloadDevice::kNone, OffloadDevice::kNone});
  for (int stage = 1; stage <= 2; ++stage) {
    for (OffloadDevice opt : kDevices) out.push_back({stage, opt, OffloadDevice::kNone});
  }
  for (OffloadDevice opt : kDevices) {
    for (OffloadDevice param : kDevices) out.push_back({3, opt, param});
  }
  return out;
}

Result<EstimateRow> estimate_row(const EstimateInput& in, const Placement& pl) {
  if (!pl.stage_admits_offloads()) {
    return InvalidArgument(fmt::format("placement stage {} / optimizer {} / param {} is not valid: optimizer offload needs "
                                       "stage 1-3 and parameter offload stage 3",
                                       pl.stage, offload_device_name(pl.optimizer), offload_device_name(pl.param)));
  }
  const uint64_t psi = in.params;
  const uint64_t world = std::max<uint64_t>(1, in.world_size());
  const uint64_t shard = (psi + world - 1) / world;
  const uint64_t p = in.precision.param_bytes, g = in.precision.grad_bytes;
  auto k_of = [&](uint64_t n) { return in.precision.optimizer_state_of(n); };
  const uint64_t gc = in.precision.offload_grad_bytes;

  EstimateRow row;
  row.placement = pl;
  row.is_config = in.config_row && *in.config_row == pl;

  // Elements of the shard whose optimizer state is offloaded (partial
  // offload only for the config's own stage-3 row).
  uint64_t offloaded = pl.optimizer_offloaded() ? shard : 0;
  const double ratio = in.zero.offload_optimizer.ratio;
  if (row.is_config && pl.partial_offload_possible() && ratio < 1.0) {
    offloaded = static_cast<uint64_t>(std::llround(static_cast<double>(shard) * ratio));
  }
  const uint64_t kept = shard - offloaded;  // optimizer-state elements still on the GPU

  uint64_t gpu = 0;
  switch (pl.stage) {
    case 0: gpu = add_sat(mul_sat(p + g, psi), k_of(psi)); break;
    case 1: gpu = add_sat(mul_sat(p + g, psi), k_of(kept)); break;
    case 2: gpu = add_sat(mul_sat(p, psi), add_sat(mul_sat(g, kept), k_of(kept))); break;
    default:
      gpu = add_sat(pl.params_offloaded() ? 0 : mul_sat(p, shard), add_sat(mul_sat(g, kept), k_of(kept)));
      break;
  }
  uint64_t host_rank = 0, nvme_rank = 0;
  if (pl.optimizer_in_host_memory()) host_rank = add_sat(host_rank, add_sat(mul_sat(gc, offloaded), k_of(offloaded)));
  if (pl.optimizer_on_nvme()) {
    host_rank = add_sat(host_rank, mul_sat(gc, offloaded));
    nvme_rank = add_sat(nvme_rank, k_of(offloaded));
  }
  if (pl.params_in_host_memory()) host_rank = add_sat(host_rank, mul_sat(p, shard));
  if (pl.params_on_nvme()) nvme_rank = add_sat(nvme_rank, mul_sat(p, shard));

  // Buffers.
  BufferBytes& b = row.buffers;
  const ZeroConfig& z = in.zero;
  const bool overlap = in.overlap_comm_given ? z.overlap_comm : pl.params_sharded();
  b.reduce_buckets = mul_sat(mul_sat(u(z.reduce_bucket_size), g), overlap ? 2 : 1);
  if (pl.updated_params_all_gathered()) b.allgather_bucket = mul_sat(u(z.allgather_bucket_size), p);
  if (pl.params_sharded()) {
    const uint64_t layer = in.largest_layer_params;
    const uint64_t window = std::min(u(z.stage3_max_live_parameters), add_sat(layer, u(z.stage3_prefetch_bucket_size)));
    b.live_params = mul_sat(std::max(layer, window), p);
    b.layer_grads = mul_sat(layer, g);
  }
  if (pl.optimizer_on_nvme()) {
    const uint64_t sub_group = std::min(u(z.sub_group_size), offloaded);
    b.optimizer_swap = mul_sat(u(z.offload_optimizer.buffer_count), k_of(sub_group));
  }
  if (pl.params_on_nvme()) {
    b.param_swap = mul_sat(mul_sat(u(z.offload_param.buffer_count), u(z.offload_param.buffer_size)), p);
    b.param_cache = mul_sat(std::min(u(z.offload_param.max_in_cpu), shard), p);
  }
  if (pl.uses_nvme()) {
    b.aio = mul_sat(mul_sat(u(in.aio.block_size), u(in.aio.queue_depth)), u(in.aio.intra_op_parallelism));
  }

  row.gpu_model_state_bytes = gpu;
  row.gpu_buffer_bytes = b.gpu_total();
  row.cpu_bytes_per_node = mul_sat(host_rank, in.gpus_per_node);
  row.cpu_buffer_bytes_per_node = mul_sat(b.host_total(), in.gpus_per_node);
  row.nvme_bytes_per_node = mul_sat(nvme_rank, in.gpus_per_node);

  if (in.gpu_memory_bytes) row.gpu_fits = add_sat(row.gpu_model_state_bytes, row.gpu_buffer_bytes) <= *in.gpu_memory_bytes;
  if (in.cpu_memory_bytes)
    row.cpu_fits = add_sat(row.cpu_bytes_per_node, row.cpu_buffer_bytes_per_node) <= *in.cpu_memory_bytes;
  if (in.nvme_memory_bytes) row.nvme_fits = row.nvme_bytes_per_node <= *in.nvme_memory_bytes;
  if (row.gpu_fits || row.cpu_fits || row.nvme_fits) {
    row.fits = row.gpu_fits.value_or(true) && row.cpu_fits.value_or(true) && row.nvme_fits.value_or(true);
  }
  return row;
}

Result<Estimate> estimate_memory(const EstimateInput& input) {
  if (input.params == 0) {
    return InvalidArgument("--params must be a positive parameter count (examples: 7B, 7e9, 350M)");
  }
  if (input.largest_layer_params > input.params) {
    return InvalidArgument(fmt::format("--largest-layer {} exceeds --params {}: the largest layer is part of the model",
                                       input.largest_layer_params, input.params));
  }
  if (input.gpus_per_node == 0 || input.nodes == 0) {
    return InvalidArgument(fmt::format("--gpus-per-node {} and --nodes {} must both be at least 1", input.gpus_per_node,
                                       input.nodes));
  }
  if (input.world_size() > kMaxModeledWorld) {
    return InvalidArgument(fmt::format("--gpus-per-node {} x --nodes {} = {} GPUs is more than the {} the estimator "
                                       "models; give a realistic cluster size",
                                       input.gpus_per_node, input.nodes, input.world_size(), kMaxModeledWorld));
  }
  if (input.config_row && !input.config_row->stage_admits_offloads()) {
    return InvalidArgument("the config's stage and offload devices are not a valid combination");
  }
  t_saturated = false;
  Estimate estimate;
  estimate.input = input;
  for (const Placement& pl : estimate_placements()) {
    STRATA_ASSIGN_OR_RETURN(EstimateRow row, estimate_row(input, pl));
    estimate.rows.push_back(row);
  }
  // A config with partial offload (ratio < 1) gets its own extra row.
  if (input.config_row && input.config_row->partial_offload_possible() &&
      input.zero.offload_optimizer.ratio < 1.0) {
    for (EstimateRow& row : estimate.rows) {
      if (row.is_config) {
        EstimateInput full = input;
        full.config_row.reset();
        STRATA_ASSIGN_OR_RETURN(row, estimate_row(full, row.placement));
      }
    }
    STRATA_ASSIGN_OR_RETURN(EstimateRow partial, estimate_row(input, *input.config_row));
    estimate.rows.push_back(partial);
  }
  if (t_saturated) {
    t_saturated = false;
    return InvalidArgument(fmt::format(
        "--params {}: the byte counts of this model exceed 2^64 bytes (16 EiB) on at least one row, which the "
        "estimator does not represent; give a smaller parameter count",
        format_count(input.params)));
  }
  return estimate;
}

nlohmann::ordered_json estimate_to_json(const Estimate& e) {
  using nlohmann::ordered_json;
  const EstimateInput& in = e.input;
  ordered_json out;
  out["params"] = in.params;
  out["gpus_per_node"] = in.gpus_per_node;
  out["nodes"] = in.nodes;
  out["world_size"] = in.world_size();
  out["largest_layer_params"] = in.largest_layer_params == 0 ? ordered_json() : ordered_json(in.largest_layer_params);
  out["bytes_per_param"] = {{"param", in.precision.param_bytes},
                            {"grad", in.precision.grad_bytes},
                            {"optimizer_state", in.precision.optimizer_state_bytes},
                            {"offloaded_grad", in.precision.offload_grad_bytes}};
  auto opt = [](const std::optional<uint64_t>& v) { return v ? ordered_json(*v) : ordered_json(); };
  out["gpu_memory_bytes"] = opt(in.gpu_memory_bytes);
  out["cpu_memory_bytes"] = opt(in.cpu_memory_bytes);
  out["nvme_memory_bytes"] = opt(in.nvme_memory_bytes);
  out["rows"] = ordered_json::array();
  for (const EstimateRow& r : e.rows) {
    ordered_json row;
    row["stage"] = r.placement.stage;
    row["offload_optimizer"] = std::string(offload_device_name(r.placement.optimizer));
    row["offload_param"] = std::string(offload_device_name(r.placement.param));
    row["gpu_model_state_bytes"] = r.gpu_model_state_bytes;
    row["gpu_buffer_bytes"] = r.gpu_buffer_bytes;
    row["cpu_bytes_per_node"] = r.cpu_bytes_per_node;
    row["cpu_buffer_bytes_per_node"] = r.cpu_buffer_bytes_per_node;
    row["nvme_bytes_per_node"] = r.nvme_bytes_per_node;
    row["fits"] = r.fits ? ordered_json(*r.fits) : ordered_json();
    row["buffers"] = {{"reduce_buckets", r.buffers.reduce_buckets},   {"allgather_bucket", r.buffers.allgather_bucket},
                      {"live_params", r.buffers.live_params},         {"layer_grads", r.buffers.layer_grads},
                      {"optimizer_swap", r.buffers.optimizer_swap},   {"param_swap", r.buffers.param_swap},
                      {"param_cache", r.buffers.param_cache},         {"aio", r.buffers.aio}};
    row["config"] = r.is_config;
    if (r.is_config && in.zero.offload_optimizer.ratio < 1.0 && r.placement.partial_offload_possible()) {
      row["offload_ratio"] = in.zero.offload_optimizer.ratio;
    }
    out["rows"].push_back(row);
  }
  return out;
}

std::string format_estimate(const Estimate& e, bool binary) {
  const EstimateInput& in = e.input;
  const LedgerPrecision& pr = in.precision;
  std::string out;
  out += fmt::format("Model: {} parameters, largest layer {}; {} node(s) x {} GPU(s) = world size {}\n",
                     format_count(in.params),
                     in.largest_layer_params ? format_count(in.largest_layer_params)
                                             : std::string("unknown (pass --largest-layer to count stage-3 gathers)"),
                     in.nodes, in.gpus_per_node, in.world_size());
  out += fmt::format("Ledger: {} B param + {} B grad + {} B optimizer state{} = {} B/param; offloaded gradients {} B/param\n",
                     pr.param_bytes, pr.grad_bytes, pr.optimizer_state_bytes,
                     pr.moment_block == 0 ? std::string()
                                          : fmt::format(" (+ 8 B of int8 scales per {} params)", pr.moment_block),
                     pr.total(), pr.offload_grad_bytes);
  auto limit = [binary](const std::optional<uint64_t>& v) { return v ? format_bytes(*v, binary) : std::string("?"); };
  if (in.gpu_memory_bytes || in.cpu_memory_bytes || in.nvme_memory_bytes) {
    out += fmt::format("Limits: GPU {} per GPU, CPU {} per node, NVMe {} per node\n", limit(in.gpu_memory_bytes),
                       limit(in.cpu_memory_bytes), limit(in.nvme_memory_bytes));
  } else {
    out += "Limits: none given (pass --gpu-memory and --cpu-memory to see which rows fit)\n";
  }
  out += "\n";
  out += fmt::format("{:>5} {:>9} {:>6} | {:>11} {:>11} | {:>11} {:>11} | {:>11} | {:>4}\n", "stage", "optimizer",
                     "param", "GPU state", "GPU buffers", "CPU/node", "CPU buf/node", "NVMe/node", "fits");
  out += std::string(97, '-') + "\n";
  for (const EstimateRow& r : e.rows) {
    std::string mark;
    if (r.is_config) {
      mark = "  <= config";
      if (in.zero.offload_optimizer.ratio < 1.0 && r.placement.partial_offload_possible())
        mark += fmt::format(" (ratio {})", in.zero.offload_optimizer.ratio);
    }
    out += fmt::format("{:>5} {:>9} {:>6} | {:>11} {:>11} | {:>11} {:>11} | {:>11} | {:>4}{}\n", r.placement.stage,
                       offload_device_name(r.placement.optimizer), offload_device_name(r.placement.param),
                       gb(r.gpu_model_state_bytes, binary), gb(r.gpu_buffer_bytes, binary),
                       gb(r.cpu_bytes_per_node, binary), gb(r.cpu_buffer_bytes_per_node, binary),
                       gb(r.nvme_bytes_per_node, binary), fit_text(r.fits), mark);
  }
  const ZeroConfig& z = in.zero;
  out += "\n";
  out += "GPU state: model state per GPU (design.md ledger). GPU buffers: reduce buckets (reduce_bucket_size x grad bytes,\n"
         "  x2 with overlap_comm), stages 1-2 all-gather bucket, stage 3 live parameters (largest layer + prefetch,\n"
         "  capped by max_live_parameters) and the gathered layer's gradients.\n"
         "CPU/node: offloaded optimizer state + fp32 gradient shard, offloaded parameters. CPU buf/node: NVMe swap\n"
         "  buffers (optimizer buffer_count x sub-group, param buffer_count x buffer_size), param cache (max_in_cpu),\n"
         "  aio buffers (block_size x queue_depth x intra_op_parallelism), all per GPU x GPUs per node.\n";
  out += fmt::format(
      "Settings: reduce_bucket_size {}, allgather_bucket_size {}, sub_group_size {}, prefetch {}, max_live {}, "
      "optimizer buffer_count {}, param buffer_count {} x buffer_size {}, aio {} B x {} x {}\n",
      format_count(u(z.reduce_bucket_size)), format_count(u(z.allgather_bucket_size)), format_count(u(z.sub_group_size)),
      format_count(u(z.stage3_prefetch_bucket_size)), format_count(u(z.stage3_max_live_parameters)),
      z.offload_optimizer.buffer_count, z.offload_param.buffer_count, format_count(u(z.offload_param.buffer_size)),
      in.aio.block_size, in.aio.queue_depth, in.aio.intra_op_parallelism);
  out += "Not included: activations, temporary buffers of kernels, allocator fragmentation, CUDA context (~0.5-1 GB).\n";
  return out;
}

}  // namespace strata
