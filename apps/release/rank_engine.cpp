// create_rank_engine of the installed `strata` (engine_run.h): the engine as
// the options say, nothing else. It reads no test variable (STRATA_FAULTS,
// STRATA_CHECKPOINT_CRASH_AT): those are strata-testing's
// (apps/testing/rank_engine.cpp), and set here they are ignored like any
// other unknown variable.
#include "engine_run.h"

namespace strata::cli {

Status create_rank_engine(const offload::EngineOptions& options, comm::Communicator& comm, RankState& rs) {
  STRATA_ASSIGN_OR_RETURN(rs.engine, offload::Engine::create(options, *rs.runner, *rs.device, comm));
  return Status::Ok();
}

}  // namespace strata::cli
