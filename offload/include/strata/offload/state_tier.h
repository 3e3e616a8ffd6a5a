#pragma once
// Where a rank's optimizer state lives: the fp32 master weights (for 16-bit
// parameters) and the moments of every piece it steps (partition.h).
//
// The engine never touches optimizer state except through open/close of
// one piece at a time, so a tier may keep it in device memory, in pinned
// host memory (offload_optimizer cpu) or, in the next tier, on NVMe behind a
// few pinned slots (open = read into a slot, close(modified) = write back).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "strata/core/device.h"
#include "strata/core/dtype.h"
#include "strata/core/memory_stats.h"
#include "strata/core/status.h"
#include "strata/core/tier.h"
#include "strata/offload/partition.h"

namespace strata::offload {

struct PieceState {
  size_t count = 0;
  float* master = nullptr;  // null when the piece has no master (fp32 params stepped in place)
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType moment_dtype = DType::kF32;
};

class OptimizerStateTier {
 public:
  virtual ~OptimizerStateTier() = default;
  virtual Tier tier() const = 0;
  // "device memory", "pinned host memory"
  virtual std::string describe() const = 0;
  // Allocates piece `id` (count elements): moments zeroed, master from
  // `master_init` (count values) or none when it is empty. OutOfMemory names
  // the piece (`name`) and the tier.
  virtual Status add(const StateId& id, const std::string& name, size_t count, std::span<const float> master_init) = 0;
  // The piece's state, valid until close(); one piece open at a time per id.
  virtual Result<PieceState> open(const StateId& id) = 0;
  virtual Status close(const StateId& id, bool modified) = 0;
  // Bytes of state held in this tier.
  virtual uint64_t bytes() const = 0;
};

// Device memory of `device` (kDevice; needs a host-addressable device, since
// the CPU kernels step it) or pinned host memory from `device` (kPinnedHost).
// Either is also counted in `host_stats` (the engine's own stats, by tier).
Result<std::unique_ptr<OptimizerStateTier>> make_memory_state_tier(Device& device, Tier tier, DType moment_dtype,
                                                                   MemoryStats& host_stats);

}  // namespace strata::offload
