// The step-time model: see step_time_model.h, Note [The engine's schedule, as a model].
#include "strata/offload/step_time_model.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace strata::offload {

bool early_updates_allowed(SpeculationMode mode, const Placement& placement) {
  return mode != SpeculationMode::kOff && placement.optimizer_offloaded();
}

bool early_updates_run(const StepTimeInput& in, const HardwareProfile& hw) {
  return early_updates_allowed(in.speculation, in.placement) &&
         (in.speculation == SpeculationMode::kOn || !hw.shared_cores);
}

LinkBytes predict_link_bytes(const StepTimeInput& in) {
  const double P = static_cast<double>(in.params);
  const double S = std::ceil(P / in.world);
  const double p = static_cast<double>(dtype_size(in.param_dtype));
  const double g = static_cast<double>(dtype_size(in.grad_dtype));
  const Placement& pl = in.placement;
  const bool off = pl.optimizer_offloaded();
  const double host_elems = off ? in.ratio * S : 0.0;
  LinkBytes b;
  // Stage 0 reduce-scatters and all-gathers the sums back; stages 1-3 reduce-scatter each layer once.
  b.reduce = static_cast<uint64_t>((pl.optimizer_sharded() ? 1.0 : 2.0) * P * g);
  // Stages 1-2 all-gather the updated parameters; stage 3 gathers every layer once per step while the
  // live window holds the whole model, else once for the forward and once for the backward (at world
  // size 1 with the shards on the device, only the layers kept whole, after their update).
  if (pl.shards_acquired_in_place(in.world))
    b.gather = static_cast<uint64_t>(static_cast<double>(in.persistent_params) * p);
  else if (pl.updated_params_all_gathered() || pl.params_sharded())
    b.gather = static_cast<uint64_t>(
        P * p * (pl.params_sharded() && P > static_cast<double>(in.max_live_parameters) ? 2.0 : 1.0));
  b.d2h = static_cast<uint64_t>(host_elems * g);
  // Updated parameters go H2D (parameter offload: the host shard goes H2D before the gather instead).
  b.h2d = static_cast<uint64_t>((pl.params_offloaded() ? S : host_elems) * p);
  double nvme = pl.optimizer_on_nvme() ? (4 + in.moments.bytes_per_element()) * S : 0.0;
  if (pl.params_on_nvme() && S > static_cast<double>(in.max_in_cpu))
    nvme += (S - static_cast<double>(in.max_in_cpu)) * p;
  if (in.gradients_on_nvme) nvme += host_elems * g;  // written under the backward, read back by the step
  b.nvme_read = b.nvme_write = static_cast<uint64_t>(nvme);
  return b;
}

