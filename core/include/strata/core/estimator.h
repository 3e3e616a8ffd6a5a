#pragma once
// Memory estimator: model-state bytes per GPU, per-node host and NVMe bytes,
// and the buffers Strata knows, for every ZeRO stage and offload choice.
//
// Model state follows the ledger of design.md exactly (16 bytes per
// parameter with bf16/fp16 params and grads and fp32 master, m, v):
//   stage 0: (p + g + K) Psi     stage 1: (p + g) Psi + K Psi/N
//   stage 2: p Psi + (g + K) Psi/N          stage 3: (p + g + K) Psi/N
// with p = 2, g = 2, K = 12 by default and Psi/N rounded up (shards are
// padded). Optimizer offload moves K Psi/N and the fp32 gradient shard off
// the GPU; parameter offload (stage 3) moves the p Psi/N shard. See
// docs/estimate.md for every formula, the buffers, and a comparison with
// DeepSpeed's estimator. Activations, fragmentation and framework memory
// are not included.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/config.h"
#include "strata/core/placement.h"
#include "strata/core/status.h"

namespace strata {

// Bytes per parameter of each piece of model state.
struct LedgerPrecision {
  uint32_t param_bytes = 2;             // p: 16-bit parameters (4 with fp32 training)
  uint32_t grad_bytes = 2;              // g: gradients on the GPU (4 with fp32 gradients)
  uint32_t optimizer_state_bytes = 12;  // K: fp32 master 4 + m + v (4 + 4, 2 + 2 with bf16, 1 + 1 with int8 states)
  // int8 states: one fp32 scale per moment per block of this many parameters
  // (cpu_adam's block-wise 8-bit moments); 0 for fp32 and bf16 states.
  uint32_t moment_block = 0;
  uint32_t offload_grad_bytes = 4;      // fp32 gradient shard beside offloaded optimizer state
  uint32_t total() const { return param_bytes + grad_bytes + optimizer_state_bytes; }
  // Optimizer-state bytes of `n` parameters: K n, plus the int8 scales.
  uint64_t optimizer_state_of(uint64_t n) const;
};

// `param_dtype` fp32|fp16|bf16, `grad_dtype` "" (same as params) or fp32,
// `optimizer_state_dtype` fp32|bf16|int8 (m and v; the master stays fp32).
Result<LedgerPrecision> ledger_precision(std::string_view param_dtype, std::string_view grad_dtype,
                                         std::string_view optimizer_state_dtype);
// The precision a config trains with.
LedgerPrecision ledger_precision_of(const Config& config);

// One row is a Placement (strata/core/placement.h): a ZeRO stage and where
// optimizer state and parameters live.

// The largest world (ranks) the estimator, `strata plan` and the launchers
// model: shard arithmetic stays exact in 64 bits.
inline constexpr uint64_t kMaxModeledWorld = uint64_t{1} << 24;

struct EstimateInput {
  uint64_t params = 0;                // Psi
  uint64_t largest_layer_params = 0;  // L; 0: unknown (stage-3 gather buffers not counted)
  uint32_t gpus_per_node = 1;
  uint32_t nodes = 1;
  LedgerPrecision precision;
  // Buffer settings: DeepSpeed's defaults, or a config's (from_config).
  ZeroConfig zero;
  AioConfig aio;
  bool overlap_comm_given = false;    // zero.overlap_comm applies to every row; else true at stage 3 only
  std::optional<Placement> config_row;
  std::optional<uint64_t> gpu_memory_bytes;   // per GPU
  std::optional<uint64_t> cpu_memory_bytes;   // per node
  std::optional<uint64_t> nvme_memory_bytes;  // per node

  uint64_t world_size() const { return static_cast<uint64_t>(gpus_per_node) * nodes; }
  // Takes precision, buffer settings and the marked row from a config.
  void from_config(const Config& config);
};

// Known buffers, bytes per GPU (device side) or per rank (host side).
struct BufferBytes {
  uint64_t reduce_buckets = 0;     // GPU: reduce_bucket_size x g, twice with overlap_comm
  uint64_t allgather_bucket = 0;   // GPU, stages 1-2: allgather_bucket_size x p
  uint64_t live_params = 0;        // GPU, stage 3: max(L, min(max_live, L + prefetch)) x p
  uint64_t layer_grads = 0;        // GPU, stage 3: L x g (the gathered layer's full gradient)
  uint64_t optimizer_swap = 0;     // host, optimizer on NVMe: buffer_count x min(sub_group, Psi/N) x K
  uint64_t param_swap = 0;         // host, params on NVMe: buffer_count x buffer_size x p
  uint64_t param_cache = 0;        // host, params on NVMe: min(max_in_cpu, Psi/N) x p
  uint64_t aio = 0;                // host, any NVMe: block_size x queue_depth x intra_op_parallelism
  uint64_t gpu_total() const { return reduce_buckets + allgather_bucket + live_params + layer_grads; }
  uint64_t host_total() const { return optimizer_swap + param_swap + param_cache + aio; }
};

struct EstimateRow {
  Placement placement;
  uint64_t gpu_model_state_bytes = 0;     // per GPU
  uint64_t gpu_buffer_bytes = 0;          // per GPU
  uint64_t cpu_bytes_per_node = 0;        // offloaded model state in host memory
  uint64_t cpu_buffer_bytes_per_node = 0; // host buffers
  uint64_t nvme_bytes_per_node = 0;
  BufferBytes buffers;                    // per GPU / per rank
  std::optional<bool> gpu_fits, cpu_fits, nvme_fits;
  std::optional<bool> fits;               // all known limits hold; empty when no limit was given
  bool is_config = false;
};

struct Estimate {
  EstimateInput input;
  std::vector<EstimateRow> rows;
};

// The placements estimated: stage 0; stages 1-2 x optimizer none/cpu/nvme;
// stage 3 x optimizer none/cpu/nvme x params none/cpu/nvme (16 rows).
std::vector<Placement> estimate_placements();

// One row; `placement` must be valid (offload needs stage >= 1, parameter offload stage 3).
Result<EstimateRow> estimate_row(const EstimateInput& input, const Placement& placement);
// Every row of estimate_placements(); checks the input (params > 0, ...).
Result<Estimate> estimate_memory(const EstimateInput& input);

// {"params", "gpus_per_node", "nodes", "rows": [{"stage", "offload_optimizer", "offload_param",
//  "gpu_model_state_bytes", "gpu_buffer_bytes", "cpu_bytes_per_node", "nvme_bytes_per_node", "fits", ...}]}
nlohmann::ordered_json estimate_to_json(const Estimate& estimate);
// A table for terminals; decimal GB unless `binary` (GiB).
std::string format_estimate(const Estimate& estimate, bool binary);

}  // namespace strata
