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

Result<StepTimePrediction> predict_step_time(const StepTimeInput& in, const HardwareProfile& hw) {
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
  StepTimePrediction r;
  r.bytes = predict_link_bytes(in);
  const LinkBytes& b = r.bytes;
  const double P = static_cast<double>(in.params);
  const double S = std::ceil(P / in.world);
  const Placement& pl = in.placement;
  const bool off = pl.optimizer_offloaded();
  const bool early = early_updates_run(in, hw);
  // Ranks that share one node's host (CPU optimizer, NVMe drives); with
  // shared_cores they share every rate, the device's compute included.
  const double per_node = hw.shared_cores ? in.world : std::min(in.world, hw.gpus_per_node);
  const double device_share = hw.shared_cores ? in.world : 1.0;
  auto ms = [](double bytes, double gb_per_s, double share) { return bytes / (gb_per_s * 1e9 / share) * 1e3; };

  r.compute_ms = in.tokens_per_rank * in.flops_per_token / (hw.compute_gflops * 1e9 / device_share) * 1e3;
  r.forward_ms = r.compute_ms / 3;
  r.backward_ms = r.compute_ms - r.forward_ms;

  // The optimizer: stage 0 steps every element on every rank, stages 1-3 their shard; a ratio < 1 steps
  // the host part on the host thread and the rest on the device side at the same time.
  const double stepped = pl.optimizer_sharded() ? S : P;
  const double host_elems = off ? in.ratio * stepped : 0.0;
  const double dev_elems = stepped - host_elems;
  const double cpu_rate = hw.cpu_adam_params_per_s(in.param_dtype, in.moments) / per_node;
  const double dev_rate = hw.shared_cores ? cpu_rate : hw.device_adam_params_per_s;
  const double cpu_step_ms = host_elems / cpu_rate * 1e3;  // the CPU step alone, no NVMe
  double host_ms = cpu_step_ms;
  const double dev_ms = dev_elems / dev_rate * 1e3;
  const double opt_nvme_bytes = pl.optimizer_on_nvme() ? (4 + in.moments.bytes_per_element()) * S : 0.0;
  // Gradient shards on NVMe: read back in the step beside the state; written under the backward (grad_ms).
  const double grad_nvme_bytes =
      in.gradients_on_nvme ? (off ? in.ratio * S : 0.0) * static_cast<double>(dtype_size(in.grad_dtype)) : 0.0;
  const double grad_write_ms = ms(grad_nvme_bytes, hw.nvme_write_gb_per_s, per_node);
  const double opt_read_ms = ms(opt_nvme_bytes + grad_nvme_bytes, hw.nvme_read_gb_per_s, per_node);
  const double opt_write_ms = ms(opt_nvme_bytes, hw.nvme_write_gb_per_s, per_node);
  // The pipeline overlaps the state's NVMe traffic with the CPU step, but its reads and writes share the
  // drives: measured 2026-12-02 at 1 and 2 ranks, the phase took about reads + writes (213 ms for 303 MB read
  // and 311 MB written, rates 2.2 and 5.1 GB/s alone), not the longer of the two.
  host_ms = in.nvme_pipeline ? std::max(host_ms, opt_read_ms + opt_write_ms) : host_ms + opt_read_ms + opt_write_ms;
  // Whether the CPU optimizer runs on the cores the compute runs on: then
  // nothing it does overlaps the compute (HardwareProfile::optimizer_on_own_cores).
  const bool optimizer_shares_compute_cores = hw.shared_cores && !hw.optimizer_on_own_cores;
  r.optimizer_ms = optimizer_shares_compute_cores ? host_ms + dev_ms : std::max(host_ms, dev_ms);

  // A collective of B bytes per rank takes (N-1)/N x B / busbw, the busbw
  // measured with every rank of the group running (nccl-tests' convention;
  // on shared cores `strata report --calibrate` times its local ranks
  // together, so the sharing is in the rate already). At world size 1 the
  // engine queues none (the sum over one rank is the gradient itself, a
  // gather of one shard is the shard), so nothing moves.
  const double coll = in.world > 1 ? static_cast<double>(in.world - 1) / in.world : 0.0;
  const double gather_ms = ms(static_cast<double>(b.gather) * coll, hw.collective_bus_gb_per_s, 1.0);
  const double reduce_ms = ms(static_cast<double>(b.reduce) * coll, hw.collective_bus_gb_per_s, 1.0);
  const double h2d_ms = ms(static_cast<double>(b.h2d), hw.h2d_gb_per_s, device_share);
  const double d2h_ms = ms(static_cast<double>(b.d2h), hw.d2h_gb_per_s, device_share);
  const double param_nvme_bytes = static_cast<double>(b.nvme_read) - opt_nvme_bytes - grad_nvme_bytes;
  const double param_nvme_ms = ms(param_nvme_bytes, hw.nvme_read_gb_per_s, per_node) +
                               ms(param_nvme_bytes, hw.nvme_write_gb_per_s, per_node);
  r.nvme_ms = opt_read_ms + opt_write_ms + param_nvme_ms + grad_write_ms;
  r.grad_ms = reduce_ms + d2h_ms + grad_write_ms;
  const bool param_off = pl.params_offloaded();
  r.update_ms = (param_off ? 0.0 : h2d_ms) + (pl.updated_params_all_gathered() ? gather_ms : 0.0);
  r.param_ms = pl.params_sharded() ? gather_ms + (param_off ? h2d_ms : 0.0) + param_nvme_ms : 0.0;

  const double L = in.layers;
  if (optimizer_shares_compute_cores) {
    // Every part that runs on the cores adds to the step; NVMe transfers do
    // not use the cores (O_DIRECT DMA), so they hide under the forward (the
    // optimizer's) or the compute (parameter reads) like on a GPU machine.
    const double opt_nvme_ms = opt_read_ms + opt_write_ms;
    // With early updates the state's reads and writes start under the
    // backward, so they hide under backward + forward.
    const double nvme_window = r.forward_ms + (early ? r.backward_ms : 0.0);
    // (Stage 3: the forward runs behind the updates; it waits at least for
    // the first layer's share of the NVMe phase, unless the pipelines read it
    // ahead and write it behind.)
    const double first_layer_nvme_ms = pl.params_sharded() && !in.nvme_pipeline ? opt_nvme_ms / L : 0.0;
    // The cores run the CPU step (and the device part) whatever the pipelines overlap it with.
    const double cores_ms = cpu_step_ms + dev_ms;
    r.exposed_optimizer_ms =
        cores_ms + r.update_ms + std::max(first_layer_nvme_ms, opt_nvme_ms - nvme_window);
    r.exposed_reduce_ms = r.grad_ms;
    r.exposed_gather_ms = (r.param_ms - param_nvme_ms) + std::max(0.0, param_nvme_ms - r.compute_ms);
  } else {
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
        off ? (cpu_step_ms + (in.nvme_pipeline ? 0.0 : opt_read_ms + opt_write_ms) + r.update_ms) * first_share : 0.0;
    // The CPU step hides under the next forward, and with early updates
    // under the backward too; its copies to the device follow the step's end.
    // With early updates and a ratio < 1 the device part is not stepped
    // early: it starts at the step's end and hides under the forward only.
    const double cpu_window = r.forward_ms + (early ? r.backward_ms : 0.0);
    const double windowed_ms = early ? host_ms : r.optimizer_ms;  // what the window hides
    const double device_part_ms = early ? dev_ms : 0.0;
    r.exposed_optimizer_ms = std::max({first_layer_ms, windowed_ms - cpu_window, device_part_ms - r.forward_ms,
                                       r.update_ms - r.forward_ms});
    r.exposed_reduce_ms = std::max(0.0, r.grad_ms - r.backward_ms) + r.grad_ms / L;
    r.exposed_gather_ms = std::max(0.0, r.param_ms - r.compute_ms) + r.param_ms / L;
  }
  r.step_ms = r.compute_ms + r.exposed_optimizer_ms + r.exposed_reduce_ms + r.exposed_gather_ms;
  r.tokens_per_s = in.tokens_per_rank * in.world / (r.step_ms / 1e3);
  r.ideal_ms = std::max({r.compute_ms, r.optimizer_ms, r.update_ms, r.grad_ms, r.param_ms});

  // What bounds the step: the compute unless an exposed part is at least a
  // tenth of it; then the largest exposed part, named by its slowest link.
  const std::pair<double, std::string> exposed[] = {
      {r.exposed_optimizer_ms,
       r.optimizer_ms >= r.update_ms
           ? (opt_read_ms + opt_write_ms > host_ms / 2 ? std::string("nvme (optimizer state)")
                                                      : std::string(off ? "cpu optimizer" : "device optimizer"))
           : std::string(param_off || pl.params_sharded() ? "h2d" : "h2d + all-gather")},
      {r.exposed_reduce_ms, d2h_ms > reduce_ms ? "d2h" : "collectives (reduce)"},
      {r.exposed_gather_ms, param_nvme_ms > gather_ms ? "nvme (parameters)" : (h2d_ms > gather_ms && param_off ? "h2d" : "collectives (gather)")}};
  const auto* worst = &exposed[0];
  for (const auto& e : exposed)
    if (e.first > worst->first) worst = &e;
  r.bound = worst->first >= 0.1 * r.compute_ms ? worst->second : "compute";
  return r;
}

}  // namespace strata::offload