namespace {

Status check_step_input(const StepTimeInput& in) {
  if (in.params == 0) return InvalidArgument("step-time model: params must be > 0");
  if (in.world < 1) return InvalidArgument(fmt::format("step-time model: world {} must be >= 1", in.world));
  if (in.layers < 1) return InvalidArgument(fmt::format("step-time model: layers {} must be >= 1", in.layers));
  if (in.placement.stage < 0 || in.placement.stage > 3)
    return InvalidArgument(fmt::format("step-time model: stage {} is not 0-3", in.placement.stage));
  if (!(in.first_update_share >= 0 && in.first_update_share <= 1))
    return InvalidArgument(
        fmt::format("step-time model: first_update_share {} is not in [0, 1]", in.first_update_share));
  if (!(in.ratio > 0 && in.ratio <= 1))
    return InvalidArgument(fmt::format("step-time model: ratio {} is not in (0, 1]", in.ratio));
  if (!(in.tokens_per_rank > 0) || !(in.flops_per_token > 0))
    return InvalidArgument("step-time model: tokens per rank and FLOPs per token must be > 0");
  return Status::Ok();
}

// How many ranks share a rate: the ranks of one node share its host (CPU
// optimizer, NVMe drives); with shared_cores they share every rate, the
// device's compute included.
struct RateShares {
  double per_node;
  double device;
};

RateShares rate_shares(const StepTimeInput& in, const HardwareProfile& hw) {
  RateShares s;
  s.per_node = hw.shared_cores ? in.world : std::min(in.world, hw.gpus_per_node);
  s.device = hw.shared_cores ? in.world : 1.0;
  return s;
}

double transfer_ms(double bytes, double gb_per_s, double share) { return bytes / (gb_per_s * 1e9 / share) * 1e3; }

// The optimizer's parts: the CPU step, the device part, and the NVMe
// traffic of the state and of the gradient shards read back beside it.
struct OptimizerTimes {
  double cpu_step_ms;  // the CPU step alone, no NVMe
  double host_ms;      // the CPU step with the state's NVMe reads and writes
  double dev_ms;       // the device part (ratio < 1, or no offload)
  double opt_nvme_bytes, grad_nvme_bytes;
  double opt_read_ms, opt_write_ms;  // the state's, the gradient shards' reads included
  double grad_write_ms;              // the gradient shards', under the backward (grad_ms)
};

// Stage 0 steps every element on every rank, stages 1-3 their shard; a
// ratio < 1 steps the host part on the host thread and the rest on the
// device side at the same time.
OptimizerTimes optimizer_times(const StepTimeInput& in, const HardwareProfile& hw, const RateShares& shares) {
  const double P = static_cast<double>(in.params);
  const double S = std::ceil(P / in.world);
  const Placement& pl = in.placement;
  const bool off = pl.optimizer_offloaded();
  const double stepped = pl.optimizer_sharded() ? S : P;
  const double host_elems = off ? in.ratio * stepped : 0.0;
  const double dev_elems = stepped - host_elems;
  const double cpu_rate = hw.cpu_adam_params_per_s(in.param_dtype, in.moments) / shares.per_node;
  const double dev_rate = hw.shared_cores ? cpu_rate : hw.device_adam_params_per_s;
  OptimizerTimes t;
  t.cpu_step_ms = host_elems / cpu_rate * 1e3;
  t.dev_ms = dev_elems / dev_rate * 1e3;
  t.opt_nvme_bytes = pl.optimizer_on_nvme() ? (4 + in.moments.bytes_per_element()) * S : 0.0;
  t.grad_nvme_bytes =
      in.gradients_on_nvme ? (off ? in.ratio * S : 0.0) * static_cast<double>(dtype_size(in.grad_dtype)) : 0.0;
  t.grad_write_ms = transfer_ms(t.grad_nvme_bytes, hw.nvme_write_gb_per_s, shares.per_node);
  t.opt_read_ms = transfer_ms(t.opt_nvme_bytes + t.grad_nvme_bytes, hw.nvme_read_gb_per_s, shares.per_node);
  t.opt_write_ms = transfer_ms(t.opt_nvme_bytes, hw.nvme_write_gb_per_s, shares.per_node);
  // The pipeline overlaps the state's NVMe traffic with the CPU step, but its reads and writes share the
  // drives: measured 2026-12-02 at 1 and 2 ranks, the phase took about reads + writes (213 ms for 303 MB read
  // and 311 MB written, rates 2.2 and 5.1 GB/s alone), not the longer of the two.
  t.host_ms = in.nvme_pipeline ? std::max(t.cpu_step_ms, t.opt_read_ms + t.opt_write_ms)
                               : t.cpu_step_ms + t.opt_read_ms + t.opt_write_ms;
  return t;
}

// The links' times for the step's bytes.
struct LinkTimes {
  double gather_ms, reduce_ms, h2d_ms, d2h_ms;
  double param_nvme_ms;  // the parameter shards' NVMe reads and writes
};

// A collective of B bytes per rank takes (N-1)/N x B / busbw, the busbw
// measured with every rank of the group running (nccl-tests' convention;
// on shared cores `strata report --calibrate` times its local ranks
// together, so the sharing is in the rate already). At world size 1 the
// engine queues none (the sum over one rank is the gradient itself, a
// gather of one shard is the shard), so nothing moves.
LinkTimes link_times(const StepTimeInput& in, const HardwareProfile& hw, const RateShares& shares, const LinkBytes& b,
                     const OptimizerTimes& opt) {
  const double coll = in.world > 1 ? static_cast<double>(in.world - 1) / in.world : 0.0;
  LinkTimes t;
  t.gather_ms = transfer_ms(static_cast<double>(b.gather) * coll, hw.collective_bus_gb_per_s, 1.0);
  t.reduce_ms = transfer_ms(static_cast<double>(b.reduce) * coll, hw.collective_bus_gb_per_s, 1.0);
  t.h2d_ms = transfer_ms(static_cast<double>(b.h2d), hw.h2d_gb_per_s, shares.device);
  t.d2h_ms = transfer_ms(static_cast<double>(b.d2h), hw.d2h_gb_per_s, shares.device);
  const double param_nvme_bytes = static_cast<double>(b.nvme_read) - opt.opt_nvme_bytes - opt.grad_nvme_bytes;
  t.param_nvme_ms = transfer_ms(param_nvme_bytes, hw.nvme_read_gb_per_s, shares.per_node) +
                    transfer_ms(param_nvme_bytes, hw.nvme_write_gb_per_s, shares.per_node);
  return t;
}

// What of the optimizer, the reduction and the gather the compute does not hide.
struct ExposedTimes {
  double optimizer_ms, reduce_ms, gather_ms;
};

// The CPU optimizer on the compute's cores: every part that runs on the
// cores adds to the step; NVMe transfers do not use the cores (O_DIRECT
// DMA), so they hide under the forward (the optimizer's) or the compute
// (parameter reads) like on a GPU machine.
ExposedTimes exposed_on_shared_cores(const StepTimeInput& in, const StepTimePrediction& r, const OptimizerTimes& opt,
                                     const LinkTimes& links, bool early) {
  const double opt_nvme_ms = opt.opt_read_ms + opt.opt_write_ms;
  // With early updates the state's reads and writes start under the
  // backward, so they hide under backward + forward.
  const double nvme_window = r.forward_ms + (early ? r.backward_ms : 0.0);
  // (Stage 3: the forward runs behind the updates; it waits at least for
  // the first layer's share of the NVMe phase, unless the pipelines read it
  // ahead and write it behind.)
  const double L = in.layers;
  const double first_layer_nvme_ms = in.placement.params_sharded() && !in.nvme_pipeline ? opt_nvme_ms / L : 0.0;
  // The cores run the CPU step (and the device part) whatever the pipelines overlap it with.
  const double cores_ms = opt.cpu_step_ms + opt.dev_ms;
  return {cores_ms + r.update_ms + std::max(first_layer_nvme_ms, opt_nvme_ms - nvme_window), r.grad_ms,
          (r.param_ms - links.param_nvme_ms) + std::max(0.0, links.param_nvme_ms - r.compute_ms)};
}

// The optimizer on its own cores (or the device), beside the compute.
ExposedTimes exposed_beside_the_compute(const StepTimeInput& in, const StepTimePrediction& r,
                                        const OptimizerTimes& opt, bool early) {
  const double L = in.layers;
  // Note [The first layer's update]: the forward's first layer waits for
  // its own update (late updates step it first; early ones step it last,
  // after its reduction), so one layer's share of the host phase is exposed
  // however long the window: its CPU step, its copy back (update_ms), and
  // its NVMe read and write unless both pipelines take them off the path
  // (read ahead, written behind). The forward then runs behind the rest.
  // A GPT's first compute needs two layers' updates, the embeddings' and
  // the first block's (first_update_share: 0.147 of `small` against 1/L =
  // 0.1; the measured waits were 25-29 and 6-8 ms without and with the
  // pipelines, predicted 24 and 8 with the share, 17 and 5.5 with 1/L).
  const double first_share = in.first_update_share > 0 ? in.first_update_share : 1.0 / L;
  const double first_layer_ms =
      in.placement.optimizer_offloaded()
          ? (opt.cpu_step_ms + (in.nvme_pipeline ? 0.0 : opt.opt_read_ms + opt.opt_write_ms) + r.update_ms) *
                first_share
          : 0.0;
  // The CPU step hides under the next forward, and with early updates
  // under the backward too; its copies to the device follow the step's end.
  // With early updates and a ratio < 1 the device part is not stepped
  // early: it starts at the step's end and hides under the forward only.
  const double cpu_window = r.forward_ms + (early ? r.backward_ms : 0.0);
  const double windowed_ms = early ? opt.host_ms : r.optimizer_ms;  // what the window hides
  const double device_part_ms = early ? opt.dev_ms : 0.0;
  return {std::max({first_layer_ms, windowed_ms - cpu_window, device_part_ms - r.forward_ms,
                    r.update_ms - r.forward_ms}),
          std::max(0.0, r.grad_ms - r.backward_ms) + r.grad_ms / L,
          std::max(0.0, r.param_ms - r.compute_ms) + r.param_ms / L};
}

// What bounds the step: the compute unless an exposed part is at least a
// tenth of it; then the largest exposed part, named by its slowest link.
std::string step_bound(const StepTimePrediction& r, const OptimizerTimes& opt, const LinkTimes& links,
                       const Placement& pl) {
  const bool param_off = pl.params_offloaded();
  const std::pair<double, std::string> exposed[] = {
      {r.exposed_optimizer_ms,
       r.optimizer_ms >= r.update_ms
           ? (opt.opt_read_ms + opt.opt_write_ms > opt.host_ms / 2
                  ? std::string("nvme (optimizer state)")
                  : std::string(pl.optimizer_offloaded() ? "cpu optimizer" : "device optimizer"))
           : std::string(param_off || pl.params_sharded() ? "h2d" : "h2d + all-gather")},
      {r.exposed_reduce_ms, links.d2h_ms > links.reduce_ms ? "d2h" : "collectives (reduce)"},
      {r.exposed_gather_ms, links.param_nvme_ms > links.gather_ms
                                ? "nvme (parameters)"
                                : (links.h2d_ms > links.gather_ms && param_off ? "h2d" : "collectives (gather)")}};
  const auto* worst = &exposed[0];
  for (const auto& e : exposed)
    if (e.first > worst->first) worst = &e;
  return worst->first >= 0.1 * r.compute_ms ? worst->second : "compute";
}

}  // namespace

