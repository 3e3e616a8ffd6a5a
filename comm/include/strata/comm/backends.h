#pragma once
// Creating communicators. Which backends this build has is a run-time fact:
// a backend compiled out returns Unsupported with the reason.

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/comm/communicator.h"

namespace strata::comm {

// `local`: `world_size` ranks as threads of this process over shared
// memory. Returns one communicator per rank; drive each from its own thread
// (their collectives rendezvous with each other). 1 <= world_size <= 1024.
Result<std::vector<std::unique_ptr<Communicator>>> create_local_group(int world_size, CommOptions options = {});

// `mpi`: this process is one rank of MPI_COMM_WORLD (a duplicate of it).
// Initializes MPI (MPI_THREAD_MULTIPLE, or SERIALIZED) if nobody has, and
// finalizes it at process exit in that case.
Result<std::unique_ptr<Communicator>> create_mpi_communicator(CommOptions options = {});
bool mpi_compiled();
// MPI_Get_library_version text (first line), or why not available.
std::string mpi_library_version();
// True when this process was started by mpirun/srun (PMI/OMPI variables set).
bool launched_by_mpi();

struct NcclOptions {
  CommOptions common;
  // CUDA device; -1 = local rank modulo the device count.
  int device = -1;
  // Rank and world size; -1 = from MPI (if launched by mpirun) or the
  // environment (STRATA_RANK / STRATA_WORLD_SIZE), else 0 and 1.
  int rank = -1;
  int world_size = -1;
  // Unique-id bootstrap: over MPI when launched by mpirun, else through this
  // file on a shared file system (rank 0 writes it; others wait for it).
  // Environment: STRATA_NCCL_ID_FILE.
  std::string id_file;
  // The cuda Device (of GPU `device`) the communicator's streams and comm
  // buffers come from, so they are counted in its memory stats and its
  // streams can gate and be gated by the engine's; must outlive the
  // communicator. Null: the communicator makes its own.
  Device* cuda_device = nullptr;
  // A unique-id bootstrap of the caller's own, taken before MPI and the id
  // file (strata.torch: torch.distributed's job). Called on every rank of a
  // world above one with the ids' bytes, filled in on rank 0; it must leave
  // rank 0's bytes in every rank's.
  std::function<Status(std::span<std::byte> ids)> share_ids;
};
Result<std::unique_ptr<Communicator>> create_nccl_communicator(NcclOptions options = {});
bool nccl_compiled();
// "2.21.5", or why not available.
std::string nccl_version();
// Number of CUDA devices; an error when the driver or runtime is unusable.
Result<int> cuda_device_count();

}  // namespace strata::comm
