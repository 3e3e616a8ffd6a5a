#pragma once
// The `torch` communicator: the engine's collectives over torch.distributed
// (gloo), for ranks that a PyTorch launcher started (torchrun, the
// `deepspeed` launcher, accelerate, SLURM wrappers: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) or that joined a process group the user made.
// strata/torch/_launcher.py joins the job; this runs the collectives (Note
// [Collectives over torch.distributed] in the .cpp).
#include <memory>

#include <pybind11/pybind11.h>

#include "strata/comm/communicator.h"

namespace strata::python {

namespace py = pybind11;

// This process as one rank of torch.distributed's default group, which must
// be initialized. Makes one gloo group per CommQueue (dist.new_group, a
// collective every rank makes in the same order when its engine is made).
// Call with the GIL held. options.timeout bounds every collective (0: the
// longest watchdog, kMaxCommTimeout); options.debug_checks adds the
// handshake that names mismatched and missing ranks.
Result<std::unique_ptr<comm::Communicator>> create_torch_distributed_communicator(comm::CommOptions options);

// True on a torch communicator's worker while it calls torch (the GIL
// held): Python's garbage collector may run there and drop an engine, whose
// teardown must then not wait for that very worker.
bool on_torch_comm_worker();

// The world size of torch.distributed's default group when torch.distributed
// is imported and initialized, else 0 (nothing imported here). GIL held.
int torch_distributed_world_size();

}  // namespace strata::python