Result<StepTimePrediction> predict_step_time(const StepTimeInput& in, const HardwareProfile& hw) {
  STRATA_RETURN_IF_ERROR(check_step_input(in));
  StepTimePrediction r;
  r.bytes = predict_link_bytes(in);
  const Placement& pl = in.placement;
  const RateShares shares = rate_shares(in, hw);
  r.compute_ms = in.tokens_per_rank * in.flops_per_token / (hw.compute_gflops * 1e9 / shares.device) * 1e3;
  r.forward_ms = r.compute_ms / 3;
  r.backward_ms = r.compute_ms - r.forward_ms;

  const OptimizerTimes opt = optimizer_times(in, hw, shares);
  // Whether the CPU optimizer runs on the cores the compute runs on: then
  // nothing it does overlaps the compute (HardwareProfile::optimizer_on_own_cores).
  const bool optimizer_shares_compute_cores = hw.shared_cores && !hw.optimizer_on_own_cores;
  r.optimizer_ms = optimizer_shares_compute_cores ? opt.host_ms + opt.dev_ms : std::max(opt.host_ms, opt.dev_ms);

  const LinkTimes links = link_times(in, hw, shares, r.bytes, opt);
  r.nvme_ms = opt.opt_read_ms + opt.opt_write_ms + links.param_nvme_ms + opt.grad_write_ms;
  r.grad_ms = links.reduce_ms + links.d2h_ms + opt.grad_write_ms;
  const bool param_off = pl.params_offloaded();
  r.update_ms = (param_off ? 0.0 : links.h2d_ms) + (pl.updated_params_all_gathered() ? links.gather_ms : 0.0);
  r.param_ms = pl.params_sharded() ? links.gather_ms + (param_off ? links.h2d_ms : 0.0) + links.param_nvme_ms : 0.0;

  const bool early = early_updates_run(in, hw);
  const ExposedTimes exposed = optimizer_shares_compute_cores
                                   ? exposed_on_shared_cores(in, r, opt, links, early)
                                   : exposed_beside_the_compute(in, r, opt, early);
  r.exposed_optimizer_ms = exposed.optimizer_ms;
  r.exposed_reduce_ms = exposed.reduce_ms;
  r.exposed_gather_ms = exposed.gather_ms;
  r.step_ms = r.compute_ms + r.exposed_optimizer_ms + r.exposed_reduce_ms + r.exposed_gather_ms;
  r.tokens_per_s = in.tokens_per_rank * in.world / (r.step_ms / 1e3);
  r.ideal_ms = std::max({r.compute_ms, r.optimizer_ms, r.update_ms, r.grad_ms, r.param_ms});
  r.bound = step_bound(r, opt, links, pl);
  return r;
}

}  // namespace strata::offload
