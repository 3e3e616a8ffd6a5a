#pragma once
// Internal: MPI services other backends use (the NCCL unique-id bootstrap).
#include <cstddef>

#include "strata/core/status.h"

namespace strata::comm::detail {

// Initializes MPI if needed and reports this process's place in MPI_COMM_WORLD.
Status mpi_world(int* rank, int* world_size);
// MPI_Bcast of `bytes` bytes from `root` over MPI_COMM_WORLD.
Status mpi_broadcast_bytes(void* data, size_t bytes, int root);

}  // namespace strata::comm::detail
