// `strata report` section "comm": which collective backends this build and
// machine can use, with library versions.
#include <string>

#include <fmt/format.h>

#include "command.h"
#include "strata/comm/backends.h"

namespace strata::cli {
namespace {

void fill_comm(nlohmann::json& s, const std::string&) {
  s["local"] = "available (ranks as threads over shared memory)";
  s["mpi_built"] = comm::mpi_compiled();
  s["mpi_library"] = comm::mpi_library_version();
  s["launched_by_mpirun"] = comm::launched_by_mpi();
  s["nccl_built"] = comm::nccl_compiled();
  s["nccl_version"] = comm::nccl_version();
  if (comm::nccl_compiled()) {
    Result<int> devices = comm::cuda_device_count();
    s["nccl_usable"] = devices.ok() && *devices > 0
                           ? fmt::format("yes ({} CUDA devices)", *devices)
                           : fmt::format("no: {}", devices.ok() ? "no CUDA device" : devices.status().message());
  }
  Result<comm::CommOptions> opts = comm::apply_comm_environment({});
  s["watchdog_timeout_ms"] = opts.ok() ? std::to_string(opts->timeout.count()) : opts.status().message();
}

ReportSectionRegistration comm_section(60, "comm", fill_comm);

}  // namespace
}  // namespace strata::cli
