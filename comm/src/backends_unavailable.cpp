// Backends compiled out of this build answer Unsupported with the reason,
// so callers and `strata report` can say what is missing and how to get it.
#include <fmt/format.h>

#include "strata/comm/backends.h"

namespace strata::comm {

#if !defined(STRATA_HAVE_MPI)
bool mpi_compiled() { return false; }
std::string mpi_library_version() { return "not built (no MPI found at configure time; install libopenmpi-dev)"; }
bool launched_by_mpi() { return false; }
Result<std::unique_ptr<Communicator>> create_mpi_communicator(CommOptions) {
  return Unsupported("the mpi communicator is not in this build: install libopenmpi-dev and reconfigure, or use "
                     "--backend local");
}
#endif

#if !defined(STRATA_HAVE_NCCL)
bool nccl_compiled() { return false; }
std::string nccl_version() { return "not built (CUDA toolkit or NCCL not found at configure time)"; }
Result<std::unique_ptr<Communicator>> create_nccl_communicator(NcclOptions) {
  return Unsupported("the nccl communicator is not in this build: it needs the CUDA toolkit and NCCL at configure "
                     "time; use --backend mpi or local");
}
#endif

#if !defined(STRATA_HAVE_NCCL)
Result<int> cuda_device_count() { return Unsupported("this build of strata_comm has no CUDA support"); }
#endif

}  // namespace strata::comm
