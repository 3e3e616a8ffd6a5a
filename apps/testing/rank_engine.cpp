// create_rank_engine of `strata-testing` (engine_run.h), the test-only build
// of the CLI (never installed): the engine created through the testing seam
// (strata/offload/testing/engine_seam.h) with the faults these environment
// variables ask for (docs/engine.md "Errors", docs/checkpoints.md):
//  - STRATA_FAULTS: faults injected into the NVMe I/O of the optimizer state
//    (on=optimizer, the default) or the stage-3 parameter shards
//    (on=params), to see what a failing drive does to a run; the rest is a
//    nvme::FaultPlan's text (strata/nvme/testing/fault_injection.h);
//  - STRATA_CHECKPOINT_CRASH_AT=<point>[@TAG]: SIGKILL at that point of rank
//    0's checkpoint commit (of the save of TAG only, when given).
#include <cstdlib>

#include <fmt/format.h>

#include "engine_run.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/offload/testing/engine_seam.h"

namespace strata::cli {

namespace {

// STRATA_FAULTS: the fault plan's text and where it goes (on=optimizer|params).
struct FaultsSpec {
  std::string plan;
  std::string on = "optimizer";
};

Result<FaultsSpec> split_faults_spec(std::string_view text) {
  FaultsSpec f;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(at, end - at);
    if (item.rfind("on=", 0) == 0) {
      f.on = std::string(item.substr(3));
      if (f.on != "optimizer" && f.on != "params")
        return InvalidArgument(fmt::format("STRATA_FAULTS '{}': on '{}' must be optimizer or params",
                                           printable(text, 200), printable(f.on, 32)));
    } else if (!item.empty()) {
      f.plan += (f.plan.empty() ? "" : ",") + std::string(item);
    }
    at = end + 1;
  }
  return f;
}

}  // namespace

Status create_rank_engine(const offload::EngineOptions& options, comm::Communicator& comm, RankState& rs) {
  offload::testing::EngineFaults faults;
  if (const char* env = std::getenv("STRATA_FAULTS"); env != nullptr && *env != '\0') {
    STRATA_ASSIGN_OR_RETURN(FaultsSpec f, split_faults_spec(env));
    const bool params = f.on == "params";
    if (!params && options.offload_optimizer != OffloadDevice::kNvme)
      return InvalidArgument("STRATA_FAULTS is set but the optimizer state is not on NVMe (offload_optimizer.device "
                             "nvme, or --offload-optimizer nvme); unset it, or add on=params for parameter shards");
    if (params && options.offload_param != OffloadDevice::kNvme)
      return InvalidArgument("STRATA_FAULTS on=params is set but the parameter shards are not on NVMe "
                             "(offload_param.device nvme at stage 3); unset it");
    STRATA_ASSIGN_OR_RETURN(nvme::FaultPlan plan, nvme::parse_fault_plan(f.plan));
    STRATA_ASSIGN_OR_RETURN(nvme::IoEngineConfig ec, nvme::io_engine_config(options.nvme.aio));
    plan.seed += static_cast<uint64_t>(comm.rank());
    STRATA_ASSIGN_OR_RETURN(rs.fault_engine, nvme::make_fault_injecting_engine(ec.options, plan));
    (params ? faults.param_io : faults.optimizer_io) = rs.fault_engine.get();
    if (comm.rank() == 0)
      fmt::print(stderr, "STRATA_FAULTS '{}': faults injected into the NVMe I/O of the {} of every rank\n",
                 printable(env, 200), params ? "parameter shards" : "optimizer state");
  }
  if (const char* env = std::getenv("STRATA_CHECKPOINT_CRASH_AT"); env != nullptr && *env != '\0') {
    const std::string_view at(env);
    const size_t sep = at.find('@');
    faults.checkpoint_crash = offload::testing::CheckpointCrash{
        .point = std::string(at.substr(0, sep)),
        .tag = sep == std::string_view::npos ? std::string() : std::string(at.substr(sep + 1))};
  }
  STRATA_ASSIGN_OR_RETURN(rs.engine,
                          offload::testing::create_engine(options, *rs.runner, *rs.device, comm, faults));
  return Status::Ok();
}

}  // namespace strata::cli
