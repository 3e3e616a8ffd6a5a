#pragma once
// strata.torch's GPU ranks: the engine's collectives on NCCL, bootstrapped
// from the job torch.distributed already joined (Note [NCCL for torch ranks]).
//
// Note [NCCL for torch ranks]
// A torch launcher (torchrun, the deepspeed launcher, accelerate) gives every
// rank torch.distributed, not MPI. On the cuda device the engine's buffers are
// device memory, which the gloo communicator cannot reduce, so each rank
// makes an NCCL communicator of the engine's own (its queues, its streams on
// the engine's cuda Device, its canonical reduction order), and the only
// thing torch.distributed carries is NCCL's unique ids: rank 0 makes them and
// broadcasts them over a gloo group made for that broadcast alone, whatever
// backend the user's default group has. That group is bounded by
// strata.wait_timeout_s like every collective of the engine.
#include <cstddef>
#include <memory>
#include <span>

#include "strata/comm/communicator.h"
#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata::python {

// Rank `root`'s `bytes` into every rank's `bytes`, over a gloo group of
// torch.distributed's initialized world. Needs the GIL.
Status torch_broadcast_bytes(std::span<std::byte> bytes, int root, const comm::CommOptions& options);

// This rank's NCCL communicator for GPU `ordinal` of `device` (a cuda
// Device), rank and world as torch.distributed has them. Needs the GIL.
Result<std::unique_ptr<comm::Communicator>> create_nccl_for_torch_ranks(Device& device, int ordinal,
                                                                          const comm::CommOptions& options);

}  // namespace strata::python
